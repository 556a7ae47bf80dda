"""Overhead of the torshmon probe on a real 2-rank gloo DDP job, next to torch.profiler.

One run interleaves four configurations in every rank process:

- ``bare``: plain DDP;
- ``probe``: DDP with ``torshmon.attach`` and ``mon.step()`` around each step,
  shipping its records to a real ``ProbeReceiver`` running in this process;
- ``probe_buckets``: the same with ``bucket_timing=True`` (every bucket timed
  through torshmon's Python comm hook);
- ``profiler``: DDP inside ``torch.profiler.profile(activities=[CPU])``.

With ``--ablate``, two more, the ``probe`` config with one part changed through
``attach``'s options, so a run says what each part costs in step time (the probe's CPU
time per part, which says less about step time than one would think, is
``probe_cost.py``'s):

- ``probe_lane_shut``: ``fast_lane=False`` (steps go only at each flush);
- ``probe_runqueue``: ``cpu_wait=True`` (the run-queue clocks read: schedstat files).

on two models: ``small`` (many small parameters, 40 DDP buckets per step, the
worst case for per-collective cost) and ``mlp`` (~7.3 M float32 parameters,
~29 MB, DDP's default bucket cap). Prints a table of step times and ratios to
``bare``, each paired ratio with a 95 % interval over rounds (``ratio_interval``), and
whether the probe is within its target (``TARGET_RATIO``, 1.01) on each model: met, not
met, or not resolved by this run's rounds; the last line of stdout is one JSON object.

Usage::

    python benchmarks/overhead.py --quick   # under a minute
    python benchmarks/overhead.py           # about 12 minutes (2 cores)
    python benchmarks/overhead.py --ablate --models small   # the parts' costs, ~6 min
    # each rank's training thread alone pinned, the probe's threads free to use the
    # other cores: ranks with cores to spare, as on a GPU node (the default, two ranks
    # pinned a core each, threads and all, has none). On a machine with more cores than
    # ranks; on two cores a single rank's rounds vary 30-50 % (two ranks': 4-24 %)
    python benchmarks/overhead.py --pin training-thread --ablate
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy import stats as scipy_stats
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import torshmon
from torshmon.agent.receiver import ThreadedReceiver
from torshmon.launch import run_ranks
from torshmon.wire import Batch, ProbeMessage

CONFIGS: tuple[str, ...] = ("bare", "probe", "probe_buckets", "profiler")
#: ``probe``'s options: attach's defaults, passed so $TORSHMON_FAST_LANE / $TORSHMON_CPU_WAIT
#: in the environment cannot turn the measured probe into a leaner one.
PROBE_OPTIONS: dict[str, bool] = {"fast_lane": True, "cpu_wait": False}
#: ``--ablate``'s configs: ``probe`` with one part changed by ``attach``'s options (module
#: docstring).
ABLATIONS: dict[str, dict[str, bool]] = {
    "probe_lane_shut": {"fast_lane": False},
    "probe_runqueue": {"cpu_wait": True},
}
WORLD_SIZE = 2
#: ``--pin``: ``rank``, each rank's threads to core ``rank`` (the probe's threads with
#: them: started by the pinned thread, they inherit its core); ``training-thread``, only
#: the thread that trains, and only while it runs a config's steps, so the threads a
#: config starts (the shipper) may run on any core; ``none``.
PIN_MODES = ("rank", "training-thread", "none")

StepFn = Callable[[], torch.Tensor]
ScopeFactory = Callable[[], contextlib.AbstractContextManager[Any]]


# -- what is measured -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A benchmark model: how to build it, its batch, and DDP's bucket cap (None: default)."""

    name: str
    build: Callable[[], nn.Module]
    in_features: int
    out_features: int
    batch_size: int
    bucket_cap_mb: float | None


def build_small(width: int = 64, depth: int = 40) -> nn.Module:
    """``depth`` Linear(width, width) layers: many 16 KB parameters, cheap compute."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def build_mlp() -> nn.Module:
    """1024 -> 2048 -> 2048 -> 512: about 7.3 M float32 parameters (29 MB)."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512)
    )


