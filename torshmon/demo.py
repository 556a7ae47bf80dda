"""``torshmon demo``: a real multi-process gloo DDP job watched by the probe.

Every rank trains an MLP on a synthetic regression task with the probe
attached; the probes ship their records over the real wire protocol to a
receiver in this process, which writes them to a JSON-lines file, shows
progress while the job runs and a summary at the end.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from torshmon.agent.receiver import ProbeReceiver
from torshmon.launch import run_ranks
from torshmon.wire import Batch, ProbeMessage, StepRecord


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo job runs; sizes in elements, ``out`` is the JSON-lines file."""

    world_size: int = 2
    steps: int = 200
    hidden: int = 1024
    layers: int = 4
    batch_size: int = 64
    job: str = "demo"
    out: Path = Path("torshmon-demo.jsonl")

    def __post_init__(self) -> None:
        for name in ("world_size", "steps", "hidden", "layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def model_bytes(self) -> int:
        per_layer = self.hidden * self.hidden + self.hidden
        return 4 * self.layers * per_layer


@dataclass(slots=True)
class Progress:
    """What the receiver has seen so far, per rank."""

    world_size: int
    steps: dict[int, list[StepRecord]] = field(default_factory=dict)
    dropped: dict[int, int] = field(default_factory=dict)
    batches: int = 0

    def observe(self, message: ProbeMessage) -> None:
        if isinstance(message, Batch):
            self.batches += 1
            self.steps.setdefault(message.rank, []).extend(message.steps)
            self.dropped[message.rank] = message.dropped_records_total

    def line(self, total_steps: int) -> str:
        if not self.steps:
            return "waiting for the ranks to start..."
        done = min(len(self.steps.get(r, [])) for r in range(self.world_size))
        recent = [s for records in self.steps.values() for s in records[-20:]]
        step_ms = 1e3 * statistics.median(s.duration_s for s in recent)
        comm = statistics.median(s.communication_time_ratio for s in recent)
        return f"step {done:>5}/{total_steps}  {step_ms:7.1f} ms/step  comm {comm:5.1%}"


def train_rank(
    rank: int, world_size: int, config: DemoConfig, socket_path: str
) -> dict[str, float]:
    """One rank of the demo job: DDP over an MLP, the probe attached."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(config.layers):
        layers += [torch.nn.Linear(config.hidden, config.hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    target = torch.randn(config.hidden, config.hidden, generator=generator) / config.hidden**0.5
    monitor = torshmon.attach(model, job=config.job, agent_socket=socket_path)
    loss = torch.zeros(())
    try:
        for _ in range(config.steps):
            x = torch.randn(config.batch_size, config.hidden, generator=generator)
            with monitor.step(batch_size=config.batch_size) as step:
                loss = torch.nn.functional.mse_loss(model(x), x @ target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step.loss = loss
    finally:
        monitor.close()
    return {"final_loss": loss.item(), "dropped": float(monitor.dropped_records_total)}


async def _run(config: DemoConfig, socket_path: str, progress: Progress) -> list[dict[str, float]]:
    config.out.unlink(missing_ok=True)
    async with ProbeReceiver(socket_path, out_path=config.out, on_message=progress.observe):
        job = asyncio.ensure_future(
            asyncio.to_thread(run_ranks, train_rank, config.world_size, config, socket_path)
        )
        while not job.done():
            await asyncio.wait({job}, timeout=1.0)
            if not job.done():
                print(progress.line(config.steps), flush=True)
        results = job.result()
        await asyncio.sleep(0)  # let the receiver finish the last frames
    return results


def run_demo(config: DemoConfig) -> int:
    """Run the demo job and print its summary; returns the process exit code."""
    print(
        f"torshmon demo: {config.world_size} gloo ranks x {config.steps} steps, "
        f"MLP of {config.model_bytes / 1e6:.1f} MB, records -> {config.out}",
        flush=True,
    )
    progress = Progress(config.world_size)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torshmon-demo-") as tmp:
        results = asyncio.run(_run(config, os.path.join(tmp, "agent.sock"), progress))
    print(summary(config, progress, results, time.monotonic() - started))
    return 0


def summary(
    config: DemoConfig, progress: Progress, results: list[dict[str, float]], wall_s: float
) -> str:
    """The end-of-run report: per-rank timings, job throughput, communication."""
    lines = [
        "",
        f"finished in {wall_s:.1f} s; final loss {results[0]['final_loss']:.4f}",
        "rank  steps  step ms  compute ms  comm wait ms  comm ratio  samples/s",
    ]
    step_s = []
    for rank in range(config.world_size):
        records = progress.steps.get(rank, [])
        if not records:
            lines.append(f"{rank:>4}  no records received")
            continue
        median = statistics.median(r.duration_s for r in records)
        step_s.append(median)
        lines.append(
            f"{rank:>4}  {len(records):>5}  {1e3 * median:7.1f}  "
            f"{1e3 * statistics.median(r.compute_s for r in records):10.1f}  "
            f"{1e3 * statistics.median(r.comm_wait_s for r in records):12.1f}  "
            f"{statistics.median(r.communication_time_ratio for r in records):10.1%}  "
            f"{statistics.median(r.samples_per_s or 0.0 for r in records):9.0f}"
        )
    if step_s:
        throughput = config.world_size * config.batch_size / max(step_s)
        lines.append(
            f"job throughput: {throughput:.0f} samples/s (median step of the slowest rank)"
        )
    lines += _comm_lines(progress)
    dropped = sum(progress.dropped.values())
    lines.append(f"dropped records: {dropped}; batches received: {progress.batches}")
    lines.append(f"records: {config.out} (one JSON message per line, schema torshmon.wire)")
    return "\n".join(lines)


def _comm_lines(progress: Progress) -> list[str]:
    records = progress.steps.get(0, [])
    if not records:
        return []
    ddp = next((r.ddp for r in reversed(records) if r.ddp is not None), None)
    out = []
    if ddp is not None:
        out.append(
            f"rank 0 DDP buckets: {len(ddp.bucket_sizes_bytes)} "
            f"({sum(ddp.bucket_sizes_bytes) / 1e6:.1f} MB of gradients), "
            f"backward comm {1e3 * ddp.avg_backward_comm_s:.1f} ms on average"
        )
    totals: dict[str, list[float]] = {}
    for record in records:
        for stat in record.collectives:
            entry = totals.setdefault(stat.op, [0, 0, 0.0])
            entry[0] += stat.count
            entry[1] += stat.size_bytes
            entry[2] += stat.duration_s
    for op, (count, size, seconds) in sorted(totals.items()):
        busbw = size / seconds / 1e9 if seconds > 0 else 0.0
        out.append(
            f"rank 0 {op}: {count:.0f} calls, {size / 1e9:.2f} GB, "
            f"{seconds:.2f} s in flight, ~{busbw:.2f} GB/s algorithm bandwidth"
        )
    return out
