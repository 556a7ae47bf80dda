"""The rows the aggregator's store writes and reads, as frozen dataclasses.

Their fields are checked against the SQLAlchemy models at import, so a column added
to a model and not here fails loudly, naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torshmon.history.models import Base

_T = Base.metadata.tables


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job this aggregator served until it stopped, as ``jobs`` remembers it."""

    job: str
    world_size: int
    last_seen_unix_s: float


@dataclass(frozen=True, slots=True)
class TuningSessionRow:
    """One row of ``tuning_sessions`` (the store adds ``aggregator_id``)."""

    id: str
    job: str
    state: str
    trigger: str
    started_unix_s: float
    ended_unix_s: float | None
    baseline_config: Mapping[str, Any]
    best_config: Mapping[str, Any] | None
    baseline_score: float | None
    best_score: float | None
    reason: str
    state_blob: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class TuningTrialRow:
    """One row of ``tuning_trials``; ``command_id`` None keeps the stored one."""

    session_id: str
    job: str
    trial_index: int
    config: Mapping[str, Any]
    command_id: str | None
    state: str
    windows: Sequence[float]
    score: float | None
    decision: str | None
    reason: str
    started_unix_s: float | None
    ended_unix_s: float | None


def _check_fields(cls: type, table: str, added: frozenset[str] = frozenset()) -> None:
    """Fail at import when ``cls``'s fields and ``added`` are not ``table``'s columns."""
    columns = {c.name for c in _T[table].columns if c.identity is None}
    names = {f.name for f in dataclasses.fields(cls)} | added
    if names != columns:
        raise RuntimeError(
            f"{cls.__name__} does not match the model of {table}: missing "
            f"{sorted(columns - names)}, unknown {sorted(names - columns)}"
        )


@dataclass(frozen=True, slots=True)
class EvidenceCaptureRow:
    """One row of ``evidence_captures`` (the store adds ``aggregator_id``)."""

    id: str
    job: str
    alert_id: int | None
    alert_fingerprint: str | None
    rule: str
    profile_ranks: Sequence[int]
    created_unix_s: float


@dataclass(frozen=True, slots=True)
class EvidenceFileRow:
    """One row of ``evidence_files``: a file stored under ``path``, or ``error``."""

    capture_id: str
    rank: int
    name: str
    job: str
    size_bytes: int
    stored_bytes: int
    path: str | None
    error: str
    taken_unix_s: float
    received_unix_s: float


_check_fields(TuningSessionRow, "tuning_sessions", frozenset({"aggregator_id"}))
_check_fields(EvidenceCaptureRow, "evidence_captures", frozenset({"aggregator_id"}))
_check_fields(EvidenceFileRow, "evidence_files")
_check_fields(TuningTrialRow, "tuning_trials")


def row_values(record: Any) -> dict[str, Any]:
    """A dataclass row as column values (mappings and sequences as plain JSON types)."""
    values = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        values[f.name] = value
    return values
