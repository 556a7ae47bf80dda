"""Rate-limited logging: say a repeated problem once, or once per interval.

A broken peer can fail thousands of times a second (a probe sending bad frames, an
agent posting garbage, a collective that cannot be timed); each failure is counted
where it happens, and a ``LogLimiter`` decides whether this one is also logged.
Keys keep separate problems apart (one per op, say); keep them few and bounded.
``allow`` is a dictionary look-up and never raises, so the probe uses it on the
training thread. Not thread-safe: two threads may both be allowed at the edge of an
interval, which costs one extra line and nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable


class LogLimiter:
    """Allows one log line per key per ``interval_s`` (``math.inf``, the default: once
    per key until ``reset``). ``clock`` gives seconds (monotonic)."""

    __slots__ = ("_clock", "_interval_s", "_last")

    def __init__(
        self, interval_s: float = math.inf, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}

    def allow(self, key: Hashable = None) -> bool:
        """Whether to log ``key``'s problem now; True records it as logged."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            return False
        self._last[key] = now
        return True

    def reset(self, key: Hashable = None) -> None:
        """Let ``key``'s next problem be logged at once (the problem went away)."""
        self._last.pop(key, None)


__all__ = ["LogLimiter"]
