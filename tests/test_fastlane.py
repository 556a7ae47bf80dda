"""The probe's fast lane: which steps skip the batching wait, and for how long."""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import msgspec
import pytest

from tests.integration import wire_factory as wf
from tests.test_shipper import _hello
from torshmon.probe.fastlane import FastLane, RollingMedian
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import Shipper, StepOutbox
from torshmon.wire import StepRecord


def _step(n: int, duration_s: float = 0.1, loss: float | None = 1.0) -> StepRecord:
    return wf.step(n, duration_s=duration_s, comm_wait_s=duration_s / 5, loss=loss)


def _warm(lane: FastLane, n: int = 10) -> None:
    for i in range(n):
        assert not lane.observe([_step(i, 0.1 * (1 + 0.02 * (i % 3)))], now=float(i))


def test_nothing_is_notable_before_there_is_a_history() -> None:
    lane = FastLane(min_history=8)
    assert not lane.observe([_step(1, 0.1), _step(2, 5.0), _step(3, 0.1, loss=100.0)], now=0.0)
    assert not lane.is_open(0.0)


def test_a_slow_step_opens_the_lane_for_open_s() -> None:
    lane = FastLane(open_s=2.0)
    _warm(lane)
    assert lane.observe([_step(20, 0.2)], now=100.0)
    assert lane.is_open(100.0) and lane.is_open(101.9) and not lane.is_open(102.0)
    # Each notable step keeps it open; one episode counts once.
    assert lane.observe([_step(21, 0.2)], now=101.0)
    assert lane.is_open(102.5) and lane.opened_total == 1


def _noisy(lane: FastLane, n: int = 32, spread: float = 0.1) -> None:
    """Steps spread +-``spread`` around 0.1 s, evenly (interquartile range ~``spread``)."""
    for i in range(n):
        duration = 0.1 * (1 + spread * ((i * 7) % n / (n - 1) * 2 - 1))
        lane.observe([_step(i, duration)], now=float(i))


def test_jitter_within_the_ranks_own_spread_does_not_open_it() -> None:
    lane = FastLane()
    _warm(lane)  # steps within 4 %
    assert not lane.observe([_step(20, 0.105), _step(21, 0.09)], now=100.0)
    lane = FastLane()
    _noisy(lane)  # steps within +-10 %: the bar stays at 1.15x
    assert not lane.observe([_step(40, 0.114), _step(41, 0.085)], now=100.0)
    assert lane.observe([_step(42, 0.116)], now=101.0)


def test_on_steady_ranks_a_smaller_change_opens_it() -> None:
    """A straggler's peers only wait for it: with communication a large part of their
    step, a 1.2x straggler lengthens their steps by less than 1.15x (1.12 here). On a
    rank whose steps are steady (a GPU job) that is far outside its noise, and the bar
    comes down to meet it (to ``min_time_ratio``, 1.05, at the lowest); on a noisy rank
    it stays at 1.15x, where only noise would pass a lower one."""
    steady = FastLane()
    for i in range(32):
        steady.observe([_step(i, 0.1 * (1 + 0.002 * (i % 5)))], now=float(i))
    assert steady.observe([_step(40, 0.112)], now=100.0)
    assert not steady.observe([_step(41, 0.1), _step(42, 0.104)], now=101.0)  # under 1.05x
    noisy = FastLane()
    _noisy(noisy)
    assert not noisy.observe([_step(40, 0.112)], now=100.0)


def test_a_moderate_straggler_opens_it() -> None:
    """A rank 1.2x slower (the smallest straggler the detector must name at 3+ ranks),
    and its peers' steps that wait for it, open the lane: the detector names it on its
    4th slow step, and batches every 0.5 s would bring that news 7-10 steps later."""
    lane = FastLane()
    _warm(lane)
    assert lane.observe([_step(20, 0.1 * 1.2)], now=100.0)


@pytest.mark.parametrize("loss", [2.5, math.nan])
def test_a_loss_jump_or_a_non_finite_loss_opens_it(loss: float) -> None:
    lane = FastLane()
    _warm(lane)
    step = _step(20, loss=None if math.isnan(loss) else loss)
    if math.isnan(loss):
        step = msgspec.structs.replace(step, loss_nonfinite=True)
    assert lane.observe([step], now=100.0)


