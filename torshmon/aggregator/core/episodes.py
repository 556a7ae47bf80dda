"""Findings as episodes: which to open, update and close in the history at a tick.

The detectors say what holds now; the history keeps one row per episode of a
finding (its time range), not one per evaluation. ``FindingEpisodes`` compares each
tick's active findings with the open episodes and says what to write. Pure: the
caller passes the clock's reading and does the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torshmon.aggregator.core.findings import Finding

FindingKey = tuple[str, tuple[tuple[str, str], ...]]
Change = Literal["open", "update", "close"]


@dataclass(frozen=True, slots=True)
class FindingChange:
    """One write: open a row for ``finding``, update its open row, or close it.
    ``ended_unix_s``: for a close, when the finding last held (None: the write's time)."""

    change: Change
    finding: Finding
    ended_unix_s: float | None = None


@dataclass(slots=True)
class _Open:
    finding: Finding
    written_unix_s: float
    seen_unix_s: float


class FindingEpisodes:
    """Tracks open episodes (event-loop thread only).

    ``update_every_s``: an open episode is rewritten at most this often (its value
    and summary move with every step), and at once when its severity, priority or
    category changes. ``close_after_s``: an episode closes once its finding has been
    gone this long, ending when it last held; back sooner, it goes on (a measure that
    wavers about its threshold is one episode, not many short ones). Raises ValueError
    for a negative interval.
    """

    def __init__(self, *, update_every_s: float = 30.0, close_after_s: float = 10.0) -> None:
        for name, value in (("update_every_s", update_every_s), ("close_after_s", close_after_s)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")
        self.update_every_s = update_every_s
        self.close_after_s = close_after_s
        self._open: dict[FindingKey, _Open] = {}

    def evaluate(self, findings: Sequence[Finding], now_unix_s: float) -> list[FindingChange]:
        """The writes that bring the history in line with ``findings`` (active now)."""
        changes: list[FindingChange] = []
        seen: set[FindingKey] = set()
        for finding in findings:
            key = finding.key()
            if key in seen:
                continue
            seen.add(key)
            held = self._open.get(key)
            if held is None:
                self._open[key] = _Open(finding, now_unix_s, now_unix_s)
                changes.append(FindingChange("open", finding))
            elif _ranking(held.finding) != _ranking(finding) or (
                now_unix_s - held.written_unix_s >= self.update_every_s
            ):
                self._open[key] = _Open(finding, now_unix_s, now_unix_s)
                changes.append(FindingChange("update", finding))
            else:
                held.finding, held.seen_unix_s = finding, now_unix_s
        for key, held in list(self._open.items()):
            if key not in seen and now_unix_s - held.seen_unix_s >= self.close_after_s:
                del self._open[key]
                changes.append(FindingChange("close", held.finding, held.seen_unix_s))
        return changes

    def open_count(self) -> int:
        """How many episodes are open."""
        return len(self._open)


def _ranking(f: Finding) -> tuple[str, int | None, str]:
    return f.severity, f.priority, f.category
