"""The records the history store takes and gives: API rows and listings, the tuning
and evidence rows (checked against their models at import), and the columns of a
finding episode's row."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from torshmon.aggregator.core.findings import Finding
from torshmon.history.models import Base

_T = Base.metadata.tables

#: A row as the API answers it: column name -> value, as the database returned it.
Row = dict[str, Any]

#: The tables the API lists, each with the column it lists them by, newest first.
Listing = Literal[
    "jobs",
    "runs",
    "probe_sessions",
    "alerts",
    "findings",
    "tuning_sessions",
    "tuning_trials",
    "commands",
    "silences",
]
LISTING_ORDER: Final[Mapping[str, str]] = {
    "jobs": "last_seen_unix_ns",
    "runs": "started_unix_ns",
    "probe_sessions": "last_seen_unix_ns",
    "alerts": "id",
    "findings": "id",
    "tuning_sessions": "started_unix_s",
    "tuning_trials": "id",
    "commands": "created_unix_s",
    "silences": "id",
}


class FilterError(ValueError):
    """A listing filter whose value does not fit its column; the text names it."""


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job this aggregator served until it stopped, as ``jobs`` remembers it."""

    job: str
    world_size: int
    last_seen_unix_s: float
    #: Its latest run ("" where its probes sent no run id).
    run_id: str = ""


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
    """One row of ``evidence_captures`` (the store adds ``aggregator_id`` and ``run_id``)."""

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


# The store adds the run (the job's latest when the row is first written).
_check_fields(TuningSessionRow, "tuning_sessions", frozenset({"aggregator_id", "run_id"}))
_check_fields(EvidenceCaptureRow, "evidence_captures", frozenset({"aggregator_id", "run_id"}))
_check_fields(EvidenceFileRow, "evidence_files")
_check_fields(TuningTrialRow, "tuning_trials", frozenset({"run_id"}))


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


def label_rank(labels: Mapping[str, str]) -> int | None:
    rank = labels.get("rank")
    return int(rank) if rank is not None and rank.isdigit() else None


def finding_row(f: Finding, now: float) -> dict[str, Any]:
    """The columns of ``f`` an episode's row takes when opened or updated."""
    return {
        "kind": f.kind,
        "job": f.labels.get("job", ""),
        "run_id": f.labels.get("run") or None,
        "rank": label_rank(f.labels),
        "metric": f.labels.get("metric") or _text(f.details.get("metric")),
        "value": _finite(f.value),
        "score": _finite(f.score),
        "summary": f.summary,
        "recommendation": f.recommendation,
        "severity": f.severity,
        "category": f.category or None,
        "priority": f.priority,
        "expected_gain_ratio": f.expected_gain_ratio,
        "difficulty": f.difficulty or None,
        "since_unix_s": f.since_unix_s,
        "updated_unix_s": now,
        # Detectors may put tuples, sets or numpy scalars in details: JSON-safe as text.
        "details": msgspec.to_builtins(dict(f.details), str_keys=True, enc_hook=str),
    }


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
