"""torshmon never changes a training result: real gloo jobs with and without the probe.

A job's own DDP comm hook (built-in C++ or Python) survives every reconfiguration
torshmon accepts; what it cannot keep, it refuses with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_probe import _model
from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration

TIMEOUT_S = 300
NOWHERE = "/nonexistent/agent.sock"
CAPS_MB = (0.002, 0.05, 25.0)
STEPS_PER_CAP = 3


def _steps(ddp: Any, steps: int, rank: int, seed: int, monitor: Any = None) -> list[bytes]:
    """Train on a fixed per-rank stream; returns each step's loss and gradients as bytes."""
    import contextlib

    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=generator)
        y = torch.randn(16, 8, generator=generator)
        scope = monitor.step(batch_size=16) if monitor is not None else contextlib.nullcontext()
        with scope:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
            optimizer.step()
        out.append(loss.detach().numpy().tobytes() + grads.numpy().tobytes())
    return out


def _register(ddp: Any, hook: str | None) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook == "python_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is not None:
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook))


def _run(
    rank: int, hook: str | None, probe: bool, seed: int, bucket_timing: bool = False
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from torshmon.probe import _torch_compat
    from torshmon.probe.config import ConfigError

    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    _register(ddp, hook)
    monitor = None
    if probe:
        monitor = torshmon.attach(
            ddp, agent_socket=NOWHERE, sync_every=1, bucket_timing=bucket_timing
        )
    rejections: list[str] = []
    steps: list[bytes] = []
    for cap in CAPS_MB:
        if monitor is not None and rank == 0:
            try:
                monitor.request_config(bucket_cap_mb=cap)
            except ConfigError as exc:
                rejections.append(str(exc))
        steps += _steps(ddp, STEPS_PER_CAP, rank, seed + len(steps), monitor)
    if monitor is None:
        return {"steps": steps}
    if rank == 0:
        try:
            monitor.request_config(codec="int8")
        except ConfigError as exc:
            rejections.append(str(exc))
    assert monitor.config is not None
    version = monitor.config.version
    monitor.close()
    dist.barrier()
    kept = _torch_compat.job_comm_hook(ddp)
    return {
        "steps": steps,
        "version": version,
        "rejections": rejections,
        "hook_after": None if kept is None else kept.name,
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
    }


def _hooks_with_and_without_probe(rank: int, world: int, hook: str | None) -> dict[str, Any]:
    return {
        "bare": _run(rank, hook, probe=False, seed=0),
        "probed": _run(rank, hook, probe=True, seed=0),
        "no_hook": _run(rank, None, probe=False, seed=0),
    }


@pytest.mark.parametrize("hook", ["ALLREDUCE", "FP16_COMPRESS"])
def test_a_builtin_comm_hook_is_kept_across_bucket_cap_changes(hook: str) -> None:
    results = run_ranks(_hooks_with_and_without_probe, 2, hook, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        probed = result["probed"]
        # every cap change was applied, and the job's hook was registered again
        assert probed["version"] == len(CAPS_MB)
        assert probed["bucket_cap_bytes"] == int(CAPS_MB[-1] * 1024 * 1024)
        assert probed["hook_after"] == f"BuiltinCommHookType.{hook}"
        if rank == 0:
            [codec] = probed["rejections"]
            assert f"BuiltinCommHookType.{hook}" in codec and "codec" in codec
        assert probed["steps"] == result["bare"]["steps"], f"{hook}: results changed"
    if hook == "FP16_COMPRESS":
        # the hook matters: without it the gradients differ (so a dropped hook shows)
        assert results[0]["bare"]["steps"] != results[0]["no_hook"]["steps"]


def test_a_python_comm_hook_is_kept_and_retuning_refused_with_the_reason() -> None:
    results = run_ranks(_hooks_with_and_without_probe, 2, "python_fp16", timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        probed = result["probed"]
        assert probed["version"] == 0
        assert probed["hook_after"] == "fp16_compress_hook"
        if rank == 0:
            assert len(probed["rejections"]) == len(CAPS_MB) + 1
            assert all("fp16_compress_hook" in r for r in probed["rejections"])
        assert probed["steps"] == result["bare"]["steps"]
        assert result["bare"]["steps"] != result["no_hook"]["steps"]


def _ddp_with_and_without_probe(rank: int, world: int) -> dict[str, Any]:
    return {
        "bare": _run(rank, None, probe=False, seed=0),
        "probed": _run(rank, None, probe=True, seed=0),
        "timed": _run(rank, None, probe=True, seed=0, bucket_timing=True),
    }


def test_ddp_losses_and_gradients_are_identical_with_the_probe_across_reconfigurations() -> None:
    results = run_ranks(_ddp_with_and_without_probe, 2, timeout_s=TIMEOUT_S)
    for result in results:
        for run in ("probed", "timed"):
            assert result[run]["version"] == len(CAPS_MB)  # every cap change applied
            assert result[run]["bucket_cap_bytes"] == int(CAPS_MB[-1] * 1024 * 1024)
            assert result[run]["steps"] == result["bare"]["steps"], run


def _fsdp2(rank: int, probe: bool) -> list[bytes]:
    import contextlib

    import torch
    from torch.distributed.fsdp import fully_shard

    import torshmon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)
    monitor = torshmon.attach(None, agent_socket=NOWHERE) if probe else None
    out = []
    for _ in range(8):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        with monitor.step(batch_size=16) if monitor is not None else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            # functional all-reduce on DTensors, recorded by the probe's dispatcher kernel
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        out.append(loss.detach().numpy().tobytes() + norm.full_tensor().numpy().tobytes())
    final = torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()])
    out.append(final.numpy().tobytes())
    if monitor is not None:
        monitor.close()
    return out


def _fsdp2_with_and_without_probe(rank: int, world: int) -> dict[str, list[bytes]]:
    return {"bare": _fsdp2(rank, probe=False), "probed": _fsdp2(rank, probe=True)}


def test_fsdp2_losses_are_identical_with_the_probe() -> None:
    results = run_ranks(_fsdp2_with_and_without_probe, 2, timeout_s=TIMEOUT_S)
    for result in results:
        assert result["probed"] == result["bare"]
