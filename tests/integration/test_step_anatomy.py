"""What a step is charged with, in real gloo DDP jobs: its own forward/backward and
nothing from outside ``mon.step()``; the data loader's time as input wait."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from tests.integration.test_probe import _model
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 180
LOADER_DELAY_S = 0.3


def _batches(count: int, rank: int, delay_s: float = 0.0) -> Iterator[tuple[Any, Any]]:
    """A loader: fixed per-rank batches, each ``delay_s`` late (slow storage)."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    for _ in range(count):
        if delay_s:
            time.sleep(delay_s)  # the loader's own work, not a synchronisation
        yield torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)


def _train_with_eval(rank: int, world: int, sock: str) -> list[float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    monitor = torshmon.attach(ddp, job="eval", agent_socket=sock, flush_interval_s=0.05)
    eval_x = torch.randn(4096, 32)
    eval_times = []
    for _epoch in range(2):
        for x, y in _batches(4, rank):
            with monitor.step(batch_size=16) as step:
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step.loss = loss
        # an eval pass between epochs, through the same DDP module, outside any step
        started = time.perf_counter()
        with torch.no_grad():
            for _ in range(100):
                ddp(eval_x)
        eval_times.append(time.perf_counter() - started)
    monitor.close()
    return eval_times


def test_an_eval_pass_between_epochs_is_charged_to_no_training_step(
    receiver: ReceiverThread,
) -> None:
    results = run_ranks(_train_with_eval, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    for rank, eval_times in enumerate(results):
        steps = receiver.steps(rank)
        assert [s.step for s in steps] == list(range(1, 9))
        shortest_eval = min(eval_times)
        for step in steps:
            # the step after the eval pass (5) once took its whole time as forward_s
            assert step.forward_s is not None and step.forward_s < shortest_eval, step.step
        # input wait is the loader's time: never the eval pass, which is eval_s
        assert steps[0].input_wait_s is None  # no step before the first
        after_eval = steps[4]  # the eval pass ran in the gap before it
        assert after_eval.eval_s is not None and after_eval.input_wait_s is not None
        assert shortest_eval * 0.9 <= after_eval.eval_s <= max(eval_times) + 0.05
        assert after_eval.input_wait_s < shortest_eval / 4
        assert all(s.input_wait_s is not None for s in steps[1:])
        assert all(s.eval_s == 0.0 for i, s in enumerate(steps) if i not in (0, 4))


def _slow_loader(rank: int, world: int, sock: str) -> list[float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    ddp = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    monitor = torshmon.attach(ddp, job="loader", agent_socket=sock, flush_interval_s=0.05)
    fetch_times = []
    batches = _batches(5, rank, delay_s=LOADER_DELAY_S)
    while True:
        started = time.perf_counter()
        batch = next(batches, None)
        fetch_times.append(time.perf_counter() - started)
        if batch is None:
            break
        x, y = batch
        with monitor.step(batch_size=16):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    monitor.close()
    return fetch_times


def test_a_slow_loader_shows_as_input_wait_outside_the_step(receiver: ReceiverThread) -> None:
    results = run_ranks(_slow_loader, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    for rank, fetch_times in enumerate(results):
        steps = receiver.steps(rank)
        assert [s.step for s in steps] == [1, 2, 3, 4, 5]
        assert steps[0].input_wait_s is None
        for step in steps[1:]:
            fetched = fetch_times[step.step - 1]  # the fetch right before this step
            assert step.input_wait_s is not None
            # the wait covers the fetch the job timed, and little else
            assert fetched <= step.input_wait_s <= fetched + 0.2, (step.step, fetched)
            assert step.input_wait_s >= LOADER_DELAY_S


class _SlowDeviceEvent:
    """A stand-in CUDA event on a device that runs at a tenth of the host's speed (its
    clock reads ten times the host's time since the first event): a step's device figures
    are then ten times its host figures, so the record shows which it took."""

    origin: float | None = None

    def __init__(self) -> None:
        self.at_ms = 0.0

    def record(self) -> None:
        now = time.perf_counter()
        if _SlowDeviceEvent.origin is None:
            _SlowDeviceEvent.origin = now
        self.at_ms = 10_000.0 * (now - _SlowDeviceEvent.origin)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _SlowDeviceEvent) -> float:
        return end.at_ms - self.at_ms


def _train_on_a_fake_device(rank: int, world: int, sock: str) -> list[float]:
    """DDP with the probe's device clock replaced by ``_SlowDeviceEvent`` on gloo (as
    if it were NCCL): the step marks and the collectives' events go the real path."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from torshmon.probe import timing

    clock = timing.DeviceClock(event_factory=_SlowDeviceEvent, nccl_timing=False)
    clock.on_device = lambda backend: True  # type: ignore[method-assign]
    timing.DeviceClock.for_torch = staticmethod(lambda: clock)  # type: ignore[method-assign]
    ddp = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    monitor = torshmon.attach(ddp, job="marks", agent_socket=sock, flush_interval_s=0.05)
    host = []
    for x, y in _batches(8, rank):
        started = time.perf_counter()
        with monitor.step(batch_size=16):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        host.append(time.perf_counter() - started)
    monitor.close()
    return host


def test_on_a_device_the_step_and_its_comm_wait_are_the_devices_figures(
    receiver: ReceiverThread,
) -> None:
    results = run_ranks(_train_on_a_fake_device, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    for rank, host in enumerate(results):
        steps = receiver.steps(rank)
        assert [s.step for s in steps] == list(range(1, 9))
        for step, host_s in zip(steps, host, strict=True):
            assert step.collective_clock == "device"
            # The device's figure (ten times the host's), not the host's: the phases (host
            # times, inside the marks) are ten times shorter; the whole step scope bounds it.
            phases_s = (
                (step.forward_s or 0.0) + (step.backward_s or 0.0) + (step.optimizer_s or 0.0)
            )
            assert 5 * phases_s < step.duration_s < 10.5 * host_s, (step, host_s)
            assert step.comm_wait_s + step.compute_s == pytest.approx(step.duration_s)
            assert 0.0 < step.comm_wait_s < step.duration_s
