"""What the detectors conclude, in the one shape the rules engine consumes.

Detectors (``zscore``, ``straggler``, ``hang``, ``bottleneck``) are pure: observations
in, ``Finding`` records out. The rules engine turns active findings into alerts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

#: The detector that produced a finding; rule kinds ``anomaly``, ``straggler``,
#: ``hang`` and ``slow_link`` match on it.
FindingKind = Literal["anomaly", "straggler", "hang", "bottleneck", "slow_link"]

#: What a bottleneck finding says the step time is lost to.
CATEGORIES: tuple[str, ...] = (
    "communication",
    "efficiency",
    "input",
    "memory",
    "gpu_memory",
    "gpu",
    "network",
    "straggler",
)
#: How much work a recommendation is, least first.
DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")

#: Ordered from least to most severe.
SEVERITIES: tuple[str, ...] = ("info", "medium", "warning", "high", "critical")


@dataclass(frozen=True, slots=True)
class Finding:
    """One active conclusion of a detector about a job (and usually one rank).

    ``labels`` always holds ``job``; ``rank`` (as a decimal string) where one rank is
    at fault, ``metric`` for anomalies, ``op`` and ``pg`` for hangs. ``value`` is the
    observed value (a step time, a compute time, a hang age in seconds) and ``score``
    the detector's statistic (a z-score, a robust z, a relative slowdown). ``summary``
    is one human sentence naming what and where; ``recommendation`` what to do.
    ``since_unix_s`` is when the condition began (for persistence and latency).

    The bottleneck report fills the rest (``bottleneck``, ``straggler`` and
    ``slow_link`` findings): ``category`` (one of ``CATEGORIES``: what the step time
    is lost to), ``priority`` (1 = act on first, within the job), ``expected_gain_ratio``
    (estimated share of step time the recommendation saves, None where it prevents a
    failure instead) and ``difficulty`` (one of ``DIFFICULTIES``).
    """

    kind: FindingKind
    labels: Mapping[str, str]
    value: float
    score: float
    summary: str
    since_unix_s: float
    recommendation: str = ""
    severity: str = "warning"
    details: Mapping[str, object] = field(default_factory=dict)
    category: str = ""
    priority: int | None = None
    expected_gain_ratio: float | None = None
    difficulty: str = ""

    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Identity of the condition: the same kind on the same labels is one finding."""
        return self.kind, tuple(sorted(self.labels.items()))
