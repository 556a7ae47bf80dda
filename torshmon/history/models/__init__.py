"""The history schema: SQLAlchemy models, the one definition of every table.

Alembic migrations, the table documentation (``docs/tables.md``) and the ingest's
bulk inserts all derive from these models. Column names are a contract with the
ingest (``insert(Step.__table__)`` with dicts keyed by column name). Times are Unix
nanoseconds (``*_unix_ns``, integers) where they come from the probe or agent, and
Unix seconds (``*_unix_s``, floats) where the aggregator makes them. A measurement
that was not finite (NaN, inf) is stored as NULL, since SQL has no portable NaN.

The tables live in a module per concept; this package re-exports every name, and
imports them in the order of the tables.
"""

from __future__ import annotations

# The import order is the tables' order (docs/tables.md, the reader's table list).
# isort: off
from torshmon.history.models._base import (
    ALERT_STATES,
    COMMAND_STATUSES,
    FINDING_KINDS,
    ID_TYPE,
    NAMING_CONVENTION,
    Base,
)
from torshmon.history.models.jobs import IngestSeq, Job, ProbeSession, Run
from torshmon.history.models.telemetry import (
    Bucket,
    Collective,
    Config,
    DdpStat,
    InflightReport,
    Step,
)
from torshmon.history.models.samples import GpuSample, NodeSample, RankSample
from torshmon.history.models.commands import Command
from torshmon.history.models.alerts import Alert, AlertEvent, Silence
from torshmon.history.models.findings import Finding
from torshmon.history.models.tuning import TuningSession, TuningTrial
from torshmon.history.models.evidence import EvidenceCapture, EvidenceFile
from torshmon.history.models.rollups import (
    ROLLUP_SOURCES,
    RetentionState,
    Rollup,
    RollupSource,
)
# isort: on

__all__ = [
    "ALERT_STATES",
    "COMMAND_STATUSES",
    "FINDING_KINDS",
    "ID_TYPE",
    "NAMING_CONVENTION",
    "ROLLUP_SOURCES",
    "Alert",
    "AlertEvent",
    "Base",
    "Bucket",
    "Collective",
    "Command",
    "Config",
    "DdpStat",
    "EvidenceCapture",
    "EvidenceFile",
    "Finding",
    "GpuSample",
    "InflightReport",
    "IngestSeq",
    "Job",
    "NodeSample",
    "ProbeSession",
    "RankSample",
    "RetentionState",
    "Rollup",
    "RollupSource",
    "Run",
    "Silence",
    "Step",
    "TuningSession",
    "TuningTrial",
]
