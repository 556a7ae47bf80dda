"""Device timing of collectives (NCCL), tested on CPU with fake events and Works:
which clock a call gets, how ready timings become durations, and how steps wait for
theirs without ever blocking."""

from __future__ import annotations

from typing import Any

import pytest

from torshmon.probe.events import CollectiveEvent, RawStep, StepEvents
from torshmon.probe.timing import (
    CudaEventTiming,
    DeviceClock,
    StepGate,
    WorkTiming,
    resolve,
)


class FakeEvent:
    """A CUDA event: ``record()`` places it at the stream's current position
    (``stream_ms``: where the work enqueued so far ends); it completes once the device
    has executed up to there (``device_ms``)."""

    stream_ms = 0.0
    device_ms = 0.0

    def __init__(self) -> None:
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = FakeEvent.stream_ms

    def query(self) -> bool:
        return self.at_ms is not None and FakeEvent.device_ms >= self.at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        if not end.query():
            raise RuntimeError("CUDA error: device not ready")
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


class FakeWork:
    def __init__(self, duration_ms: float) -> None:
        self.completed = False
        self.duration_ms = duration_ms

    def is_completed(self) -> bool:
        return self.completed

    def _get_duration(self) -> float:
        if not self.completed:
            raise RuntimeError("Work not completed")
        return self.duration_ms


def _event(start_ns: int, end_ns: int, device: Any = None) -> CollectiveEvent:
    return CollectiveEvent(
        "all_reduce", "default", 2, "float32", 4096, start_ns, end_ns, True, device=device
    )


def test_only_nccl_with_cuda_is_timed_on_the_device() -> None:
    cuda = DeviceClock(event_factory=FakeEvent, nccl_timing=True)
    assert cuda.on_device("nccl") and not cuda.on_device("gloo")
    assert cuda.before("gloo") is None and cuda.after_async("gloo", FakeWork(1.0)) is None
    assert cuda.after_blocking(None) is None
    cpu = DeviceClock(event_factory=None, nccl_timing=True)
    assert cpu.before("nccl") is None and cpu.after_async("nccl", FakeWork(1.0)) is None
    # Async without NCCL's own timing keeps the host's completion time.
    assert (
        DeviceClock(event_factory=FakeEvent, nccl_timing=False).after_async("nccl", FakeWork(1.0))
        is None
    )
    assert isinstance(cuda.after_async("nccl", FakeWork(1.0)), WorkTiming)


def test_nccl_timing_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    assert DeviceClock(event_factory=FakeEvent).nccl_timing
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "0")
    assert not DeviceClock(event_factory=FakeEvent).nccl_timing


def test_a_blocking_call_is_timed_by_events_around_it_on_the_stream() -> None:
    clock = DeviceClock(event_factory=FakeEvent, nccl_timing=False)
    FakeEvent.stream_ms, FakeEvent.device_ms = 100.0, 40.0  # the device is behind
    start = clock.before("nccl")
    FakeEvent.stream_ms = 107.5  # the call enqueued a 7.5 ms collective and returned
    timing = clock.after_blocking(start)
    assert isinstance(timing, CudaEventTiming)
    assert not timing.ready()  # read later, never waited for
    FakeEvent.device_ms = 120.0
    assert timing.ready() and timing.seconds() == pytest.approx(0.0075)