# A 0.015 MiB (15.4 KiB) cap closes a bucket at every 64x64 weight (16 KiB): one per layer.
MODELS: dict[str, ModelSpec] = {
    "small": ModelSpec("small", build_small, 64, 64, 32, bucket_cap_mb=0.015),
    "mlp": ModelSpec("mlp", build_mlp, 1024, 512, 32, bucket_cap_mb=None),
}


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """How many rounds of each model; each round runs every config once."""

    model: str
    rounds: int
    warmup_steps: int
    measured_steps: int


# Many short rounds beat a few long ones against bursts of load from elsewhere.
# The mlp's rounds are 10 steps of about 47 ms, and their medians spread 10-16 %
# on this 2-core box; 20 rounds left its paired ratio moving by 0.04 between
# full runs, 60 rounds steady it for about 4 more minutes.
# Warm-up covers DDP's bucket rebuild after the first step.
QUICK_PLAN: tuple[ModelPlan, ...] = (ModelPlan("small", 4, 5, 30), ModelPlan("mlp", 3, 2, 8))
FULL_PLAN: tuple[ModelPlan, ...] = (ModelPlan("small", 20, 10, 60), ModelPlan("mlp", 60, 3, 10))


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a rank needs; picklable, so it crosses the spawn boundary."""

    models: tuple[ModelPlan, ...]
    agent_socket: str
    flush_interval_s: float
    seed: int
    pin: str = "rank"  # PIN_MODES
    configs: tuple[str, ...] = CONFIGS


@dataclass(frozen=True, slots=True)
class Rounds:
    """One model's measurements, per config and round.

    ``step_s``: wall seconds of each measured step. ``cpu_s_per_step``: the
    rank process's CPU seconds (all its threads: training, gloo, the probe's
    shipper) over the measured steps, per step; far less sensitive than wall
    time to other programs sharing the machine.
    """

    step_s: dict[str, list[list[float]]]
    cpu_s_per_step: dict[str, list[float]]


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's measurements per model, plus what the probe reported."""

    rounds: dict[str, Rounds]
    buckets: dict[str, int]
    probe_steps: int
    probe_dropped: int
    probe_scope_s: float = 0.0


# -- the rank side --------------------------------------------------------------------
def rank_main(rank: int, world_size: int, plan: Plan) -> RankResult:
    """Run every model's rounds on this rank (every rank runs the same schedule)."""
    if plan.pin == "rank":
        # One core per rank: the ranks' compute and gloo threads stop trading
        # places on the 2 cores, which cuts the round-to-round spread about 3x.
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    rounds: dict[str, Rounds] = {}
    buckets: dict[str, int] = {}
    probe_counts = [0, 0]
    for model_plan in plan.models:
        rounds[model_plan.model], buckets[model_plan.model] = _bench_model(
            rank, model_plan, plan, probe_counts
        )
    scope_s = _probe_scope_s(plan.agent_socket, probe_counts)
    return RankResult(rounds, buckets, probe_counts[0], probe_counts[1], scope_s)


def _probe_scope_s(agent_socket: str, probe_counts: list[int], steps: int = 20_000) -> float:
    """Seconds the probe adds to each step on the training thread, measured directly.

    An empty ``with mon.step()`` on a DDP module: the step scope, the step
    record and the config consensus (its broadcast every ``sync_every`` steps),
    without any training to hide behind. Many iterations make this figure
    precise where step-time ratios drown in the machine's noise. Its records and drops
    are added to ``probe_counts`` (steps, dropped) with the configs'.
    """
    ddp = DistributedDataParallel(nn.Linear(4, 4))
    mon = torshmon.attach(ddp, job="scope", agent_socket=agent_socket)
    start = time.perf_counter()
    for _ in range(steps):
        with mon.step(batch_size=1):
            pass
    elapsed = time.perf_counter() - start
    mon.close()
    probe_counts[0] += mon.steps
    probe_counts[1] += mon.dropped_records_total
    return elapsed / steps


