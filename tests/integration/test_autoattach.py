"""The automatic attach in one gloo rank: steps delimited by the DDP forward pass and the
optimizer, evaluation outside them, and a script that attaches late taking over."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import ReceiverThread
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration


def _rank(rank: int, world: int, sock: str) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torshmon
    from torshmon.probe import autoattach

    autoattach.install()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(batch: int) -> None:
        model(torch.randn(batch, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    train(5)
    train(5)
    model.eval()
    with torch.no_grad():
        model(torch.randn(7, 8))  # evaluation: begins no step (else step 3 were 7 wide)
    model.train()
    train(5)
    auto = autoattach.monitor()
    auto_steps = auto.steps if auto is not None else -1
    # The script attaches now, after its first steps: its monitor takes over.
    mon = torshmon.attach(model, job="late", agent_socket=sock)
    with mon.step(batch_size=4):
        train(4)
    train(4)  # its own steps only: the optimizer no longer ends one
    late_steps = mon.steps
    mon.close()
    autoattach.uninstall()
    return {
        "auto_steps": auto_steps,
        "auto_left": autoattach.monitor() is None,
        "late_steps": late_steps,
    }


def test_auto_steps_then_the_scripts_own_attach_wins(receiver: ReceiverThread) -> None:
    env = {
        "TORSHMON_AGENT_SOCKET": str(receiver.socket_path),
        "TORSHMON_JOB": "auto",
        "OMP_NUM_THREADS": "1",
    }
    [result] = run_ranks(_rank, 1, str(receiver.socket_path), env=env, timeout_s=120)
    assert result == {"auto_steps": 3, "auto_left": True, "late_steps": 1}
    auto = receiver.steps(0, job="auto")
    assert [(s.step, s.batch_size) for s in auto] == [(1, 5), (2, 5), (3, 5)]
    assert [(s.step, s.batch_size) for s in receiver.steps(0, job="late")] == [(1, 4)]


def _fsdp_rank(rank: int, world: int, sock: str) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed.fsdp as fsdp  # imported before install: wrapped at once

    from torshmon.probe import autoattach

    original = fsdp.fully_shard
    autoattach.install()
    wrapped = fsdp.fully_shard is not original
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for layer in net:
        fsdp.fully_shard(layer)
    model = fsdp.fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(batch: int) -> None:
        model(torch.randn(batch, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    train(5)
    model.eval()
    with torch.no_grad():
        started = time.perf_counter()
        model(torch.randn(7, 8))  # evaluation: no step, its time eval_s
        eval_s = time.perf_counter() - started
    model.train()
    train(5)
    train(5)
    autoattach.uninstall()
    return {"wrapped": wrapped, "restored": fsdp.fully_shard is original, "eval_s": eval_s}


def test_fsdp2_modules_begin_steps_like_ddp(receiver: ReceiverThread) -> None:
    env = {
        "TORSHMON_AGENT_SOCKET": str(receiver.socket_path),
        "TORSHMON_JOB": "auto-fsdp",
        "OMP_NUM_THREADS": "1",
    }
    results = run_ranks(_fsdp_rank, 2, str(receiver.socket_path), env=env, timeout_s=120)
    for rank, result in enumerate(results):
        # fully_shard stood in for while installed, FSDP's own again after uninstall
        assert result["wrapped"] and result["restored"], result
        steps = receiver.steps(rank, job="auto-fsdp")
        assert [(s.step, s.batch_size) for s in steps] == [(1, 5), (2, 5), (3, 5)]
        # the evaluation pass between steps 1 and 2 was watched, not input wait
        assert 0 < (steps[1].eval_s or 0) <= result["eval_s"], (steps[1], result)
        assert steps[2].eval_s == 0, steps[2]
        for s in steps:
            ops = {c.op for c in s.collectives}
            assert any(op.startswith("all_gather") for op in ops), (rank, s.step, ops)
            assert any(op.startswith("reduce_scatter") for op in ops), (rank, s.step, ops)
