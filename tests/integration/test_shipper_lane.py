"""The shipper while its fast lane is open: a step's end wakes it, one send per poll_s.

A real receiver on a Unix socket and a real shipper thread; the lane is held open (or
shut) by a FastLane that says so, so the timing is the shipper's alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import ReceiverThread
from tests.test_shipper import _hello, _raw_step
from torshmon.probe.events import RawStep
from torshmon.probe.fastlane import FastLane
from torshmon.probe.inflight import InflightTable
from torshmon.probe.shipper import Outbox, Shipper
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


@pytest.fixture
def shipped(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Outbox[RawStep], Arrivals]]:
    receiver = Arrivals(tmp_path / "agent.sock")
    receiver.start()
    outbox: Outbox[RawStep] = Outbox(100)
    shipper = Shipper(
        socket_path=str(receiver.socket_path),
        hello=_hello(),
        outbox=outbox,
        inflight=InflightTable(),
        flush_interval_s=30.0,
        poll_s=POLL_S,
        fast_lane=HeldLane(request.param),
    )
    shipper.start()
    try:
        yield outbox, receiver
    finally:
        shipper.close()
        receiver.stop()


@pytest.mark.parametrize("shipped", [True], indirect=True)
def test_while_the_lane_is_open_a_step_goes_out_as_it_ends(
    shipped: tuple[Outbox[RawStep], Arrivals],
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
    shipped: tuple[Outbox[RawStep], Arrivals],
) -> None:
    outbox, receiver = shipped
    outbox.put(_raw_step(1))
    assert outbox.wake is None  # the training thread's put sets no event
    time.sleep(POLL_S * 1.5)
    assert 1 not in receiver.arrived, "sent before its flush (30 s) with the lane shut"
