"""When a step's end wakes the shipper: while its fast lane is open (one send per
poll_s), when the step is out of line by the lane's bars, and otherwise never before
the flush (the thread sleeps; it does not poll).

A real receiver on a Unix socket and a real shipper thread; the lane is held open (or
shut) by a FastLane that says so, so the timing is the shipper's alone.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import ReceiverThread
from tests.test_shipper import _hello, _raw_step
from torshmon.probe.events import RawStep
from torshmon.probe.fastlane import FastLane
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import Shipper, StepOutbox
from torshmon.wire import Batch, ProbeMessage

#: Long, so that a step sent much sooner can only have been sent by its own end.
POLL_S = 1.0


class HeldLane(FastLane):
    def __init__(self, is_open: bool) -> None:
        super().__init__()
        self.held_open = is_open

    def is_open(self, now: float) -> bool:
        return self.held_open


class Arrivals(ReceiverThread):
    """Keeps when each step arrived."""

    def __init__(self, socket_path: Path) -> None:
        self.arrived: dict[int, tuple[float, bool]] = {}
        super().__init__(socket_path)

    def _observe(self, message: ProbeMessage) -> None:
        if isinstance(message, Batch):
            for s in message.steps:
                self.arrived[s.step] = (time.monotonic(), message.urgent)
        super()._observe(message)

    def wait_for(self, step: int, timeout_s: float = 10.0) -> float:
        deadline = time.monotonic() + timeout_s
        while step not in self.arrived:
            assert time.monotonic() < deadline, f"step {step} never arrived"
            time.sleep(0.005)
        return self.arrived[step][0]


def _start_shipper(
    receiver: Arrivals,
    outbox: StepOutbox,
    flush_interval_s: float,
    poll_s: float,
    fast_lane: FastLane | None = None,
) -> Shipper:
    shipper = Shipper(
        socket_path=str(receiver.socket_path),
        hello=_hello(),
        outbox=outbox,
        inflight=InflightTable(),
        flush_interval_s=flush_interval_s,
        poll_s=poll_s,
        fast_lane=fast_lane,
    )
    shipper.start()
    return shipper


@pytest.fixture
def shipped(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[StepOutbox, Arrivals]]:
    receiver = Arrivals(tmp_path / "agent.sock")
    receiver.start()
    outbox = StepOutbox(100)
    shipper = _start_shipper(receiver, outbox, 30.0, POLL_S, HeldLane(request.param))
    try:
        yield outbox, receiver
    finally:
        shipper.close()
        receiver.stop()


@pytest.mark.parametrize("shipped", [True], indirect=True)
def test_while_the_lane_is_open_a_step_goes_out_as_it_ends(
    shipped: tuple[StepOutbox, Arrivals],
) -> None:
    outbox, receiver = shipped
    outbox.put(_raw_step(1))  # taken at the next poll: the lane opens the wake after it
    receiver.wait_for(1)
    time.sleep(POLL_S + 0.2)  # past the least time between two sends
    put = time.monotonic()
    outbox.put(_raw_step(2))
    second = receiver.wait_for(2)
    assert second - put < POLL_S / 2, f"{second - put:.3f} s: it waited for a poll"
    assert receiver.arrived[2][1], "sent in the lane, so marked urgent"
    # Right after a send the next step's end still wakes the shipper, but it keeps
    # poll_s between sends: an open lane sends no more often than it polls.
    outbox.put(_raw_step(3))
    third = receiver.wait_for(3)
    assert third - second >= POLL_S * 0.8, f"{third - second:.3f} s after the last send"


@pytest.mark.parametrize("shipped", [False], indirect=True)
def test_while_the_lane_is_shut_a_step_end_wakes_nothing(
    shipped: tuple[StepOutbox, Arrivals],
) -> None:
    outbox, receiver = shipped
    outbox.put(_raw_step(1))
    assert not outbox.wake.is_set()  # an ordinary step's end leaves the shipper asleep
    time.sleep(POLL_S * 1.5)
    assert 1 not in receiver.arrived, "sent before its flush (30 s) with the lane shut"


def _timed_step(n: int, duration_ms: float, loss: float | None = None) -> RawStep:
    step = _raw_step(n)
    return step._replace(end_ns=step.start_ns + round(duration_ms * 1e6), loss=loss)


@pytest.mark.parametrize(("duration_ms", "loss"), [(50.0, 1.0), (10.0, 9.0), (10.0, float("nan"))])
def test_a_step_out_of_line_wakes_the_shipper_as_it_ends(
    tmp_path: Path, duration_ms: float, loss: float
) -> None:
    """The lane shut and nothing due for a while: a slow step, or a loss jump, goes
    out at once, urgent, judged as the step ended and not at the next flush."""
    receiver = Arrivals(tmp_path / "agent.sock")
    receiver.start()
    outbox = StepOutbox(100)
    flush_s = 1.0
    shipper = _start_shipper(receiver, outbox, flush_s, 0.05)
    try:
        for n in range(1, 11):  # the lane's history: 10 ms steps, loss 1
            outbox.put(_timed_step(n, 10.0, 1.0))
        receiver.wait_for(10)  # at the first flush
        time.sleep(0.1)  # the shipper is asleep again, its next flush ~0.9 s away
        put = time.monotonic()
        outbox.put(_timed_step(11, duration_ms, loss))
        arrived = receiver.wait_for(11)
        assert arrived - put < flush_s / 3, f"{arrived - put:.3f} s: it waited for the flush"
        assert receiver.arrived[11][1], "it opened the fast lane"
    finally:
        shipper.close()
        receiver.stop()


def test_the_training_thread_judges_a_step_by_the_bars_the_shipper_left() -> None:
    outbox = StepOutbox(100)
    outbox.put(_timed_step(0, 10.0))
    assert outbox.wake.is_set(), "until the shipper first sleeps, every step wakes it"
    outbox.wake.clear()
    # What the shipper leaves when it sleeps with the lane shut: its flush far off.
    outbox.wake_at = time.monotonic() + 3600.0
    outbox.slow_ns, outbox.loss_above = 15_000_000, 2.0
    for step in (_timed_step(1, 10.0, 1.0), _timed_step(2, 10.0, None), _timed_step(3, 14.9)):
        outbox.put(step)
        assert not outbox.wake.is_set()
    for step in (
        _timed_step(4, 15.0),
        _timed_step(5, 10.0, 2.0),
        _timed_step(6, 10.0, float("inf")),
        _timed_step(7, 10.0, float("nan")),
    ):
        outbox.put(step)
        assert outbox.wake.is_set(), step
        outbox.wake.clear()
    outbox.wake_at = time.monotonic()  # the lane is open and poll_s has passed
    outbox.put(_timed_step(8, 10.0, 1.0))
    assert outbox.wake.is_set()
    assert [s.step for s in outbox.drain()] == list(range(9))


class SlowAcks(Arrivals):
    """Reads frames, and acks them, once per ACK_WINDOW_S (as an agent's group commit
    does), and keeps when the shipper stamped each batch of steps."""

    ACK_WINDOW_S = 0.09

    def __init__(self, socket_path: Path) -> None:
        self.stamped: list[int] = []
        super().__init__(socket_path)
        self.receiver.read_window_s = self.receiver.urgent_window_s = self.ACK_WINDOW_S

    def _observe(self, message: ProbeMessage) -> None:
        super()._observe(message)
        if isinstance(message, Batch) and message.steps:
            self.stamped.append(message.sent_unix_ns)


def test_an_urgent_send_does_not_wait_for_its_ack(tmp_path: Path) -> None:
    """With the lane open and acks coming 0.09 s after a frame, the shipper still sends
    every poll_s (0.05 s): it takes an urgent batch's ack at its next send instead of
    waking for it (blocking on each ack, its sends came 0.09 s apart or more). Every
    step arrives once."""
    receiver = SlowAcks(tmp_path / "agent.sock")
    receiver.start()
    outbox = StepOutbox(1000)
    shipper = _start_shipper(receiver, outbox, 30.0, 0.05, HeldLane(True))
    try:
        for n in range(1, 101):
            outbox.put(_raw_step(n))
            time.sleep(0.01)
    finally:
        shipper.close()
        receiver.stop()
    assert sorted(receiver.arrived) == list(range(1, 101))
    gaps_s = [(b - a) * 1e-9 for a, b in itertools.pairwise(receiver.stamped)]
    assert gaps_s and statistics.median(gaps_s) < 0.075, gaps_s