def test_a_falling_or_negative_loss_is_not_a_jump() -> None:
    lane = FastLane()
    for i in range(10):
        lane.observe([_step(i, loss=-5.0)], now=float(i))
    assert not lane.observe([_step(10, loss=-6.0), _step(11, loss=-4.0)], now=10.0)
    assert lane.observe([_step(12, loss=0.5)], now=11.0)  # up by more than |median|


def test_a_new_normal_stops_being_notable() -> None:
    lane = FastLane(window=16)
    _warm(lane, 16)
    notable = [lane.observe([_step(100 + i, 0.3)], now=100.0 + i) for i in range(16)]
    assert notable[0] and not notable[-1]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="loss_ratio must be > 1"):
        FastLane(loss_ratio=1.0)
    with pytest.raises(ValueError, match=r"min_history must be in 1\.\.window"):
        FastLane(window=4, min_history=8)
    with pytest.raises(ValueError, match="open_s must be > 0"):
        FastLane(open_s=0)
    with pytest.raises(ValueError, match="1 < min_time_ratio <= time_ratio"):
        FastLane(min_time_ratio=1.2)


def test_the_bars_say_what_the_next_observe_would_judge_notable() -> None:
    """What the training thread holds a step's end against (``StepOutbox``) agrees
    with the lane's own judgement, on both sides of each bar."""
    lane = FastLane(min_history=8)
    assert lane.bars() == (sys.maxsize, math.inf)  # no history: nothing can be judged
    _warm(lane)
    slow_ns, loss_above = lane.bars()
    assert loss_above == pytest.approx(2.0)  # a doubled loss (median 1.0)
    for duration_ns, notable in ((slow_ns, True), (slow_ns - 1_000, False)):
        probe = FastLane(min_history=8)
        _warm(probe)
        assert probe.observe([_step(99, duration_ns * 1e-9)], now=50.0) is notable
    for loss, notable in ((loss_above, True), (loss_above - 1e-6, False)):
        probe = FastLane(min_history=8)
        _warm(probe)
        assert probe.observe([_step(99, 0.1, loss=loss)], now=50.0) is notable


def test_the_rolling_median_is_the_windows_median_as_values_come_and_go() -> None:
    """Against statistics.median over the same window: ties, repeats, a window that
    fills and then slides, and values that are not finite left out."""
    rng = random.Random(7)
    window = RollingMedian(5)
    kept: deque[float] = deque(maxlen=5)
    with pytest.raises(ValueError, match="empty"):
        window.median()
    for _ in range(2_000):
        value = rng.choice([rng.random(), float(rng.randint(0, 3)), math.nan, math.inf])
        window.append(value)
        if math.isfinite(value):
            kept.append(value)
        assert len(window) == len(kept)
        if kept:
            assert window.median() == statistics.median(kept)


def test_a_lane_turned_off_judges_nothing_and_never_opens() -> None:
    """``attach(fast_lane=False)``: a 100x step, a loss jump, a NaN loss: none opens it."""
    lane = FastLane(enabled=False)
    _warm(lane)
    notable = [_step(10, 10.0), _step(11, 0.1, loss=100.0), _step(12, 0.1, loss=math.nan)]
    assert not lane.observe(notable, now=10.0)
    assert not lane.is_open(10.0)
    assert lane.opened_total == 0
    assert lane.bars() == (sys.maxsize, math.inf)  # no step's end wakes the shipper


def test_a_shipper_whose_lane_is_off_sleeps_until_its_flush(tmp_path: Path) -> None:
    """With the lane on and no history yet the shipper summarises every ``poll_s``, to
    have a bar soon; with it off there is no bar to have, and it sleeps until its flush."""
    outbox = StepOutbox(8)
    shipper = Shipper(
        socket_path=str(tmp_path / "no-agent.sock"),
        hello=_hello(),
        outbox=outbox,
        inflight=InflightTable(),
        flush_interval_s=0.5,
        poll_s=0.05,
        fast_lane=FastLane(enabled=False),
    )
    slept: list[float] = []
    outbox.wake.wait = slept.append  # type: ignore[method-assign,assignment]
    for lane in (FastLane(enabled=False), FastLane()):
        shipper.fast_lane = lane
        shipper._next_flush = time.monotonic() + 0.5
        outbox.wake_at = math.inf
        shipper._wait()
    assert slept[0] > 0.4
    assert slept[1] == pytest.approx(0.05, abs=1e-6)  # now + poll_s - now
