"""Which agents are heard from, and how old the data they deliver is.

An agent POSTs at least once a second (``poll_interval_s``), with data or without, so
its silence is news of its own: ``silence_s`` feeds the ``agent_silence_seconds``
series behind the Agent Down alert. The data it delivers is dated on the
aggregator's clock by the node's own clock: a record's age in transit is its lag
(receive time minus the time the node stamped on it) above the node's usual lag
(``floor``, the smallest seen, which absorbs the clock offset between the node and
the aggregator). A batch replayed from an agent's spool after a restart therefore
carries its old time, not "now", and a node's ``horizon`` (the newest time its data
vouches for) stops where its agent went quiet. The hang detector reads both: a rank's
in-flight report is evidence only up to its node's horizon.

Pure: every method takes ``now_unix_s``; not thread-safe (``LiveState`` holds a lock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

#: How fast a node's lag floor may rise (seconds per second): a clock that steps back
#: is followed within minutes, while a replay of a spool 100 s old still reads as
#: 99 s old.
FLOOR_DRIFT: Final = 0.01


@dataclass(slots=True)
class _Agent:
    contact_unix_s: float  # the last POST, aggregator clock
    floor_s: float  # smallest receive-minus-stamp lag, at floor_unix_s
    floor_unix_s: float
    horizon_unix_s: float = -math.inf  # the newest dated data


class Agents:
    """The agents (by node) this aggregator hears from."""

    def __init__(self) -> None:
        self._agents: dict[str, _Agent] = {}

    def contact(self, node: str, now_unix_s: float, stamps_unix_s: Iterable[float]) -> None:
        """An agent of ``node`` POSTed at ``now_unix_s``, carrying data the node stamped
        at ``stamps_unix_s`` (its probes' send times and its samples' times)."""
        lags = [now_unix_s - s for s in stamps_unix_s if math.isfinite(s)]
        agent = self._agents.get(node)
        if agent is None:
            floor = min(lags, default=0.0)
            self._agents[node] = _Agent(now_unix_s, floor, now_unix_s)
            agent = self._agents[node]
        else:
            agent.contact_unix_s = max(agent.contact_unix_s, now_unix_s)
            allowed = agent.floor_s + FLOOR_DRIFT * max(0.0, now_unix_s - agent.floor_unix_s)
            agent.floor_s = min([allowed, *lags])
            agent.floor_unix_s = now_unix_s
        if lags:
            newest = self.dated(node, now_unix_s - min(lags), now_unix_s)
            agent.horizon_unix_s = max(agent.horizon_unix_s, newest)

    def dated(self, node: str, stamp_unix_s: float, now_unix_s: float) -> float:
        """When data ``node`` stamped at ``stamp_unix_s`` was current, on the aggregator's
        clock (never after ``now_unix_s``); ``now_unix_s`` for an unknown node."""
        agent = self._agents.get(node)
        if agent is None or not math.isfinite(stamp_unix_s):
            return now_unix_s
        return min(now_unix_s, stamp_unix_s + agent.floor_s)

    def horizon(self, node: str) -> float | None:
        """The newest time data from ``node`` vouches for (None: unknown node)."""
        agent = self._agents.get(node)
        return None if agent is None else agent.horizon_unix_s

    def horizons(self) -> dict[str, float]:
        """Every known node's horizon (``-inf`` for a node that sent no data yet)."""
        return {n: a.horizon_unix_s for n, a in self._agents.items()}

    def silence_s(self, now_unix_s: float) -> dict[str, float]:
        """Seconds since each node's agent last POSTed."""
        return {n: max(0.0, now_unix_s - a.contact_unix_s) for n, a in self._agents.items()}

    def forget_idle(self, cutoff_unix_s: float) -> list[str]:
        """Drop agents last heard before ``cutoff_unix_s``; their nodes."""
        idle = [n for n, a in self._agents.items() if a.contact_unix_s < cutoff_unix_s]
        for node in idle:
            del self._agents[node]
        return idle
