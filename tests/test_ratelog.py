from __future__ import annotations

import math

import pytest

from torshmon.ratelog import LogLimiter


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_once_per_interval() -> None:
    clock = _Clock()
    limiter = LogLimiter(10.0, clock=clock)
    assert limiter.allow()
    clock.now_s += 9.9
    assert not limiter.allow()
    clock.now_s += 0.1
    assert limiter.allow()
    assert not limiter.allow()


def test_keys_are_limited_apart() -> None:
    clock = _Clock()
    limiter = LogLimiter(10.0, clock=clock)
    assert limiter.allow("all_reduce")
    assert limiter.allow("broadcast")
    assert not limiter.allow("all_reduce")


def test_once_per_key_by_default_until_reset() -> None:
    clock = _Clock()
    limiter = LogLimiter(clock=clock)
    assert limiter.allow("x")
    clock.now_s += 1e9
    assert not limiter.allow("x")
    limiter.reset("x")
    assert limiter.allow("x")
    limiter.reset("never seen")  # nothing to forget: no error


@pytest.mark.parametrize("interval_s", [0.0, -1.0, math.nan])
def test_interval_must_be_positive(interval_s: float) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LogLimiter(interval_s)
