from __future__ import annotations

import random

from torshmon.backoff import backoff_s


def test_doubles_from_initial_up_to_the_cap() -> None:
    delays = [backoff_s(n, initial_s=0.1, max_s=5.0) for n in range(1, 10)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]


def test_jitter_keeps_between_half_and_all_and_follows_the_rng() -> None:
    rng = random.Random(3)
    delays = [backoff_s(n, initial_s=0.2, max_s=10.0, rng=rng) for n in range(1, 12)]
    for attempt, delay in enumerate(delays, start=1):
        base = min(10.0, 0.2 * 2 ** (attempt - 1))
        assert base / 2 <= delay <= base
    assert len(set(delays)) == len(delays)
    again = random.Random(3)
    assert [backoff_s(n, initial_s=0.2, max_s=10.0, rng=again) for n in range(1, 12)] == delays


def test_a_long_outage_does_not_overflow() -> None:
    assert backoff_s(10_000, initial_s=0.5, max_s=30.0) == 30.0