def test_ready_timings_replace_the_host_duration_and_unready_ones_are_counted() -> None:
    FakeEvent.stream_ms, FakeEvent.device_ms = 0.0, 0.0
    start, end = FakeEvent(), FakeEvent()
    start.record()
    FakeEvent.stream_ms = 7.5  # the collective took 7.5 ms on the device
    end.record()
    FakeEvent.device_ms = 10.0
    done_work, busy_work = FakeWork(3.25), FakeWork(9.0)
    done_work.completed = True
    events = [
        _event(1_000, 2_000),  # gloo: host-timed, untouched
        _event(5_000, 5_010, CudaEventTiming(start, end)),  # enqueue took 10 ns
        _event(8_000, 8_020, WorkTiming(done_work)),
        _event(9_000, 9_030, WorkTiming(busy_work)),  # not done: keeps the host figure
    ]
    resolved, unread = resolve(events)
    assert [(e.start_ns, e.end_ns) for e in resolved] == [
        (1_000, 2_000),
        (5_000, 5_000 + 7_500_000),
        (8_000, 8_000 + 3_250_000),
        (9_000, 9_030),
    ]
    assert unread == 1 and all(e.device is None for e in resolved)


def test_a_timing_the_device_refuses_to_read_keeps_the_host_figure() -> None:
    class Broken:
        def ready(self) -> bool:
            return True

        def seconds(self) -> float:
            raise RuntimeError("timing was not enabled for this Work")

    resolved, unread = resolve([_event(10, 20, Broken())])
    assert (resolved[0].end_ns, unread) == (20, 1)


def _raw(step: int, *devices: Any) -> RawStep:
    events = StepEvents()
    events.collectives = [_event(0, 1, d) for d in devices]
    return RawStep(step, 0, 1, 1, None, None, events, None)


def test_steps_wait_for_their_timings_and_leave_in_order() -> None:
    now = [0.0]
    gate: StepGate[RawStep] = StepGate(
        lambda raw: (e.device for e in raw.events.collectives if e.device is not None),
        max_wait_s=2.0,
        clock=lambda: now[0],
    )
    slow, fast = FakeWork(1.0), FakeWork(1.0)
    fast.completed = True
    gate.add([_raw(1, WorkTiming(slow)), _raw(2, WorkTiming(fast)), _raw(3)])
    assert gate.ready() == []  # step 1 is not done, and nothing overtakes it
    slow.completed = True
    assert [r.step for r in gate.ready()] == [1, 2, 3]
    assert len(gate) == 0


def test_a_timing_that_never_completes_holds_its_step_at_most_max_wait() -> None:
    now = [0.0]
    gate: StepGate[RawStep] = StepGate(
        lambda raw: (e.device for e in raw.events.collectives if e.device is not None),
        max_wait_s=2.0,
        clock=lambda: now[0],
    )
    gate.add([_raw(1, WorkTiming(FakeWork(1.0)))])
    now[0] = 1.9
    assert gate.ready() == []
    now[0] = 2.0
    assert [r.step for r in gate.ready()] == [1]
    gate.add([_raw(2, WorkTiming(FakeWork(1.0)))])
    assert [r.step for r in gate.ready(final=True)] == [2]  # closing sends everything


