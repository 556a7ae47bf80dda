"""An alert as it moves from the rules engine to storage and the notifiers."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

AlertState = Literal["pending", "firing", "resolved"]


def fingerprint(rule: str, labels: Mapping[str, str]) -> str:
    """Stable identity of one alert instance: the rule name and its labels (16 hex)."""
    text = rule + "\x00" + "\x00".join(f"{k}={labels[k]}" for k in sorted(labels))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert instance at one state transition.

    ``labels`` hold ``alertname`` (the rule name), ``severity``, ``job`` and, where
    one rank is at fault, ``rank``; plus the rule's own labels. ``annotations`` hold
    ``summary`` (names job, rank, metric and value), ``description`` and
    ``recommendation``. ``value`` is the value that triggered the rule. Times are
    Unix seconds; ``ends_at_unix_s`` is set once resolved. ``actions`` are the rule's
    actions (``notify``, ``autotune``, ...).
    """

    rule: str
    state: AlertState
    severity: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    value: float | None
    starts_at_unix_s: float
    ends_at_unix_s: float | None = None
    actions: tuple[str, ...] = ("notify",)
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint(self.rule, self.labels))

    @property
    def job(self) -> str:
        return self.labels.get("job", "")

    @property
    def rank(self) -> str | None:
        return self.labels.get("rank")
