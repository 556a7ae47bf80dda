"""A tuning session's state as plain records: what ``to_state`` saves, ``from_state`` restores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

from torshmon.aggregator.core.tuner.config import TrialConfig
from torshmon.aggregator.core.tuner.events import Purpose, Trial
from torshmon.aggregator.core.tuner.settings import TunerSettings
from torshmon.aggregator.core.tuner.space import SearchSpace

#: The version of ``TuningSession.to_state``'s blob; another version is refused.
STATE_VERSION: Final = 1
Phase: TypeAlias = Literal["created", "applying", "measuring", "finished", "aborted"]


@dataclass(slots=True)
class Segment:
    """Steps being measured for one applied config version."""

    version: int
    first_step: int  # the first step measured, after the warm-up
    last_step: int = -1
    rates: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Pending:
    config: TrialConfig
    purpose: Purpose
    trial_index: int | None


@dataclass(slots=True)
class Told:
    """One point told to the optimiser; ``value`` None means "rejected" (penalised)."""

    params: dict[str, Any]
    value: float | None


@dataclass(slots=True)
class SessionState:
    """Everything a session knows: ``to_state`` encodes it, ``from_state`` converts it back."""

    space: SearchSpace
    settings: TunerSettings
    seed: int
    v: int = STATE_VERSION
    phase: Phase = "created"
    baseline: TrialConfig | None = None
    current: TrialConfig | None = None  # what the job runs, as far as we know
    pending: Pending | None = None
    segment: Segment | None = None
    trials: list[Trial] = field(default_factory=list)
    told: list[Told] = field(default_factory=list)
    screen: list[TrialConfig] = field(default_factory=list)
    bucket_screened: bool = False
    incumbent: int = 0
    banned: list[str] = field(default_factory=list)
    measured: list[TrialConfig] = field(default_factory=list)
    repeats: int = 0
    failures: int = 0
    loss_reference: list[float] = field(default_factory=list)
    #: What the job told (the prior's evidence): the link check's slowest link at start,
    #: then rank 0's communication ratios and bucket count while the baseline ran.
    link_bytes_per_s: float | None = None
    comm_ratios: list[float] = field(default_factory=list)
    bucket_count: int | None = None
    evidence: str = ""
    unit: str = ""
    deadline_unix_s: float | None = None
    started_unix_s: float | None = None
    ended_unix_s: float | None = None
    reason: str = ""
    final_config: TrialConfig | None = None
    summary: str = ""
