"""Functional collectives (DTensor, FSDP2, compiled code) in real gloo jobs."""

from __future__ import annotations

import pytest

from tests.integration.conftest import ReceiverThread
from torshmon.launch import run_ranks
from torshmon.wire import StepRecord

pytestmark = pytest.mark.integration

TIMEOUT_S = 180


def _ops(step: StepRecord) -> dict[tuple[str, str], tuple[int, int]]:
    return {(c.op, c.dtype): (c.count, c.size_bytes) for c in step.collectives}


def _issue_functional_ops(rank: int, world: int, sock: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torshmon

    group = dist.group.WORLD
    name = group.group_name
    c10d = torch.ops._c10d_functional
    monitor = torshmon.attach(None, job="funcol", agent_socket=sock, flush_interval_s=0.05)
    with monitor.step():
        for _ in range(2):
            _ = funcol.all_reduce(torch.ones(1000), "sum", group) + 0  # waits on use
        c10d.wait_tensor(c10d.all_reduce(torch.ones(500, dtype=torch.float64), "sum", name))
        c10d.wait_tensor(c10d.all_reduce_(torch.ones(10), "sum", name))
        for out in c10d.all_reduce_coalesced([torch.ones(5), torch.ones(7)], "sum", name):
            c10d.wait_tensor(out)
        c10d.wait_tensor(c10d.all_gather_into_tensor(torch.ones(100), world, name))
        c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.ones(50 * world), "sum", world, name))
        c10d.wait_tensor(
            c10d.all_to_all_single(torch.ones(10 * world), [10] * world, [10] * world, name)
        )
        c10d.wait_tensor(c10d.broadcast(torch.ones(64), 0, name))
    monitor.close()
    # uninstalled: still works, no longer recorded
    c10d.wait_tensor(c10d.all_reduce(torch.ones(3), "sum", name))


@pytest.mark.parametrize("world", [2])
def test_functional_collectives_are_recorded_with_bytes_dtype_and_group(
    receiver: ReceiverThread, world: int
) -> None:
    run_ranks(_issue_functional_ops, world, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    expected = {
        ("all_reduce", "float32"): (3, 2 * 4000 + 40),
        ("all_reduce", "float64"): (1, 8 * 500),
        ("all_reduce_coalesced", "float32"): (1, 48),
        ("all_gather_into_tensor", "float32"): (1, 400 * world),
        ("reduce_scatter_tensor", "float32"): (1, 200 * world),
        ("all_to_all_single", "float32"): (1, 40 * world),
        ("broadcast", "float32"): (1, 256),
    }
    for rank in range(world):
        [step] = receiver.steps(rank)
        assert _ops(step) == expected, f"rank {rank}"
        assert all(c.pg == "default" and c.duration_s > 0 for c in step.collectives)
        assert step.comm_wait_s > 0  # the waits are time the step was blocked
        assert receiver.batches(rank)[-1].inflight == []


def _fsdp2_with_clipping(rank: int, world: int, sock: str) -> list[float]:
    import torch
    from torch.distributed.fsdp import fully_shard

    import torshmon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    monitor = torshmon.attach(None, job="fsdp2", agent_socket=sock, flush_interval_s=0.05)
    norms = []
    for _ in range(3):
        with monitor.step(batch_size=8):
            x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            norms.append(float(norm.full_tensor()))
    monitor.close()
    return norms


def test_fsdp2_gradient_clipping_all_reduce_is_recorded_once(receiver: ReceiverThread) -> None:
    run_ranks(_fsdp2_with_clipping, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    params = 16 * 32 + 32 + 32 * 4 + 4
    for rank in range(2):
        steps = receiver.steps(rank)
        assert [s.step for s in steps] == [1, 2, 3]
        for step in steps:
            ops = _ops(step)
            # clip_grad_norm_ on DTensors: one all-reduce through _c10d_functional,
            # of the per-parameter norms (4 parameters, float32)
            assert ops[("all_reduce", "float32")] == (1, 4 * 4)
            # FSDP2's own collectives stay as they were: unsharded parameters gathered
            # in forward and again in backward, gradients reduce-scattered, once each
            # (torch 2.13's FSDP2 calls dist.all_gather_single / reduce_scatter_single)
            assert ops[("all_gather_single", "float32")] == (4, 2 * params * 4)
            assert ops[("reduce_scatter_single", "float32")] == (2, params * 4)
            assert len(ops) == 3, ops


def _compiled(rank: int, world: int, sock: str) -> float:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torshmon

    @torch.compile(backend="aot_eager", fullgraph=True)
    def reduce(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    monitor = torshmon.attach(None, job="compiled", agent_socket=sock, flush_interval_s=0.05)
    for _ in range(2):  # the first call traces (fake tensors: nothing runs, nothing recorded)
        with monitor.step():
            out = reduce(torch.ones(256))
    monitor.close()
    return float(out[0])


def test_compiled_code_collectives_are_recorded(receiver: ReceiverThread) -> None:
    results = run_ranks(_compiled, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    assert results == [5.0, 5.0]
    for rank in range(2):
        steps = receiver.steps(rank)
        assert [_ops(s) for s in steps] == [{("all_reduce", "float32"): (1, 1024)}] * 2


def _dtensor_tp(rank: int, world: int, sock: str) -> list[float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import torshmon

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    monitor = torshmon.attach(None, job="tp", agent_socket=sock, flush_interval_s=0.05)
    with monitor.step():
        out = model(torch.ones(4, 8))
        out.sum().backward()
    monitor.close()
    return [float(v) for v in out.detach().flatten()]


def test_tensor_parallel_collectives_are_recorded(receiver: ReceiverThread) -> None:
    outs = run_ranks(_dtensor_tp, 2, str(receiver.socket_path), timeout_s=TIMEOUT_S)
    assert outs[0] == outs[1]
    for rank in range(2):
        [step] = receiver.steps(rank)
        ops = _ops(step)
        # RowwiseParallel all-reduces its (4, 8) partial output in forward
        assert ops == {("all_reduce", "float32"): (1, 4 * 8 * 4)}
