"""The probe's Monitor apart from a running job (tests/integration/test_probe.py runs it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.integration.conftest import ReceiverThread
from torshmon.probe.api import attach
from torshmon.probe.monitor import Monitor, NullMonitor, _host_loss

# -- the step API on a real (one-rank, in-process) gloo group ---------------------------

EVAL_PASS_S = 0.05
LOADER_S = 0.1


class _Net(torch.nn.Module):
    """A model whose evaluation passes (no grad) take EVAL_PASS_S each."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            time.sleep(EVAL_PASS_S)
        return self.lin(x)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """torch.distributed initialised in this process (gloo, world size 1), then torn down."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[ReceiverThread]:
    rx = ReceiverThread(tmp_path / "agent.sock").start()
    try:
        yield rx
    finally:
        rx.stop()


def _train_step(ddp: Any, opt: Any) -> torch.Tensor:
    loss = ddp(torch.ones(8, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_begin_and_end_step_record_a_step_each_and_survive_a_lost_end(
    one_rank: None, receiver: ReceiverThread, caplog: pytest.LogCaptureFixture
) -> None:
    ddp = DistributedDataParallel(_Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = attach(ddp, job="api", agent_socket=str(receiver.socket_path), flush_interval_s=0.05)
    assert isinstance(mon, Monitor)
    losses = []
    with caplog.at_level(logging.WARNING, logger="torshmon.probe.monitor"):
        mon.begin_step(batch_size=8)
        losses.append(float(_train_step(ddp, opt).detach()))
        mon.end_step(losses[-1])  # step 1
        for _ in range(3):  # each begin finds the last one open: an exception skipped its end
            mon.begin_step(batch_size=8)
            _train_step(ddp, opt)
        mon.end_step(loss=2.5)  # the last of them, step 2
        mon.end_step()  # nothing open: ignored
        try:
            with mon.step(batch_size=8):
                raise ValueError("a step that raised")
        except ValueError:
            pass
        with mon.step(batch_size=4) as scope:  # step 3
            scope.loss = _train_step(ddp, opt)
    mon.close()
    _until(lambda: len(receiver.steps(0, job="api")) == 3)
    steps = receiver.steps(0, job="api")
    assert [(s.step, s.batch_size) for s in steps] == [(1, 8), (2, 8), (3, 4)]
    assert steps[0].loss == pytest.approx(losses[0]) and steps[1].loss == 2.5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # Said once each, however often it happened.
    assert warnings == [
        "torshmon: a step began while step 2 was open; the open one is dropped",
        "torshmon: end_step() with no step begun; ignored",
    ]


def test_time_between_steps_is_split_into_eval_collectives_and_input_wait(
    one_rank: None, receiver: ReceiverThread
) -> None:
    ddp = DistributedDataParallel(_Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = attach(ddp, job="gap", agent_socket=str(receiver.socket_path), flush_interval_s=0.05)
    with mon.step(batch_size=8):
        _train_step(ddp, opt)
    # Evaluation of the unwrapped module (as a trainer does), a logging collective,
    # then a slow loader.
    with torch.no_grad():
        for _ in range(4):
            ddp.module(torch.ones(2, 4))
    dist.all_reduce(torch.ones(1))
    time.sleep(LOADER_S)
    with mon.step(batch_size=8):
        _train_step(ddp, opt)
    time.sleep(LOADER_S)  # only a loader
    with mon.step(batch_size=8):
        _train_step(ddp, opt)
    mon.close()
    _until(lambda: len(receiver.steps(0, job="gap")) == 3)
    first, after_eval, plain = receiver.steps(0, job="gap")
    assert first.input_wait_s is None and first.eval_s is None
    assert after_eval.eval_s is not None and after_eval.input_wait_s is not None
    assert 4 * EVAL_PASS_S <= after_eval.eval_s < 4 * EVAL_PASS_S + 0.15
    assert LOADER_S <= after_eval.input_wait_s < LOADER_S + 0.1
    assert after_eval.between_steps_comm_s is not None and after_eval.between_steps_comm_s > 0
    assert [c.op for c in after_eval.collectives] == ["all_reduce"]
    assert plain.eval_s == 0.0 and plain.between_steps_comm_s == 0.0
    assert plain.input_wait_s is not None and LOADER_S <= plain.input_wait_s < LOADER_S + 0.1


def test_attach_outside_a_distributed_job_returns_a_monitor_that_does_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="torshmon.probe.api"):
        mon = attach(_Net(), job="solo")  # the module a single process trains
    assert isinstance(mon, NullMonitor) and mon.job == "solo"
    assert [r.getMessage() for r in caplog.records] == [
        "torshmon: not a distributed run (no process group): monitoring is off"
    ]
    with mon.step(batch_size=2) as scope:
        scope.loss = 1.0
    mon.begin_step(batch_size=2)
    mon.begin_step(batch_size=2)  # the open one is dropped, as Monitor does
    mon.end_step(0.5)
    mon.end_step()
    assert mon.steps == 2 and mon.config is None and mon.dropped_records_total == 0
    with pytest.raises(RuntimeError, match="live reconfiguration needs a distributed job"):
        mon.request_config(codec="fp16")
    mon.close()


def test_attach_before_init_process_group_in_a_rank_of_a_job_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        attach(None)


# -- the loss as the training thread hands it on ----------------------------------------


def test_a_one_element_cpu_loss_is_read_as_a_float_and_any_other_tensor_detached() -> None:
    weight = torch.tensor([2.0], requires_grad=True)
    scalar = _host_loss((weight * 1.5).sum())
    assert type(scalar) is float and scalar == 3.0
    one = _host_loss(weight * 1.5)  # shape [1]: one element, read as its value
    assert type(one) is float and one == 3.0
    integer = _host_loss(torch.tensor(7))
    assert type(integer) is float and integer == 7.0
    many = _host_loss(weight.expand(3) * 2.0)
    assert isinstance(many, torch.Tensor) and many.tolist() == [4.0, 4.0, 4.0]
    assert many.grad_fn is None and not many.requires_grad
    empty = _host_loss(torch.zeros(0))
    assert isinstance(empty, torch.Tensor) and empty.numel() == 0
    assert _host_loss(0.25) == 0.25 and _host_loss(None) is None