def _bench_model(
    rank: int, model_plan: ModelPlan, plan: Plan, probe_counts: list[int]
) -> tuple[Rounds, int]:
    spec = MODELS[model_plan.model]
    x, y = _batch(spec, seed=plan.seed + 1 + rank)
    result = Rounds({c: [] for c in plan.configs}, {c: [] for c in plan.configs})
    buckets = 0
    for round_index in range(model_plan.rounds):
        for config in rotation(round_index, plan.configs):
            # A fresh DDP module per config and round: the probe's comm hook can
            # only be registered once per module, and the same fresh start for
            # every config keeps the comparison fair (same seed, same weights).
            ddp, optimizer = _build(spec, plan.seed)
            dist.barrier()
            with _session(config, ddp, spec, plan, probe_counts) as scope, _pinned(rank, plan):
                step = _train_step(ddp, optimizer, x, y)
                step_s, cpu_s = _run_steps(
                    step, scope, model_plan.warmup_steps, model_plan.measured_steps
                )
            result.step_s[config].append(step_s)
            result.cpu_s_per_step[config].append(cpu_s)
            buckets = buckets or _bucket_count(ddp)
            del ddp, optimizer, step
            gc.collect()
    return result, buckets


@contextlib.contextmanager
def _pinned(rank: int, plan: Plan) -> Iterator[None]:
    """``--pin training-thread``: this thread on core ``rank`` while it trains; the
    config's threads, started before, keep every core (they inherit the affinity their
    starter had then)."""
    if plan.pin != "training-thread":
        yield
        return
    every_core = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, every_core)


def rotation(round_index: int, configs: tuple[str, ...] = CONFIGS) -> tuple[str, ...]:
    """The order of the configs in a round: rotated so none always goes first."""
    shift = round_index % len(configs)
    return configs[shift:] + configs[:shift]


def _batch(spec: ModelSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.batch_size, spec.in_features, generator=generator)
    y = torch.randn(spec.batch_size, spec.out_features, generator=generator)
    return x, y


def _build(spec: ModelSpec, seed: int) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    options: dict[str, Any] = {}
    if spec.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = spec.bucket_cap_mb
    ddp = DistributedDataParallel(spec.build(), **options)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3)