class _Bucket:
    """What DDP hands a comm hook: the flattened gradients, an index, the parameters."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer

    def buffer(self) -> Any:
        return self._buffer

    def index(self) -> int:
        return 0

    def parameters(self) -> list[Any]:
        return [self._buffer]


class _NcclGroup:
    """A 2-rank process group whose all-reduce returns a Work NCCL times itself."""

    def __init__(self, duration_ms: float) -> None:
        import torch

        self.works: list[FakeWork] = []
        self.futures: list[torch.futures.Future[Any]] = []
        self._duration_ms = duration_ms

    def size(self) -> int:
        return 2

    def allreduce(self, tensors: list[Any]) -> FakeWork:
        import torch

        work = FakeWork(self._duration_ms)
        future: torch.futures.Future[Any] = torch.futures.Future()
        work.get_future = lambda: future  # type: ignore[attr-defined]
        self.works.append(work)
        self.futures.append(future)
        return work


def test_a_ddp_bucket_on_nccl_takes_nccls_own_timing_of_its_all_reduce() -> None:
    """The comm hook's plain all-reduce keeps its Work's timing: once NCCL says the
    kernel took 7 ms, the bucket and its all_reduce last 7 ms from launch, whatever the
    host saw of the completion (here: much later)."""
    import time

    import torch

    from torshmon.probe.commhook import DispatchingCommHook
    from torshmon.probe.inflight import InflightTable
    from torshmon.probe.timing import resolve_buckets

    events = StepEvents()
    group = _NcclGroup(duration_ms=7.0)
    hook = DispatchingCommHook(group, "default", InflightTable(), lambda: events)
    hook.device_clock = DeviceClock(event_factory=FakeEvent, nccl_timing=True)
    hook._backend_name = "nccl"  # what dist.get_backend says of a NCCL group
    buffer = torch.ones(8)
    reduced = hook(None, _Bucket(buffer))  # type: ignore[arg-type]
    time.sleep(0.05)  # the host learns of the completion late
    group.futures[0].set_result([buffer])
    assert torch.equal(reduced.wait(), torch.full((8,), 0.5))  # the result is untouched
    [bucket], [collective] = events.buckets, events.collectives
    assert isinstance(bucket.device, WorkTiming) and collective.device is bucket.device
    assert (bucket.done_ns - bucket.launch_ns) / 1e9 >= 0.05  # the host's figure, until read
    assert resolve_buckets([bucket]) == ([bucket._replace(device=None)], 1)  # not ready yet
    group.works[0].completed = True
    [timed], unread = resolve_buckets([bucket])
    assert unread == 0 and timed.device is None
    assert timed.done_ns - timed.launch_ns == 7_000_000
    [timed_collective], _ = resolve([collective])
    assert timed_collective.end_ns - timed_collective.start_ns == 7_000_000
    # gloo (host clock): no device timing at all.
    events.buckets.clear()
    hook._backend_name = "gloo"
    hook(None, _Bucket(torch.ones(8)))  # type: ignore[arg-type]
    group.futures[1].set_result([torch.ones(8)])
    assert events.buckets[0].device is None


def test_step_marks_give_the_step_and_ddps_exposed_wait_once_the_device_is_there() -> None:
    from torshmon.probe.timing import StepMarks

    def at(ms: float) -> FakeEvent:
        FakeEvent.stream_ms = ms
        event = FakeEvent()
        event.record()
        return event

    FakeEvent.device_ms = 0.0
    marks = StepMarks(at(100.0))
    marks.last_grad = at(130.0)  # backward compute over
    marks.backward_end = at(142.0)  # the stream waited 12 ms for DDP's last bucket
    assert not marks.ready() and marks.split() is None  # no end yet
    marks.end = at(150.0)
    assert not marks.ready() and marks.split() is None  # the device is not there yet
    FakeEvent.device_ms = 150.0
    assert marks.ready()
    assert marks.split() == pytest.approx((0.05, 0.012))
    # Without a backward (a step of collectives only): the step alone.
    bare = StepMarks(at(200.0))
    bare.end = at(210.0)
    FakeEvent.device_ms = 210.0
    assert bare.split() == pytest.approx((0.01, None))


def test_a_step_summarised_with_device_marks_takes_their_duration_and_ddp_wait() -> None:
    from torshmon.probe.summary import summarize_step

    events = StepEvents()
    events.last_grad_ns, events.backward_end_ns = 1_000, 2_000  # 1 us on the host
    blocking = _event(3_000, 4_003_000)  # 4 ms, already read from the device
    events.collectives.append(blocking)
    raw = RawStep(1, 0, 5_000_000_000, 0, 16, None, events, None)
    host = summarize_step(raw)
    assert host.duration_s == 5.0 and host.comm_wait_s == pytest.approx(0.004001)
    device = summarize_step(raw, (0.05, 0.012))
    assert device.duration_s == 0.05
    assert device.comm_wait_s == pytest.approx(0.016)  # 12 ms of DDP + the 4 ms call
    assert device.compute_s == pytest.approx(0.034)
    assert device.samples_per_s == pytest.approx(16 / 0.05)
