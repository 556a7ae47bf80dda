"""torshmon on NCCL: its collective times next to torch.profiler's kernel times, and its
overhead next to bare training, on every GPU of the machine (world size 1 allowed).

Each rank (one per GPU, NCCL, ``TORCH_NCCL_ENABLE_TIMING=1``) runs two workloads:

- ``collectives``: a model whose gradients are all-reduced by explicit
  ``dist.all_reduce`` calls (blocking, and asynchronous with a later ``wait``), so
  every NCCL kernel comes from a call the probe times. One window runs under
  ``torch.profiler`` (CPU + CUDA) with the probe attached: the sum of torshmon's
  collective durations for those steps is compared with the sum of the NCCL kernels'
  durations the profiler recorded (target: within 10%).
- ``ddp``: a DDP MLP, rounds of ``bare``, ``probe`` (``attach``'s defaults: the run-queue
  clocks off) and ``probe_lean`` (``fast_lane=False`` too) interleaved (rotated), timed
  with ``torch.cuda.synchronize()`` at each round's end: the probe's overhead ratio, and
  the lean probe's. On two shared CPU cores the fast lane costs 0-2.4 % of a 10 ms step
  (``overhead.py --ablate``); where each rank has cores to spare it should cost next to
  nothing, which this says.

The probe ships its records to a real ``ProbeReceiver`` in this process. The last
line of stdout is one JSON object. ``--backend gloo --device cpu`` runs the same
logic on CPU (no kernel comparison): a smoke test of the script where no GPU is.

Usage::

    python benchmarks/gpu.py            # all GPUs
    python benchmarks/gpu.py --world-size 1 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import torshmon
from torshmon.agent.receiver import ThreadedReceiver
from torshmon.launch import run_ranks
from torshmon.wire import Batch, ProbeMessage


@dataclass(frozen=True, slots=True)
class Plan:
    device: str
    backend: str
    agent_socket: str
    rounds: int
    steps: int
    profiled_steps: int
    width: int


@dataclass(slots=True)
class RankResult:
    bare_s: list[float] = field(default_factory=list)
    probe_s: list[float] = field(default_factory=list)
    lean_s: list[float] = field(default_factory=list)
    kernel_s: float | None = None  # NCCL kernels in the profiled window (profiler)
    profiled_first_step: int = 0
    profiled_last_step: int = 0


class Records:
    """Step records the probes shipped, by (job, rank, step)."""

    def __init__(self) -> None:
        self.collective_s: dict[tuple[str, int, int], float] = {}
        self.clock: dict[tuple[str, int, int], str] = {}

    def __call__(self, message: ProbeMessage) -> None:
        if isinstance(message, Batch):
            for step in message.steps:
                key = (message.job, message.rank, step.step)
                self.collective_s[key] = sum(c.duration_s for c in step.collectives)
                self.clock[key] = step.collective_clock


def _device(plan: Plan, rank: int) -> torch.device:
    return torch.device("cuda", rank) if plan.device == "cuda" else torch.device("cpu")


def _sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, 4 * width), nn.ReLU(),
        nn.Linear(4 * width, width),
    )  # fmt: skip


def rank_main(rank: int, world_size: int, plan: Plan) -> RankResult:
    device = _device(plan, rank)
    result = RankResult()
    _collectives_window(rank, world_size, plan, device, result)
    _overhead_rounds(plan, device, result)
    return result


def _collectives_window(
    rank: int, world_size: int, plan: Plan, device: torch.device, result: RankResult
) -> None:
    """Explicit collectives under the probe and the profiler at once."""
    torch.manual_seed(0)
    model = _mlp(plan.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, plan.width, device=device)
    mon = torshmon.attach(None, job="gpu-collectives", agent_socket=plan.agent_socket)
    params = list(model.parameters())

    def step() -> None:
        with mon.step(batch_size=64) as scope:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), x)
            loss.backward()
            half = len(params) // 2
            for p in params[:half]:  # blocking all-reduces
                dist.all_reduce(p.grad)
            works = [dist.all_reduce(p.grad, async_op=True) for p in params[half:]]
            for work in works:
                work.wait()
            optimizer.step()
            scope.loss = loss

    for _ in range(5):  # warm-up: NCCL communicators, cuBLAS handles
        step()
    _sync(plan)
    activities = [ProfilerActivity.CPU]
    if plan.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    result.profiled_first_step = mon.steps + 1
    with profile(activities=activities) as prof:
        for _ in range(plan.profiled_steps):
            step()
        _sync(plan)
    result.profiled_last_step = mon.steps
    if plan.device == "cuda":
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()
        ]
        result.kernel_s = sum(e.device_time for e in kernels) / 1e6  # microseconds
    mon.close()


#: The ``ddp`` workload's arms, and each probe arm's ``attach`` options.
ARMS: dict[str, dict[str, bool] | None] = {
    "bare": None,
    # attach's defaults, passed in full: the environment cannot change an arm
    "probe": {"fast_lane": True, "cpu_wait": False},
    "probe_lean": {"fast_lane": False, "cpu_wait": False},
}


def _overhead_rounds(plan: Plan, device: torch.device, result: RankResult) -> None:
    names = tuple(ARMS)
    times = {"bare": result.bare_s, "probe": result.probe_s, "probe_lean": result.lean_s}
    for round_index in range(plan.rounds):
        shift = round_index % len(names)
        for arm in names[shift:] + names[:shift]:
            options = ARMS[arm]
            torch.manual_seed(1)
            model = _mlp(plan.width).to(device)
            ddp = DistributedDataParallel(
                model, device_ids=[device.index] if plan.device == "cuda" else None
            )
            optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            x = torch.randn(64, plan.width, device=device)
            mon = (
                None
                if options is None
                else torshmon.attach(
                    ddp, job=f"gpu-overhead-{arm}", agent_socket=plan.agent_socket, **options
                )
            )
            for _ in range(3):
                _ddp_step(ddp, optimizer, x, mon)
            _sync(plan)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(plan.steps):
                _ddp_step(ddp, optimizer, x, mon)
            _sync(plan)
            elapsed = (time.perf_counter() - start) / plan.steps
            times[arm].append(elapsed)
            if mon is not None:
                mon.close()


def _ddp_step(
    ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, x: torch.Tensor, mon: Any
) -> None:
    def body() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), x)
        loss.backward()
        optimizer.step()
        return loss

    if mon is None:
        body()
        return
    with mon.step(batch_size=x.shape[0]) as scope:
        scope.loss = body()


def _wait_for(records: Records, keys: list[tuple[str, int, int]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(k not in records.collective_s for k in keys) and time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, help="ranks (default: every GPU)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (use --backend gloo --device cpu for a "
              "smoke run)", file=sys.stderr)  # fmt: skip
        return 2
    world = args.world_size or (torch.cuda.device_count() if args.device == "cuda" else 2)
    started = time.perf_counter()
    records = Records()
    with tempfile.TemporaryDirectory(prefix="torshmon-gpu-") as tmp:
        plan = Plan(
            device=args.device,
            backend=args.backend,
            agent_socket=str(Path(tmp) / "agent.sock"),
            rounds=4 if args.quick else 12,
            steps=10 if args.quick else 50,
            profiled_steps=5 if args.quick else 20,
            width=256 if args.device == "cpu" else args.width,
        )
        env = {"TORCH_NCCL_ENABLE_TIMING": "1"}
        with ThreadedReceiver(plan.agent_socket, on_message=records):
            results: list[RankResult] = run_ranks(
                rank_main, world, plan, timeout_s=1200, env=env, backend=args.backend
            )
            keys = [
                ("gpu-collectives", rank, step)
                for rank, r in enumerate(results)
                for step in range(r.profiled_first_step, r.profiled_last_step + 1)
            ]
            _wait_for(records, keys, timeout_s=10)
    summary: dict[str, Any] = {
        "world_size": world,
        "backend": args.backend,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
    }
    missing = [k for k in keys if k not in records.collective_s]
    summary["profiled_steps_missing"] = len(missing)
    torshmon_s = sum(records.collective_s.get(k, 0.0) for k in keys)
    clocks = sorted({records.clock[k] for k in keys if k in records.clock})
    summary["collective_clock"] = clocks
    summary["torshmon_collective_s"] = torshmon_s
    if args.device == "cuda":
        kernel_s = sum(r.kernel_s or 0.0 for r in results)
        summary["profiler_nccl_kernel_s"] = kernel_s
        summary["collective_time_vs_profiler"] = torshmon_s / kernel_s if kernel_s else None
    ratios = [
        statistics.median(r.probe_s) / statistics.median(r.bare_s) for r in results if r.bare_s
    ]
    summary["overhead_ratio_median"] = statistics.median(ratios)
    summary["overhead_ratio_per_rank"] = ratios
    lean = [statistics.median(r.lean_s) / statistics.median(r.bare_s) for r in results if r.bare_s]
    summary["lean_overhead_ratio_median"] = statistics.median(lean)
    summary["bare_step_s"] = statistics.median(s for r in results for s in r.bare_s)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    print(
        f"collectives: torshmon {torshmon_s * 1e3:.2f} ms over {len(keys)} rank-steps "
        f"(clock: {', '.join(clocks) or 'none'})"
        + (
            f"; profiler NCCL kernels {summary['profiler_nccl_kernel_s'] * 1e3:.2f} ms; "
            f"ratio {summary['collective_time_vs_profiler']:.3f}"
            if args.device == "cuda" and summary["profiler_nccl_kernel_s"]
            else ""
        )
    )
    print(
        f"overhead: probe/bare step time {summary['overhead_ratio_median']:.4f}, "
        f"lean probe/bare {summary['lean_overhead_ratio_median']:.4f} "
        f"(bare {summary['bare_step_s'] * 1e3:.2f} ms/step, {world} ranks)"
    )
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    sys.exit(main())