def _train_step(
    ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> StepFn:
    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step


@contextlib.contextmanager
def _session(
    config: str,
    ddp: DistributedDataParallel,
    spec: ModelSpec,
    plan: Plan,
    probe_counts: list[int],
) -> Iterator[ScopeFactory]:
    """Set up one config for one round; yields the per-step scope factory."""
    if config == "bare":
        yield contextlib.nullcontext
    elif config in ("probe", "probe_buckets", *ABLATIONS):
        monitor = torshmon.attach(
            ddp,
            job=f"overhead-{config}",
            agent_socket=plan.agent_socket,
            flush_interval_s=plan.flush_interval_s,
            bucket_timing=config == "probe_buckets",
            **{**PROBE_OPTIONS, **ABLATIONS.get(config, {})},
        )
        try:
            yield lambda: monitor.step(batch_size=spec.batch_size)
        finally:
            monitor.close()
            probe_counts[0] += monitor.steps
            probe_counts[1] += monitor.dropped_records_total
    elif config == "profiler":
        # What a user typically does first: wrap the whole loop, CPU activities,
        # default options, no schedule (every step is recorded). The trace is
        # processed at exit, outside the timed steps, as it would be for a user.
        with profile(activities=[ProfilerActivity.CPU]):
            yield contextlib.nullcontext
    else:
        raise ValueError(f"unknown config {config!r}; expected one of {CONFIGS}")


def _run_steps(
    step: StepFn, scope: ScopeFactory, warmup: int, measured: int
) -> tuple[list[float], float]:
    """Wall seconds of each measured step, and the process's CPU seconds per measured step.

    Every config is timed identically: around the whole per-step scope (the
    probe's ``mon.step()`` enter and exit included).
    """
    times = []
    cpu_start = 0.0
    for index in range(warmup + measured):
        if index == warmup:
            cpu_start = time.process_time()
        start = time.perf_counter()
        with scope() as step_scope:
            loss = step()
            if step_scope is not None:
                step_scope.loss = loss
        elapsed = time.perf_counter() - start
        if index >= warmup:
            times.append(elapsed)
    return times, (time.process_time() - cpu_start) / max(1, measured)


def _bucket_count(ddp: DistributedDataParallel) -> int:
    """Buckets per step after DDP rebuilt them (0 if DDP does not say)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    except Exception:
        return 0
    return len([s for s in sizes.split(",") if s.strip()])


# -- the agent's stand-in -------------------------------------------------------------
class StepCounter:
    """Counts the step records a receiver got (runs on the receiver's thread), and per
    job (a config's, ``overhead-<config>``) how many came urgent and how many carried a
    run-queue reading: what says an ablation took its part away."""

    def __init__(self) -> None:
        self.step_records = 0
        self.by_job: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def __call__(self, message: ProbeMessage) -> None:
        if isinstance(message, Batch):
            self.step_records += len(message.steps)
            counts = self.by_job[message.job]
            counts["records"] += len(message.steps)
            if message.urgent:
                counts["urgent"] += len(message.steps)
            counts["cpu_wait"] += sum(s.cpu_wait_s is not None for s in message.steps)

    def shares(self, job: str) -> dict[str, float]:
        """``job``'s step records received, the share sent urgent and the share with a
        run-queue reading (``cpu_wait_s``)."""
        counts = self.by_job.get(job)
        if not counts:
            return {}
        return {
            "records": counts["records"],
            "urgent_share": counts["urgent"] / counts["records"],
            "cpu_wait_share": counts["cpu_wait"] / counts["records"],
        }


# -- analysis -------------------------------------------------------------------------
def job_rounds(per_rank: Sequence[Rounds]) -> Rounds:
    """The job's view: per step the slowest rank's time (a DDP job steps at its
    slowest rank's pace), and the CPU time of all ranks together.

    Every rank ran the same schedule, so step i of round r is the same step everywhere.
    """
    configs = per_rank[0].step_s
    step_s = {
        config: [
            [max(s) for s in zip(*(r.step_s[config][i] for r in per_rank), strict=True)]
            for i in range(len(configs[config]))
        ]
        for config in configs
    }
    cpu = {
        config: [sum(c) for c in zip(*(r.cpu_s_per_step[config] for r in per_rank), strict=True)]
        for config in configs
    }
    return Rounds(step_s, cpu)


def typical_step_s(rounds: list[list[float]]) -> float:
    """The median of per-round medians, in seconds.

    A round's median ignores single hiccups (a GC pause, a rank preempted by the
    other's gloo thread on 2 cores); the median across rounds ignores whole rounds
    that ran while the machine was busier. The median of all steps would let a
    few noisy rounds dominate. Medians also hide costs paid on a few steps only
    (the probe's config broadcast every 10th step, DDP stats every 50th): the
    mean ratio and the CPU time are there for those.
    """
    return statistics.median(statistics.median(r) for r in rounds)


def paired_ratio(rounds: list[list[float]], bare: list[list[float]]) -> float:
    """Median over rounds of (this config's median step / bare's median step, same round).

    The headline ratio: configs of one round ran seconds apart, so load from
    other programs, which comes and goes over tens of seconds on a shared
    machine, mostly cancels; a ratio of overall medians does not pair them.
    """
    return statistics.median(round_ratios(rounds, bare))


def round_ratios(rounds: list[list[float]], bare: list[list[float]]) -> list[float]:
    """Per round, this config's median step over bare's (what ``paired_ratio`` takes the
    median of)."""
    return [statistics.median(r) / statistics.median(b) for r, b in zip(rounds, bare, strict=True)]


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A ``confidence`` interval of the median of ``ratios`` (percentile bootstrap over
    rounds, fixed seed: the same rounds give the same interval).

    What a full run can say about the probe's cost on this machine: a round's ratio
    spreads 5-10 % (IQR) on a loaded 2-core box, so the median of 20 rounds moves by a
    few percent between runs of the same code (two bare arms, 24 rounds, read
    0.970-1.024 in four runs). An interval that holds 1.01 has not shown the probe
    costs more than that; one entirely above it has."""
    if len(ratios) < 2 or min(ratios) == max(ratios):
        middle = statistics.median(ratios)
        return middle, middle
    options: dict[str, Any] = {"confidence_level": confidence, "method": "percentile"}
    # scipy 1.15 renamed the seed argument (random_state -> rng).
    seed_name = (
        "rng" if "rng" in inspect.signature(scipy_stats.bootstrap).parameters else "random_state"
    )
    options[seed_name] = np.random.default_rng(0)
    result = scipy_stats.bootstrap((np.asarray(ratios),), np.median, n_resamples=4000, **options)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def round_spread(rounds: list[list[float]]) -> float:
    """Interquartile range of the per-round medians over their median (a noise gauge)."""
    medians = [statistics.median(r) for r in rounds]
    if len(medians) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(medians, n=4)
    return (q3 - q1) / statistics.median(medians)


def mean_step_s(rounds: list[list[float]]) -> float:
    return statistics.fmean(t for r in rounds for t in r)


@dataclass(frozen=True, slots=True)
class ConfigStats:
    """One (model, config) cell of the result; ratios are to ``bare`` of the same model."""

    model: str
    config: str
    median_step_s: float
    round_iqr: float
    ratio: float  # paired_ratio: the headline
    ratio_low: float  # its 95 % interval (ratio_interval)
    ratio_high: float
    unpaired_ratio: float  # typical_step_s over bare's
    mean_ratio: float
    cpu_s_per_step: float  # all ranks together, median over rounds
    cpu_ratio: float  # paired, like ``ratio``
    steps: int


def config_stats(model: str, job: Rounds) -> list[ConfigStats]:
    bare, bare_cpu = job.step_s["bare"], job.cpu_s_per_step["bare"]
    interval = {
        config: ratio_interval(round_ratios(rounds, bare)) for config, rounds in job.step_s.items()
    }
    return [
        ConfigStats(
            model=model,
            config=config,
            median_step_s=typical_step_s(rounds),
            round_iqr=round_spread(rounds),
            ratio=paired_ratio(rounds, bare),
            ratio_low=interval[config][0],
            ratio_high=interval[config][1],
            unpaired_ratio=typical_step_s(rounds) / typical_step_s(bare),
            mean_ratio=mean_step_s(rounds) / mean_step_s(bare),
            cpu_s_per_step=statistics.median(job.cpu_s_per_step[config]),
            cpu_ratio=statistics.median(
                c / b for c, b in zip(job.cpu_s_per_step[config], bare_cpu, strict=True)
            ),
            steps=sum(len(r) for r in rounds),
        )
        for config, rounds in job.step_s.items()
    ]


# The table's columns: header and how each cell is written.
COLUMNS: tuple[tuple[str, Callable[[ConfigStats], str]], ...] = (
    ("model", lambda s: s.model),
    ("config", lambda s: s.config),
    ("median ms", lambda s: f"{s.median_step_s * 1e3:.3f}"),
    ("round IQR", lambda s: f"{s.round_iqr:.1%}"),
    ("ratio", lambda s: f"{s.ratio:.4f}"),
    ("95% interval", lambda s: f"{s.ratio_low:.3f}-{s.ratio_high:.3f}"),
    ("unpaired", lambda s: f"{s.unpaired_ratio:.4f}"),
    ("mean ratio", lambda s: f"{s.mean_ratio:.4f}"),
    ("cpu ms/step", lambda s: f"{s.cpu_s_per_step * 1e3:.3f}"),
    ("cpu ratio", lambda s: f"{s.cpu_ratio:.4f}"),
    ("steps", lambda s: str(s.steps)),
)


def format_table(stats: Sequence[ConfigStats]) -> str:
    return _table.format_table(COLUMNS, stats)


def summary_json(stats: Sequence[ConfigStats]) -> dict[str, Any]:
    """``<config>_ratio_<model>`` (the paired headline), its cross-checks, and per
    (model, config) the median step, the CPU time per step and the step count."""
    out: dict[str, Any] = {}
    for s in stats:
        out[f"median_step_s_{s.model}_{s.config}"] = s.median_step_s
        out[f"cpu_s_per_step_{s.model}_{s.config}"] = s.cpu_s_per_step
        out[f"steps_{s.model}_{s.config}"] = s.steps
        if s.config != "bare":
            out[f"{s.config}_ratio_{s.model}"] = s.ratio
            out[f"{s.config}_ratio_interval_{s.model}"] = [s.ratio_low, s.ratio_high]
            out[f"{s.config}_unpaired_ratio_{s.model}"] = s.unpaired_ratio
            out[f"{s.config}_mean_ratio_{s.model}"] = s.mean_ratio
            out[f"{s.config}_cpu_ratio_{s.model}"] = s.cpu_ratio
    return out


#: The probe's target: at most this times bare's step time, on both models.
TARGET_RATIO = 1.01


def target_verdict(cell: ConfigStats, target: float = TARGET_RATIO) -> str:
    """``met`` if the whole interval is at or below ``target``, ``not met`` if it is all
    above, else ``not resolved`` (this run cannot tell)."""
    if cell.ratio_high <= target:
        return "met"
    if cell.ratio_low > target:
        return "not met"
    return "not resolved"


# -- the command line -----------------------------------------------------------------
def build_plan(args: argparse.Namespace, agent_socket: str) -> Plan:
    models = QUICK_PLAN if args.quick else FULL_PLAN
    if args.rounds is not None:
        models = tuple(
            ModelPlan(m.model, args.rounds, m.warmup_steps, m.measured_steps) for m in models
        )
    chosen = tuple(m for m in models if m.model in args.models)
    configs = CONFIGS + tuple(ABLATIONS) if args.ablate else CONFIGS
    return Plan(chosen, agent_socket, args.flush_interval_s, args.seed, args.pin, configs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 1 min)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per model (override)")
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=list(MODELS), help="models to run"
    )
    parser.add_argument(
        "--flush-interval-s", type=float, default=0.5, help="the probe's flush interval"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ablate",
        action="store_true",
        help=f"also run the probe less some of its parts ({', '.join(ABLATIONS)})",
    )
    parser.add_argument(
        "--pin",
        choices=PIN_MODES,
        default="rank",
        help="what to pin to core <rank>: the rank's threads (default), its training "
        "thread only while it trains, or nothing",
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_const", const="none", help="--pin none"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=WORLD_SIZE,
        help=f"ranks ({WORLD_SIZE})",
    )
    parser.add_argument("--timeout-s", type=float, default=1500.0, help="limit for the whole job")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-") as tmp:
        socket_path = str(Path(tmp) / "agent.sock")
        plan = build_plan(args, socket_path)
        receiver = StepCounter()
        with ThreadedReceiver(socket_path, on_message=receiver):
            results: list[RankResult] = run_ranks(
                rank_main, args.world_size, plan, timeout_s=args.timeout_s
            )
    stats = [
        cell
        for m in plan.models
        for cell in config_stats(m.model, job_rounds([r.rounds[m.model] for r in results]))
    ]
    buckets = results[0].buckets
    probe_steps = sum(r.probe_steps for r in results)
    scope_s = max(r.probe_scope_s for r in results)
    summary = summary_json(stats)
    for cell in stats:
        if cell.config == "bare":
            summary[f"probe_intrinsic_fraction_{cell.model}"] = scope_s / cell.median_step_s
    summary.update(
        {f"buckets_{m.model}": buckets[m.model] for m in plan.models},
        **{f"rounds_{m.model}": m.rounds for m in plan.models},
        quick=bool(args.quick),
        world_size=args.world_size,
        cpus=os.cpu_count(),
        probe_steps=probe_steps,
        probe_dropped_records=sum(r.probe_dropped for r in results),
        agent_step_records=receiver.step_records,
        wall_s=round(time.perf_counter() - started, 1),
        probe_scope_s_per_step=scope_s,
        pin=plan.pin,
    )
    for config in plan.configs:
        for name, share in receiver.shares(f"overhead-{config}").items():
            summary[f"{name}_{config}"] = share
    print(format_table(stats))
    for cell in stats:
        if cell.config == "probe":
            summary[f"probe_target_{cell.model}"] = verdict = target_verdict(cell)
            print(
                f"probe <= {TARGET_RATIO} on {cell.model}: {verdict} (ratio {cell.ratio:.3f}, "
                f"95% interval {cell.ratio_low:.3f}-{cell.ratio_high:.3f})"
            )
    print(
        f"probe's own cost per step, measured directly: {scope_s * 1e6:.1f} us ("
        + ", ".join(
            f"{m.model}: {100 * summary[f'probe_intrinsic_fraction_{m.model}']:.2f}% of bare step"
            for m in plan.models
        )
        + ")"
    )
    shares = [(c, receiver.shares(f"overhead-{c}")) for c in plan.configs]
    print(
        "step records sent urgent / with a run-queue reading: "
        + ", ".join(
            f"{c} {s['urgent_share']:.2f} / {s['cpu_wait_share']:.2f}" for c, s in shares if s
        )
    )
    print(
        "buckets/step: "
        + ", ".join(f"{m.model}={buckets[m.model]}" for m in plan.models)
        + f"; probe step records received by the agent: {receiver.step_records}/{probe_steps}"
    )
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
