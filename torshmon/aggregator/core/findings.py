"""What the detectors conclude, in the one shape the rules engine consumes.

Detectors (``zscore``, ``straggler``, ``hang``, ``bottleneck``) are pure: observations
in, ``Finding`` records out. The rules engine turns active findings into alerts.

One number per fact: a straggler's ratio is ``details["slowdown_ratio"]`` (its compute,
or input wait or host time, over its peers' median over the episode, as the straggler
detector measures it; ``score`` holds the same value) and ``slowdown_text`` is the one
way it is written, in the finding's summary (which is the alert's, Slack's and the
report's text) and wherever else it is shown. The bottleneck report links findings:
a cause (a straggler, a hang, a slow link) carries what the job loses to it
(``details[LOSS_KEY]``, a share of throughput) and the job's step time without it
(``details[WHAT_IF_KEY]``); a symptom it explains (the peers' communication wait, the
efficiency roll-up) names it in ``details[EXPLAINED_BY_KEY]`` (``cause_id``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

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


#: The labels a cause's id is made of (a bottleneck's category: a roll-up's cause).
_ID_LABELS: Final = frozenset({"rank", "node", "category"})
#: ``details`` keys the bottleneck report fills (they travel with the stored episode).
#: The share of its throughput (0..1) the job loses to a cause.
LOSS_KEY: Final = "throughput_loss_ratio"
#: The job's step period (seconds) if the cause were gone.
WHAT_IF_KEY: Final = "what_if_step_s"
#: The job's measured step period (seconds) the two above are judged against.
STEP_KEY: Final = "step_s"
#: On a symptom: the ``cause_id`` of the finding that explains it.
EXPLAINED_BY_KEY: Final = "explained_by"
#: On a symptom: the cause's name for people (``the straggler on rank 1``).
EXPLAINED_BY_NAME_KEY: Final = "explained_by_name"


def slowdown_text(ratio: float) -> str:
    """A straggler's ratio as every surface writes it: ``2.40x``."""
    return f"{ratio:.2f}x"


def loss_text(ratio: float) -> str:
    """A share of throughput lost, as every surface writes it: ``~42%``."""
    return f"~{ratio:.0%}"


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


def cause_id(kind: str, labels: Mapping[str, str]) -> str:
    """A cause's identity within its job, as its symptoms name it (and as a stored row
    can rebuild it: kind, rank, node, category): ``straggler:rank=1``, ``hang:rank=2``,
    ``slow_link:node=b``, ``bottleneck:category=communication``."""
    keys = _ID_LABELS if kind == "bottleneck" else _ID_LABELS - {"category"}
    own = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k in keys)
    return f"{kind}:{own}"


def cause_name(kind: str, labels: Mapping[str, str]) -> str:
    """A cause for people: ``the straggler on rank 1``, ``the hang on rank 2``,
    ``the slow link of node b``."""
    where = f"rank {labels['rank']}" if "rank" in labels else ""
    if kind == "straggler":
        return f"the straggler on {where}" if where else "the straggler"
    if kind == "hang":
        op = labels.get("op", "a collective")
        return f"the hang in {op} on {where}" if where else f"the hang in {op}"
    if kind == "slow_link":
        node = labels.get("node")
        at = f"node {node}" if node else where
        return f"the slow link of {at}" if at else "the slow link"
    return f"the {kind}"
