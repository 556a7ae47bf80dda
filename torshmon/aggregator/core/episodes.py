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
    """One write: open a row for ``finding``, update its open row, or close it."""

    change: Change
    finding: Finding


@dataclass(slots=True)
class _Open:
    finding: Finding
    written_unix_s: float


class FindingEpisodes:
    """Tracks open episodes (event-loop thread only).

    ``update_every_s``: an open episode is rewritten at most this often (its value
    and summary move with every step), and at once when its severity, priority or
    category changes. Raises ValueError for a negative interval.
    """

    def __init__(self, *, update_every_s: float = 30.0) -> None:
        if not update_every_s >= 0:
            raise ValueError(f"update_every_s must be >= 0 seconds, got {update_every_s}")
        self.update_every_s = update_every_s
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
                self._open[key] = _Open(finding, now_unix_s)
                changes.append(FindingChange("open", finding))
            elif _ranking(held.finding) != _ranking(finding) or (
                now_unix_s - held.written_unix_s >= self.update_every_s
            ):
                self._open[key] = _Open(finding, now_unix_s)
                changes.append(FindingChange("update", finding))
            else:
                held.finding = finding
        for key in [k for k in self._open if k not in seen]:
            changes.append(FindingChange("close", self._open.pop(key).finding))
        return changes

    def open_count(self) -> int:
        """How many episodes are open."""
        return len(self._open)


def _ranking(f: Finding) -> tuple[str, int | None, str]:
    return f.severity, f.priority, f.category
