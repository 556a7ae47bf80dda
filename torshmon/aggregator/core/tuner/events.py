"""What flows in and out of a session: step samples, trial records and decisions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import msgspec

from torshmon.aggregator.core.tuner.config import (
    TrialConfig,
)

if TYPE_CHECKING:
    from torshmon.wire import StepRecord


TrialKind: TypeAlias = Literal["baseline", "trial", "verify"]
TrialDecision: TypeAlias = Literal[
    "kept", "rolled_back", "rejected_error", "rejected_loss", "worse", "not_better", "failed"
]
Purpose: TypeAlias = Literal["baseline", "trial", "rollback", "verify", "restore"]


@dataclass(frozen=True, slots=True)
class StepSample:
    """What the tuner reads from one of rank 0's steps.

    Throughput is ``samples_per_s`` when the job reports batch sizes, else steps per
    second from ``duration_s``. ``relative_errors`` are the sampled per-bucket codec
    errors of the step (empty on unsampled steps); ``comm_wait_s`` the time the step
    waited for communication and ``bucket_count`` the DDP buckets it reduced (None where
    not reported): the prior reads them while the baseline is measured.
    """

    step: int
    config_version: int
    samples_per_s: float | None = None
    duration_s: float | None = None
    loss: float | None = None
    loss_nonfinite: bool = False
    relative_errors: tuple[float, ...] = ()
    comm_wait_s: float | None = None
    bucket_count: int | None = None

    @classmethod
    def from_record(cls, record: StepRecord) -> StepSample:
        """The sample of a ``wire.StepRecord``."""
        return cls(
            step=record.step,
            config_version=record.config_version,
            samples_per_s=record.samples_per_s,
            duration_s=record.duration_s,
            loss=record.loss,
            loss_nonfinite=record.loss_nonfinite,
            relative_errors=tuple(
                b.relative_error for b in record.buckets if b.relative_error is not None
            ),
            comm_wait_s=record.comm_wait_s,
            bucket_count=record.ddp.num_buckets_reduced if record.ddp is not None else None,
        )

    def communication_ratio(self) -> float | None:
        """Communication wait over step time, in [0, 1]; None when not reported."""
        wait, duration = self.comm_wait_s, self.duration_s
        if wait is None or duration is None or not (duration > 0 and math.isfinite(wait)):
            return None
        return min(max(wait / duration, 0.0), 1.0)

    def rate(self) -> tuple[float, str] | None:
        """(throughput, unit), or None when the step carries no usable timing.

        The samples are one rank's (rank 0's batch over its step time); the unit says so.
        """
        speed = self.samples_per_s
        if speed is not None and math.isfinite(speed) and speed > 0:
            return speed, "samples/s per rank"
        if self.duration_s is not None and math.isfinite(self.duration_s) and self.duration_s > 0:
            return 1.0 / self.duration_s, "steps/s"
        return None


@dataclass(frozen=True, slots=True)
class Trial:
    """One measured config of a session (the SQL ``tuning_trials`` row).

    ``kind``: ``baseline`` (index 0, the job's own config), ``trial``, or ``verify``
    (the best config measured again at the end). ``windows`` are throughputs per
    window, in the session's ``unit``; ``score`` their median. ``p_value`` is the
    one-sided test's against the incumbent (the baseline for ``verify``);
    ``relative_error`` the median sampled codec error; ``loss_windows`` the median
    loss per window. ``decision`` is None while the trial runs.
    """

    index: int
    kind: TrialKind
    config: TrialConfig
    started_unix_s: float
    version: int | None = None
    windows: tuple[float, ...] = ()
    loss_windows: tuple[float, ...] = ()
    score: float | None = None
    p_value: float | None = None
    relative_error: float | None = None
    decision: TrialDecision | None = None
    reason: str = ""
    ended_unix_s: float | None = None

    @property
    def state(self) -> str:
        """``applying`` (no acknowledgement yet), ``measuring`` or ``done``."""
        if self.decision is not None:
            return "done"
        return "applying" if self.version is None else "measuring"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        return data


@dataclass(frozen=True, slots=True)
class ApplyConfig:
    """Push ``config`` to the job (a ``config`` command with ``args``) and report its
    acknowledgement with ``on_applied`` / ``on_rejected``.

    ``purpose``: ``baseline``, ``trial``, ``verify`` (each starts trial ``trial_index``),
    ``rollback`` (back to the incumbent) or ``restore`` (back to the baseline).
    """

    config: TrialConfig
    reason: str
    purpose: Purpose
    trial_index: int | None = None

    @property
    def args(self) -> dict[str, object]:
        return self.config.args()


@dataclass(frozen=True, slots=True)
class Finish:
    """The session is over; the job runs ``best_config`` (already applied and verified).

    Scores are in the session's unit; ``best_score`` is the verification's when the
    config changed, else the baseline's. ``changed`` is False when the tuner left the
    job alone.
    """

    best_config: TrialConfig
    summary: str
    reason: str
    baseline_score: float | None
    best_score: float | None
    changed: bool


@dataclass(frozen=True, slots=True)
class Abort:
    """The session stopped without a result. ``restore_config``, when set, is the config
    the job should run (the incumbent) but may not: push it, best effort."""

    reason: str
    restore_config: TrialConfig | None = None


Decision: TypeAlias = ApplyConfig | Finish | Abort
