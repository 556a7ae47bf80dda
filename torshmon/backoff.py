"""Exponential backoff: how long to wait after the n-th failure in a row.

One formula for every retry loop in torshmon (the probe's reconnects to its agent,
the agent's POSTs to the aggregator, the notifier's deliveries). Each caller keeps
its own loop (a thread, a task, a queue of messages), so this is a function of the
attempt number and not a retry decorator. Pure and cheap: the probe calls it from
its shipper thread, and it cannot raise for valid arguments.
"""

from __future__ import annotations

import random


def backoff_s(
    attempt: int, *, initial_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait after failed ``attempt`` (1-based): ``initial_s * 2**(attempt-1)``
    capped at ``max_s``. With ``rng``, randomised to between half and all of it
    (jitter, so that many clients that failed together do not retry together)."""
    # The exponent is capped so that a long outage cannot overflow the float.
    delay = min(max_s, initial_s * 2.0 ** min(attempt - 1, 60))
    if rng is not None:
        delay *= 0.5 + 0.5 * rng.random()
    return delay


__all__ = ["backoff_s"]
