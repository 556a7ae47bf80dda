"""Detection benchmark: how small a fault torshmon finds, how fast, naming the right rank,
for how long, and whether it stays quiet when nothing is wrong.

Each job is ``torshmon demo``'s whole system (aggregator with the default rules, agent, a
real multi-process gloo DDP job; ``demo.run_system``) with faults injected for real
(``torshmon.faults``) and a local HTTP receiver standing in for Slack. A job carries
several **episodes**, one fault at one magnitude each, in an order and on ranks drawn
from the seed, with at least ``GAP_STEPS`` healthy steps between them (a job's start-up
costs more than its steps on two shared cores). The sweep:

- straggler: the report run (default, ``REPORT``) 1.15/1.2/1.25/1.35/1.6/2.5x compute
  at 2, 3, 4, 6 and 8 ranks, ``--dev`` (``DEV``) 1.1/1.2/1.3/1.5/2/3x at 2 and 4; steady
  (``FAULT_STEPS``, 100 steps) and intermittent (9 periods of 10 slow steps, 10 normal
  between), one job per world size;
- a job-wide regression 1.3/2x of the in-step time, each in a job of its own (2 ranks:
  Step Time Anomaly's cooldown would let one anomaly hide the next);
- hang of 1/3/6/10 s (2 ranks); memory leak of 0.5/2/4/8 MB a step at ~0.1 s a step;
- loss jumps x2/x10 (targets scaled by sqrt(2)/sqrt(10)) and NaN inputs, each in a job
  of its own (2 ranks: Loss Spike's cooldown would let one jump hide the next);
- link cut from 1 Gbit/s to 1/2, 1/5, 1/10 (3 ranks; needs root and ``tc``).

Every job computes inside its steps (``DemoConfig.step_compute_s``: a sleep where a GPU
kernel would run, 20-100 ms a step for the fault jobs) and waits ``INPUT_WAIT_S`` between
them, as for a data loader.

Then the fault-free jobs, where every alert is false: clean jobs at 4 and 8 ranks
(``CLEAN_RANK_STEPS`` rank-steps each) run as the straggler jobs run (their model, 20 ms
of compute a step) with realistic noise in the ranks (``NoisyClock``) and a background
process burning CPU in bursts; and a fault-free autotune session whose job runs on
``TUNING_SETTLE_STEPS`` steps after it ends.

Scoring (``benchmarks/_scoring.py``): an alert is right only for the episode acting on
the rank it names (onset less one step period .. end plus a short grace of its kind);
any other alert naming a rank is false; latency is never clamped and reported per
kind; the magnitude scored is the one the job's ``steps`` table measured: the slow
rank's compute over its peers' in the same steps, a regression's step time over the
steps before it. **In scope** are the magnitudes the targets promise (issue 19):
stragglers measured >= 1.2x at >= 3 ranks and >= 1.3x at 2, both regressions, hangs
longer than the 5 s hang timeout (6, 10 s), leaks measured at >= 15 MB/s (the rule's
bar is 10 MB/s), loss x10 and NaN, link cuts to 1/5 and 1/10. ``recall``,
``attribution`` and latencies are over in-scope episodes; ``recall_all`` over all;
curves show every magnitude.

Prints a curve per kind, a summary, then one JSON object (the last line).

Usage::

    python benchmarks/detection.py                       # the report seeds, whole sweep
    python benchmarks/detection.py --quick --dev         # one dev seed, a few magnitudes
    python benchmarks/detection.py --dev --kinds straggler --no-clean --dump /tmp/d
    python benchmarks/detection.py --rescore /tmp/d      # score the dumps again
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._scoring import (
    GRACE,
    ONSET_SLACK_STEPS,
    SYMPTOM_GRACE_S,
    Episode,
    EpisodeScore,
    FiredAlert,
    RunScore,
    measured_ratio,
    median,
    min_magnitude_detected,
    score_run,
    straggler_in_scope,
    summarize,
)
from benchmarks._table import format_table
from torshmon.faults import KINDS, parse_fault

#: Steps a steady straggler or a regression lasts (an on/off straggler: FAULT_STEPS/10 - 1
#: periods of 10 slow steps, 10 normal between; ``--fault-steps``). Coverage counts
#: from the onset, so the steps any detector needs before it names a rank cost a short
#: fault most of its share: 5 steps are 17 % of 30 steps, 8 % of 60. Issue 19's targets
#: pair "named within 10 steps" with "90 % of the slow steps covered", which only a
#: fault of 100 steps or more can meet at that latency; real stragglers (a throttled
#: GPU, a noisy neighbour) last minutes. Figures before 2026-11-29 used 60.
FAULT_STEPS = 100
#: Healthy steps between two episodes of a job (plus up to 10 drawn from the seed).
GAP_STEPS = 50
#: Healthy steps before the first episode: the detectors' baselines, the faults' own
#: normal step time (``FaultRunner`` takes the first 50).
WARMUP_STEPS = 60
STRAGGLER_RATIOS = (1.1, 1.2, 1.3, 1.5, 2.0, 3.0)


@dataclass(frozen=True, slots=True)
class Sweep:
    """A set of seeds and the straggler magnitudes and world sizes run with them."""

    name: str
    seeds: tuple[int, ...]
    straggler_ratios: tuple[float, ...]
    straggler_world_sizes: tuple[int, ...]
    #: ``--quick``: the first seed, these ratios, these world sizes
    quick_ratios: tuple[float, ...]
    quick_world_sizes: tuple[int, ...]


#: The seeds, magnitudes and world sizes the detectors were developed on (``--dev``);
#: every seed of this benchmark used before 2026-12-06 is a development seed
#: (docs/faults.md, "Seeds").
DEV = Sweep("dev", (100, 26), STRAGGLER_RATIOS, (2, 4), (1.3, 2.0), (2, 4))
#: The seeds the figures are reported on (the default run): drawn on 2026-12-07 at
#: 05:09 UTC, after the run-queue clocks went off by default (3d2e63a: the detectors'
#: input changed), never used to change a detector; with magnitudes (1.15, 1.25, 1.35,
#: 1.6, 2.5) and world sizes (3, 6, 8) no development run used. The earlier report seeds
#: are retired: one set was drawn before detector changes, the next led to one, the
#: third describes the probe with its clocks on (docs/faults.md, "Seeds").
REPORT = Sweep(
    "report",
    (43135, 87593, 99466),
    (1.15, 1.2, 1.25, 1.35, 1.6, 2.5),
    (2, 3, 4, 6, 8),
    (1.35, 2.5),
    (3, 4),
)
#: The clean jobs' world sizes and compute a step (the straggler jobs'), and the steps
#: a fault-free tuning session's job may run (it stops ``TUNING_SETTLE_STEPS`` after
#: the session ends).
CLEAN_WORLD_SIZES = (4, 8)
CLEAN_COMPUTE_S = 0.02
CLEAN_RANK_STEPS = 10_000
TUNING_MAX_STEPS = 4000
TUNING_SETTLE_STEPS = 600
REGRESSION_RATIOS = (1.3, 2.0)
HANG_SECONDS = (1.0, 3.0, 6.0, 10.0)
LEAK_MB_PER_STEP = (0.5, 2.0, 4.0, 8.0)
LOSS_JUMPS = (2.0, 10.0, math.inf)  # inf: NaN inputs
LINK_CUTS = (2, 5, 10)  # 1 Gbit/s divided by
BASE_LINK = "1gbit"
#: Where each fault job's steps and episodes are written (``--dump``), for replaying
#: them through the detectors offline; None: nowhere.
DUMP_DIR: Path | None = None
#: The dumped ``steps`` columns (``--dump``).
COLUMNS: Final = [
    "rank",
    "step",
    "duration_s",
    "compute_s",
    "cpu_wait_s",
    "process_cpu_wait_s",
    "end_unix_ns",
]
#: A leak below this measured rate is out of scope (the rule fires above 10 MB/s).
LEAK_SCOPE_BYTES_PER_S = 15e6


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    """One episode: its fault specs (several for an on/off straggler) and where it starts."""

    kind: str
    label: str
    magnitude: float
    specs: tuple[str, ...]
    rank: int | None
    onset_step: int
    end_step: int
    in_scope: bool


#: Between two steps each rank waits this long, as for its data loader (and leaves the
#: CPU to the daemons on a small machine).
INPUT_WAIT_S = 0.002


@dataclass(frozen=True, slots=True)
class JobPlan:
    name: str
    world_size: int
    #: time a step spends computing beyond the small model's own (a sleep inside the
    #: step, as a GPU kernel would take): the compute a straggler multiplies
    step_compute_s: float
    episodes: tuple[EpisodePlan, ...]
    link_rate: str | None = None

    @property
    def steps(self) -> int:
        return max(e.end_step for e in self.episodes) + GAP_STEPS // 2


@dataclass(slots=True)
class JobOutcome:
    plan: JobPlan
    seed: int
    score: RunScore
    measured: dict[int, float | None] = field(default_factory=dict)  # episode index ->
    slack_latency_s: dict[int, float | None] = field(default_factory=dict)
    wall_s: float = 0.0
    urgent_share: float | None = None  # FiringWatch.urgent_share
    bars: list[float] = field(default_factory=list)  # FiringWatch.bars


# -- plans -----------------------------------------------------------------------------


class _Timeline:
    """Places episodes one after another with healthy gaps drawn from the seed."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_step = WARMUP_STEPS + rng.randint(0, 10)

    def take(self, length: int) -> tuple[int, int]:
        start = self.next_step
        self.next_step = start + length + GAP_STEPS + self.rng.randint(0, 10)
        return start, start + length


def timing_job(world_size: int, seed: int, quick: bool, sweep: Sweep = DEV) -> JobPlan:
    """Stragglers (steady and on/off), shuffled, in one job."""
    rng = random.Random(f"timing-{world_size}-{seed}")
    ratios = sweep.quick_ratios if quick else sweep.straggler_ratios
    items = [(mode, r) for r in ratios for mode in ("steady", "on/off")]
    rng.shuffle(items)
    timeline = _Timeline(rng)
    episodes = []
    for mode, ratio in items:
        slow = ratio - 1
        rank = rng.randrange(world_size)
        if mode == "steady":
            start, end = timeline.take(FAULT_STEPS)
            specs: tuple[str, ...] = (
                f"straggler:rank={rank},slowdown={slow:g},from={start},to={end}",
            )
        else:
            start, end = timeline.take(2 * FAULT_STEPS - 30)
            specs = tuple(
                f"straggler:rank={rank},slowdown={slow:g},from={s},to={s + 10}"
                for s in range(start, end, 20)
            )
        label = f"straggler {mode} {world_size} ranks"
        episodes.append(
            EpisodePlan(
                "straggler",
                label,
                ratio,
                specs,
                rank,
                start,
                end,
                straggler_in_scope(ratio, world_size),
            )
        )
    return JobPlan(f"timing-{world_size}", world_size, 0.02, tuple(episodes))


def regression_job(ratio: float, seed: int) -> JobPlan:
    """One job-wide regression in a job of its own (2 ranks): Step Time Anomaly has a
    5-minute cooldown, so in a job of several episodes an earlier anomaly (a straggler
    slows every rank's step, a symptom excused in its window) hid the regressions."""
    rng = random.Random(f"regression-{ratio:g}-{seed}")
    start, end = _Timeline(rng).take(FAULT_STEPS)
    spec = f"regression:slowdown={ratio - 1:g},from={start},to={end}"
    episode = EpisodePlan("regression", "regression", ratio, (spec,), None, start, end, True)
    return JobPlan(f"regression-{ratio:g}x", 2, 0.02, (episode,))


def hang_job(seed: int, quick: bool) -> JobPlan:
    rng = random.Random(f"hang-{seed}")
    seconds = list((3.0, 10.0) if quick else HANG_SECONDS)
    rng.shuffle(seconds)
    timeline = _Timeline(rng)
    episodes = []
    for duration in seconds:
        rank = rng.randrange(2)
        start, end = timeline.take(1)
        spec = f"hang:rank={rank},from={start},seconds={duration:g}"
        episodes.append(
            EpisodePlan("hang", "hang", duration, (spec,), rank, start, end, duration > 5)
        )
    return JobPlan("hang", 2, 0.05, tuple(episodes))


def leak_job(seed: int, quick: bool) -> JobPlan:
    rng = random.Random(f"leak-{seed}")
    amounts = list((0.5, 4.0) if quick else LEAK_MB_PER_STEP)
    rng.shuffle(amounts)
    timeline = _Timeline(rng)
    episodes = []
    for mb in amounts:
        rank = rng.randrange(2)
        start, end = timeline.take(120)
        spec = f"memory-leak:rank={rank},from={start},to={end},mb={mb:g}"
        # in scope by the rate measured (see run_job)
        episodes.append(
            EpisodePlan("memory-leak", "memory leak", mb, (spec,), rank, start, end, True)
        )
    return JobPlan("memory-leak", 2, 0.1, tuple(episodes))


def loss_job(jump: float, seed: int) -> JobPlan:
    """One loss jump in a job of its own (2 ranks): Loss Spike has a 5-minute cooldown
    per rank, so a x2 jump that fired on a rank hid a x10 jump on it 60 steps later."""
    rng = random.Random(f"loss-{jump:g}-{seed}")
    rank = rng.randrange(2)
    start, end = _Timeline(rng).take(5)
    what = "nan=1" if math.isinf(jump) else f"factor={math.sqrt(jump):.4g}"
    spec = f"loss-spike:rank={rank},from={start},to={end},{what}"
    episode = EpisodePlan("loss-spike", "loss jump", jump, (spec,), rank, start, end, jump >= 10)
    return JobPlan(f"loss-spike-{jump:g}x", 2, 0.05, (episode,))


def link_job(seed: int, quick: bool) -> JobPlan:
    rng = random.Random(f"link-{seed}")
    cuts = list((10,) if quick else LINK_CUTS)
    rng.shuffle(cuts)
    timeline = _Timeline(rng)
    episodes = []
    for cut in cuts:
        rank = rng.randrange(3)
        start, end = timeline.take(60)
        rate = f"{1000 // cut}mbit"
        spec = f"slow-link:rank={rank},rate={rate},from={start},to={end}"
        episodes.append(
            EpisodePlan("slow-link", "link cut to 1/N", cut, (spec,), rank, start, end, cut >= 5)
        )
    return JobPlan("slow-link", 3, 0.05, tuple(episodes), link_rate=BASE_LINK)


#: The fault kinds this benchmark sweeps (``torshmon.faults.KINDS`` less slow-input,
#: which has no sweep here yet).
SWEPT_KINDS: Final = tuple(k for k in KINDS if k != "slow-input")


def plan_jobs(kinds: Sequence[str], seed: int, quick: bool, sweep: Sweep = DEV) -> list[JobPlan]:
    jobs: list[JobPlan] = []
    if "straggler" in kinds:
        worlds = sweep.quick_world_sizes if quick else sweep.straggler_world_sizes
        jobs += [timing_job(w, seed, quick, sweep) for w in worlds]
    if "regression" in kinds:
        jobs += [regression_job(ratio, seed) for ratio in REGRESSION_RATIOS]
    if "loss-spike" in kinds:
        jobs += [loss_job(jump, seed) for jump in LOSS_JUMPS]
    builders = {"hang": hang_job, "memory-leak": leak_job, "slow-link": link_job}
    jobs += [build(seed, quick) for kind, build in builders.items() if kind in kinds]
    return jobs


# -- running ---------------------------------------------------------------------------


class SlackReceiver:
    """A local Slack incoming webhook: keeps (arrival time, fallback text) of each post."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, str]] = []
        self.url = ""
        self._runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        async def post(request: web.Request) -> web.Response:
            body = await request.json()
            self.messages.append((time.time(), str(body.get("text", ""))))
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/services/T0/B0/bench", post)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/services/T0/B0/bench"

    async def stop(self) -> None:
        await self._runner.cleanup()


class FiringWatch:
    """``run_system``'s tick hook: for each alert that starts firing, the time and the
    job's last step the aggregator had seen; and how many of the job's steps came
    through the probes' fast lane (``urgent_share``)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.steps = 0
        self.urgent_steps = 0
        # (rule, rank, starts_at): an alert that resolves and fires again for the same
        # rank within one evaluation is a new one, though its rule and rank never left.
        self.firing: set[tuple[str, str | None, float | None]] = set()
        self.started: list[tuple[str, str | None, float, int]] = []
        #: The straggler detector's bar (a slow step's least ratio to its peers' median,
        #: ``StragglerDetector.bar_ratio``) at each tick once it had one.
        self.bars: list[float] = []
        self.last_step = -1

    def __call__(self, aggregator: Any, shaper: Any) -> None:
        summary = aggregator.live.job_summary(self.job)
        last = summary["last_step"] if summary else -1
        self.last_step = last
        try:  # the straggler detector of the job's latest run, once it has one
            detector = aggregator.live.run(self.job).straggler
        except KeyError:
            detector = None
        bar = detector.bar_ratio(self.job) if detector is not None else None
        if bar is not None:
            self.bars.append(float(bar))
        now = {
            (a.rule, a.labels.get("rank"), a.starts_at_unix_s)
            for a in aggregator.alerts.active()
            if a.state == "firing"
        }
        for rule, rank, _ in now - self.firing:
            self.started.append((rule, rank, time.time(), last))
        self.firing = now
        ranks = aggregator.live.rank_summaries(self.job).values()
        self.steps = sum(r["steps_total"] for r in ranks)
        self.urgent_steps = sum(r["urgent_steps_total"] for r in ranks)

    @property
    def urgent_share(self) -> float | None:
        """The share of the job's steps its probes sent at once (the fast lane open)."""
        return self.urgent_steps / self.steps if self.steps else None

    def first_step(self, rule: str, rank: int | None, fired_at_unix_s: float) -> int | None:
        label = None if rank is None else str(rank)
        seen = [
            (t, step)
            for r, k, t, step in self.started
            if r == rule and k == label and t >= fired_at_unix_s - 0.05
        ]
        return min(seen)[1] if seen else None


class CpuBurner:
    """A subprocess that burns one core in bursts: on 0.2-2 s, off 0.2-2 s (seeded). It
    is bounded: it stops after ``max_s`` or as soon as the benchmark that started it is
    gone, whatever becomes of the benchmark."""

    _CODE = (
        "import os, random, sys, time\n"
        "rng = random.Random(int(sys.argv[1]))\n"
        "deadline = time.monotonic() + float(sys.argv[2])\n"
        "parent = os.getppid()\n"
        "while time.monotonic() < deadline and os.getppid() == parent:\n"
        "    end = time.monotonic() + rng.uniform(0.2, 2.0)\n"
        "    while time.monotonic() < end:\n"
        "        pass\n"
        "    time.sleep(rng.uniform(0.2, 2.0))\n"
    )

    def __init__(self, seed: int, max_s: float = 3600.0) -> None:
        self.seed = seed
        self.max_s = max_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CpuBurner:
        self._process = subprocess.Popen(
            [sys.executable, "-c", self._CODE, str(self.seed), str(self.max_s)]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)


#: The environment variable that hands a clean job's ranks their noise (JSON).
NOISE_ENV: Final = "TORSHMON_BENCH_NOISE"
#: The clean jobs' noise, drawn per rank and step from the seed (``NoisyClock``):
#: lognormal jitter of each step's compute;
CLEAN_JITTER_SIGMA = 0.04
#: a pause (garbage collection, preemption: the rank stops for a few step times inside
#: one step) in 1 of this many steps, of 2-6 step times;
CLEAN_PAUSE_EVERY = 500
CLEAN_PAUSE_STEPS = (2.0, 6.0)
#: a spell of 2-8 slow steps at 1.2-1.5x (another process's burst on the rank's core)
#: in 1 of this many steps;
CLEAN_SPELL_EVERY = 400
CLEAN_SPELL_STEPS = (2, 8)
CLEAN_SPELL_FACTOR = (1.2, 1.5)
#: a data-loader hiccup before a step (1-5 step times of input wait) in 1 of this many;
CLEAN_HICCUP_EVERY = 200
CLEAN_HICCUP_STEPS = (1.0, 5.0)
#: and every 300-600 steps an evaluation pass of 10-30 step times between two steps,
#: on every rank at the same step (the same draws: the job's, not the rank's).
CLEAN_EVAL_GAP = (300, 600)
CLEAN_EVAL_STEPS = (10.0, 30.0)


class NoisyClock:
    """Stands in for ``torshmon.demo``'s ``time`` module inside a clean job's rank: the
    demo's loop sleeps ``step_compute_s`` inside each step (its compute) and
    ``step_sleep_s`` between steps (its input wait); this adds the clean jobs' noise to
    those two sleeps and passes everything else to ``time``. ``counts`` says how much
    noise it added (the rank returns it), so a run whose noise never applied shows."""

    def __init__(self, compute_s: float, between_s: float, seed: int, rank: int) -> None:
        if compute_s <= 0 or between_s <= 0 or compute_s == between_s:
            raise ValueError("NoisyClock needs two distinct positive sleeps")
        self.compute_s = compute_s
        self.between_s = between_s
        self._rng = random.Random(f"noise-{seed}-{rank}")
        self._job_rng = random.Random(f"eval-{seed}")
        self.step = 0
        self._spell_left = 0
        self._spell_factor = 1.0
        self._next_eval = self._job_rng.randint(*CLEAN_EVAL_GAP)
        self.counts: dict[str, float] = {"steps": 0, "pauses": 0, "spells": 0}
        self.counts.update(hiccups=0, evals=0, noise_s=0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds == self.compute_s:
            seconds = self._compute()
        elif seconds == self.between_s:
            seconds = self._between()
        time.sleep(seconds)

    def _compute(self) -> float:
        self.step += 1
        self.counts["steps"] += 1
        rng = self._rng
        seconds = self.compute_s * math.exp(rng.gauss(0.0, CLEAN_JITTER_SIGMA))
        if self._spell_left == 0 and rng.random() < 1 / CLEAN_SPELL_EVERY:
            self._spell_left = rng.randint(*CLEAN_SPELL_STEPS)
            self._spell_factor = rng.uniform(*CLEAN_SPELL_FACTOR)
            self.counts["spells"] += 1
        if self._spell_left:
            self._spell_left -= 1
            seconds *= self._spell_factor
        if rng.random() < 1 / CLEAN_PAUSE_EVERY:
            seconds += self.compute_s * rng.uniform(*CLEAN_PAUSE_STEPS)
            self.counts["pauses"] += 1
        self.counts["noise_s"] += seconds - self.compute_s
        return seconds

    def _between(self) -> float:
        seconds = self.between_s
        period = self.compute_s + self.between_s
        if self._rng.random() < 1 / CLEAN_HICCUP_EVERY:
            seconds += period * self._rng.uniform(*CLEAN_HICCUP_STEPS)
            self.counts["hiccups"] += 1
        if self.step >= self._next_eval:
            seconds += period * self._job_rng.uniform(*CLEAN_EVAL_STEPS)
            self._next_eval = self.step + self._job_rng.randint(*CLEAN_EVAL_GAP)
            self.counts["evals"] += 1
        self.counts["noise_s"] += seconds - self.between_s
        return seconds


def noisy_train_rank(rank: int, world_size: int, config: Any, socket_path: str) -> dict[str, float]:
    """``torshmon.demo.train_rank`` with the clean jobs' noise (``NoisyClock``, its seed
    in ``$TORSHMON_BENCH_NOISE``) and, where that says so, another stop file (a tuning
    session's job then runs on after the session ends). Runs in the rank's process."""
    from torshmon import demo

    spec = json.loads(os.environ[NOISE_ENV])
    clock = NoisyClock(config.step_compute_s, config.step_sleep_s, int(spec["seed"]), rank)
    setattr(demo, "time", clock)  # noqa: B010  (the demo's loop is this process's only user)
    if spec.get("stop_file"):
        config = replace(config, stop_file=spec["stop_file"])
    result = demo.train_rank(rank, world_size, config, socket_path)
    return {**result, **{f"noise_{k}": float(v) for k, v in clock.counts.items()}}


async def run_system_once(
    world_size: int,
    steps: int,
    step_compute_s: float,
    specs: Sequence[str] = (),
    *,
    link_rate: str | None = None,
    autotune: bool = False,
    hidden: int = 512,
    noise: dict[str, Any] | None = None,
    watch: FiringWatch | None = None,
    stop_file: str | None = None,
) -> tuple[Any, FiringWatch, SlackReceiver, list[tuple[Any, ...]]]:
    """One job through the whole system; the run, its watch, the Slack posts and the
    job's ``steps`` rows (rank, step, duration_s, compute_s, cpu_wait_s). With
    ``noise`` (``noisy_train_rank``'s spec) the ranks add the clean jobs' noise."""
    from unittest import mock

    from torshmon import demo
    from torshmon.aggregator.notify.targets import SlackTarget
    from torshmon.demo import DemoConfig, run_system
    from torshmon.history.query import run_query

    receiver = SlackReceiver()
    await receiver.start()
    watch = watch if watch is not None else FiringWatch("bench")
    env = {NOISE_ENV: json.dumps(noise)} if noise is not None else {}
    target = noisy_train_rank if noise is not None else demo.train_rank
    try:
        with tempfile.TemporaryDirectory(prefix="torshmon-detect-") as tmp:
            config = DemoConfig(
                world_size=world_size,
                steps=steps,
                hidden=hidden,
                layers=3,
                job="bench",
                db=Path(tmp) / "history.db",
                step_compute_s=step_compute_s,
                step_sleep_s=INPUT_WAIT_S,
                faults=tuple(parse_fault(s) for s in specs),
                link_rate=link_rate,
                linger_s=3.0,
                quiet=True,
                autotune=autotune,
                tune_max_trials=3 if autotune else None,
                env=env,
                stop_file=stop_file,
            )
            # The watch only adds the aggregator's view to --dump (``alert_rows``);
            # latencies are read on the job's own clock (``JobClock``).
            with mock.patch.object(demo, "train_rank", target):
                result = await run_system(
                    config, targets=[SlackTarget(receiver.url)], on_tick=watch, tick_s=0.05
                )
            rows = run_query(
                config.db_url,
                f"SELECT {', '.join(COLUMNS)} FROM steps WHERE job = 'bench'",
                max_rows=1_000_000,
            ).rows
    finally:
        await receiver.stop()
    return result, watch, receiver, [tuple(r) for r in rows]


def fired_alerts(
    result: Any, watch: FiringWatch, rows: Sequence[tuple[Any, ...]]
) -> list[FiredAlert]:
    """The job's alerts, each with the last step the job had finished when it fired."""
    job_step = JobClock(rows)
    return [
        FiredAlert(
            a["rule"],
            a["rank"],
            a["fired_at_unix_s"],
            a["ends_at_unix_s"],
            job_step.at(a["fired_at_unix_s"]),
        )
        for a in result.alerts
        if a["fired_at_unix_s"] is not None
    ]


def alert_rows(
    alerts: Sequence[FiredAlert], watch: FiringWatch
) -> list[tuple[str, int | None, float, int | None, int | None, float | None]]:
    """The dump's alerts: rule, rank, fired at, the job's step then, the last step the
    aggregator had seen when the benchmark's 50 ms watch first saw it firing, and when
    it resolved (None: firing at the end), so a dump can be scored again offline."""
    return [
        (
            a.rule,
            a.rank,
            a.fired_at_unix_s,
            a.first_step,
            watch.first_step(a.rule, a.rank, a.fired_at_unix_s),
            a.ends_at_unix_s,
        )
        for a in alerts
    ]


class JobClock:
    """The last step any rank of the job had finished at a given time (``steps`` rows)."""

    def __init__(self, rows: Sequence[tuple[Any, ...]]) -> None:
        step_i, end_i = COLUMNS.index("step"), COLUMNS.index("end_unix_ns")
        ends = sorted((r[end_i], r[step_i]) for r in rows if r[end_i] is not None)
        self._ends = [end for end, _ in ends]
        self._last: list[int] = list(itertools.accumulate((s for _, s in ends), max))

    def at(self, t_unix_s: float) -> int | None:
        i = bisect.bisect_right(self._ends, int(t_unix_s * 1e9))
        return self._last[i - 1] if i else None


async def run_job(plan: JobPlan, seed: int) -> JobOutcome:
    specs = [s for e in plan.episodes for s in e.specs]
    result, watch, receiver, rows = await run_system_once(
        plan.world_size, plan.steps, plan.step_compute_s, specs, link_rate=plan.link_rate
    )
    events: dict[str, float] = dict(result.fault_events)
    for per_rank in result.results:
        for key, value in per_rank.items():
            if key.startswith("fault"):
                events.setdefault(key, value)
    run_end = time.time()
    episodes = build_episodes(plan.episodes, events, run_end, rows, plan.world_size)
    measured = {i: ep.measured for i, ep in enumerate(episodes)}
    alerts = fired_alerts(result, watch, rows)
    score = score_run(episodes, alerts, run_end_unix_s=run_end)
    if DUMP_DIR is not None:
        dump = {
            "plan": [
                {
                    "kind": e.kind,
                    "label": e.label,
                    "magnitude": _json_float(e.magnitude),
                    "rank": e.rank,
                    "onset_step": e.onset_step,
                    "end_step": e.end_step,
                    "specs": list(e.specs),
                    "in_scope": e.in_scope,
                }
                for e in plan.episodes
            ],
            "world_size": plan.world_size,
            "alerts": alert_rows(alerts, watch),
            "fault_events": events,
            "run_end_unix_s": run_end,
            "columns": COLUMNS,
            "rows": rows,
        }
        DUMP_DIR.mkdir(parents=True, exist_ok=True)
        (DUMP_DIR / f"{plan.name}-{seed}.json").write_text(json.dumps(dump))
    outcome = JobOutcome(
        plan,
        seed,
        score,
        measured,
        wall_s=result.wall_s,
        urgent_share=watch.urgent_share,
        bars=watch.bars,
    )
    for i, ep_score in enumerate(score.episodes):
        first = ep_score.first
        posts = (
            [t for t, text in receiver.messages if first.rule in text and "FIRING" in text.upper()]
            if first is not None
            else []
        )
        later = [t for t in posts if t >= first.fired_at_unix_s - 0.05] if first else []
        outcome.slack_latency_s[i] = min(later) - ep_score.episode.start_unix_s if later else None
    return outcome


def build_episodes(
    plans: Sequence[EpisodePlan],
    events: dict[str, float],
    run_end: float,
    rows: Sequence[Sequence[Any]],
    world_size: int,
) -> list[Episode]:
    """The scored episodes of a job: each plan's on periods from the ranks' fault events
    (``fault{i}_onset_unix_s``, ``fault{i}_end_unix_s``, i counting the job's specs),
    the job's step period, and the fault as its ``steps`` rows measured it; a straggler
    is in scope by its measured ratio, a leak by its measured rate."""
    period = job_step_period_s(rows)
    episodes = []
    index = 0
    for ep in plans:
        periods = []
        for _ in ep.specs:
            onset = events.get(f"fault{index}_onset_unix_s")
            end = events.get(f"fault{index}_end_unix_s", run_end)
            if onset is not None:
                periods.append((onset, end))
            index += 1
        measured = _measured(ep, rows)
        in_scope = ep.in_scope
        if ep.kind == "straggler" and measured is not None:
            in_scope = straggler_in_scope(measured, world_size)
        if ep.kind == "memory-leak" and periods:
            duration = sum(end - start for start, end in periods)
            rate = ep.magnitude * 1e6 * (ep.end_step - ep.onset_step) / max(duration, 1e-9)
            measured = rate / 1e6
            in_scope = rate >= LEAK_SCOPE_BYTES_PER_S
        if not periods:  # the job never got there: a miss, timed from nothing
            periods = [(run_end, run_end)]
        episodes.append(
            Episode(
                ep.kind,
                ep.label,
                ep.magnitude,
                ep.rank,
                ep.onset_step,
                tuple(periods),
                in_scope,
                step_period_s=period,
                measured=measured,
            )
        )
    return episodes


def job_step_period_s(rows: Sequence[Sequence[Any]]) -> float:
    """The job's median step period: the time between consecutive step ends of a rank
    (``steps.end_unix_ns``), over every rank; 0 without two consecutive steps."""
    rank_i, step_i, end_i = (COLUMNS.index(c) for c in ("rank", "step", "end_unix_ns"))
    ends: dict[int, dict[int, int]] = {}
    for row in rows:
        if row[end_i] is not None:
            ends.setdefault(row[rank_i], {})[row[step_i]] = row[end_i]
    gaps = [
        (by_step[step] - by_step[step - 1]) / 1e9
        for by_step in ends.values()
        for step in by_step
        if step - 1 in by_step
    ]
    return median(gaps) or 0.0


def _measured(ep: EpisodePlan, rows: Sequence[Sequence[Any]]) -> float | None:
    """The fault as the job's ``steps`` rows show it (module docstring): a straggler's
    ratio (``_scoring.measured_ratio`` over its slow steps), a regression's step time
    over the 30 steps before it."""
    faulted = set()
    for spec in ep.specs:
        fault = parse_fault(spec)
        faulted |= {s for s in range(fault.start_step, fault.stop_step or fault.start_step + 1)}
    rank_i, step_i = COLUMNS.index("rank"), COLUMNS.index("step")
    duration_i, compute_i = COLUMNS.index("duration_s"), COLUMNS.index("compute_s")
    if ep.kind == "straggler" and ep.rank is not None:
        return measured_ratio(
            ((r[rank_i], r[step_i], r[compute_i]) for r in rows), ep.rank, faulted
        )
    if ep.kind == "regression":
        before = set(range(ep.onset_step - 30, ep.onset_step))
        during = [r[duration_i] for r in rows if r[step_i] in faulted and r[duration_i] is not None]
        normal = [r[duration_i] for r in rows if r[step_i] in before and r[duration_i] is not None]
        m_during, m_normal = median(during), median(normal)
        return m_during / m_normal if m_during and m_normal else None
    return None


def score_dump(dump: dict[str, Any]) -> tuple[RunScore, list[Episode]]:
    """A job ``--dump`` wrote, scored again (the alerts and fault times it kept): for a
    change of the scoring, without running the job again. Dumps written before the
    plan kept its specs rebuild them as the plans do (an on/off straggler: 10 slow
    steps every 20)."""
    plans = []
    for p in dump["plan"]:
        specs = p.get("specs") or _rebuilt_specs(p)
        in_scope = p.get("in_scope", _nominal_scope(p, dump["world_size"]))
        magnitude = math.inf if p["magnitude"] == "nan" else float(p["magnitude"])
        plans.append(
            EpisodePlan(
                p["kind"],
                p["label"],
                magnitude,
                tuple(specs),
                p["rank"],
                p["onset_step"],
                p["end_step"],
                in_scope,
            )
        )
    rows = [tuple(r) for r in dump["rows"]]
    run_end = float(dump["run_end_unix_s"])
    episodes = build_episodes(plans, dump["fault_events"], run_end, rows, dump["world_size"])
    alerts = [
        FiredAlert(a[0], a[1], a[2], a[5] if len(a) > 5 else None, a[3]) for a in dump["alerts"]
    ]
    return score_run(episodes, alerts, run_end_unix_s=run_end), episodes


def _rebuilt_specs(p: dict[str, Any]) -> list[str]:
    kind, rank, start, end = p["kind"], p["rank"], p["onset_step"], p["end_step"]
    if kind == "straggler":
        slow = f"{float(p['magnitude']) - 1:g}"
        spans = (
            [(s, s + 10) for s in range(start, end, 20)]
            if "on/off" in p["label"]
            else [(start, end)]
        )
        return [f"straggler:rank={rank},slowdown={slow},from={a},to={b}" for a, b in spans]
    if kind == "regression":
        return [f"regression:slowdown={float(p['magnitude']) - 1:g},from={start},to={end}"]
    rank_part = f"rank={rank}," if rank is not None else ""
    return [f"{kind}:{rank_part}from={start},to={end}"]


def _nominal_scope(p: dict[str, Any], world_size: int) -> bool:
    magnitude = math.inf if p["magnitude"] == "nan" else float(p["magnitude"])
    return {
        "straggler": straggler_in_scope(magnitude, world_size),
        "hang": magnitude > 5,
        "loss-spike": magnitude >= 10,
        "slow-link": magnitude >= 5,
    }.get(p["kind"], True)


@dataclass(slots=True)
class CleanOutcome:
    """A fault-free job: every alert in it is false."""

    name: str
    world_size: int
    alerts: list[FiredAlert]
    rank_steps: int
    wall_s: float
    urgent_share: float | None
    #: the straggler detector's bar at each tick (``FiringWatch.bars``)
    bars: list[float]
    #: what the noise added, summed over the ranks (``NoisyClock.counts``)
    noise: dict[str, float]
    step_period_s: float
    #: a tuning session's job: the steps it ran after the session ended
    settle_steps: int | None = None
    phase: str | None = None
    #: a tuning session's job: its last step when the session ended
    session_ended_at_step: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank_steps": self.rank_steps,
            "alerts": [a.name for a in self.alerts],
            # when each fired (the job's last finished step) and how long it lasted
            # (None: firing at the end): a tuning session's alert during the session
            # or after it reads apart with ``session_ended_at_step``
            "alerts_at": [
                {
                    "alert": a.name,
                    "step": a.first_step,
                    "lasted_s": None
                    if a.ends_at_unix_s is None
                    else a.ends_at_unix_s - a.fired_at_unix_s,
                }
                for a in self.alerts
            ],
            "false_alerts_per_10k_rank_steps": _per_10k(len(self.alerts), self.rank_steps),
            "effective_bar": _bar_figures(self.bars),
            "step_period_s": self.step_period_s,
            "urgent_share": self.urgent_share,
            "noise": self.noise,
            "settle_steps": self.settle_steps,
            "session_ended_at_step": self.session_ended_at_step,
            "phase": self.phase,
            "wall_s": self.wall_s,
        }


def _per_10k(alerts: int, rank_steps: int) -> float | None:
    return alerts * 10_000 / rank_steps if rank_steps else None


def _bar_figures(bars: Sequence[float]) -> dict[str, float | None]:
    """The straggler bar over a job: median, least and most (a slow step's least ratio
    to its peers' median; 1.2: 20 % slower than the peers)."""
    return {"median": median(bars), "min": min(bars, default=None), "max": max(bars, default=None)}


def _noise_counts(result: Any) -> dict[str, float]:
    counts: dict[str, float] = {}
    for per_rank in result.results:
        for key, value in per_rank.items():
            if key.startswith("noise_"):
                counts[key[6:]] = counts.get(key[6:], 0.0) + value
    return counts


async def run_clean(world_size: int, rank_steps: int, seed: int) -> CleanOutcome:
    """A fault-free job as the fault jobs run (their model width, ``CLEAN_COMPUTE_S`` of
    compute a step) with realistic noise: per-step jitter, pauses, spells of slow
    steps, data-loader hiccups and evaluation passes in the ranks (``NoisyClock``), and
    a background process burning a core in bursts."""
    steps = max(1, rank_steps // world_size)
    with CpuBurner(seed):
        result, watch, _, rows = await run_system_once(
            world_size, steps, CLEAN_COMPUTE_S, noise={"seed": seed}
        )
    alerts = fired_alerts(result, watch, rows)
    if DUMP_DIR is not None:
        dump = {
            "world_size": world_size,
            "alerts": alert_rows(alerts, watch),
            "columns": COLUMNS,
            "rows": rows,
        }
        DUMP_DIR.mkdir(parents=True, exist_ok=True)
        (DUMP_DIR / f"clean-{world_size}-{seed}.json").write_text(json.dumps(dump))
    return CleanOutcome(
        f"clean-{world_size}",
        world_size,
        alerts,
        len(rows),
        result.wall_s,
        watch.urgent_share,
        watch.bars,
        _noise_counts(result),
        job_step_period_s(rows),
    )


class SettleWatch(FiringWatch):
    """A tuning session's tick hook: once the session ended (the demo touched
    ``session_done``), the job runs ``settle_steps`` more steps under the config it
    chose, then its ranks are told to stop (``ranks_stop``)."""

    def __init__(self, job: str, session_done: Path, ranks_stop: Path, settle_steps: int) -> None:
        super().__init__(job)
        self.session_done = session_done
        self.ranks_stop = ranks_stop
        self.settle_steps = settle_steps
        self.ended_at_step: int | None = None

    def __call__(self, aggregator: Any, shaper: Any) -> None:
        super().__call__(aggregator, shaper)
        if self.ended_at_step is None and self.session_done.exists():
            self.ended_at_step = self.last_step
        if self.ended_at_step is not None and (
            self.last_step >= self.ended_at_step + self.settle_steps
        ):
            self.ranks_stop.touch()


async def run_tuning(seed: int, settle_steps: int) -> CleanOutcome:
    """A fault-free autotune session (3 configs, 2 ranks, ~0.1 s steps as real jobs
    take, the clean jobs' noise), then ``settle_steps`` steps under the config it chose,
    for the detectors to settle after it: its alerts (all false)."""
    with tempfile.TemporaryDirectory(prefix="torshmon-tune-") as tmp:
        done, stop = Path(tmp) / "session-done", Path(tmp) / "ranks-stop"
        watch = SettleWatch("bench", done, stop, settle_steps)
        result, _, _, rows = await run_system_once(
            2,
            TUNING_MAX_STEPS,
            0.1,
            autotune=True,
            noise={"seed": seed, "stop_file": str(stop)},
            watch=watch,
            stop_file=str(done),
        )
    phase = result.tuning.phase if result.tuning is not None else "none started"
    last = max((r[COLUMNS.index("step")] for r in rows), default=0)
    settled = None if watch.ended_at_step is None else last - watch.ended_at_step
    return CleanOutcome(
        "autotune",
        2,
        fired_alerts(result, watch, rows),
        len(rows),
        result.wall_s,
        watch.urgent_share,
        watch.bars,
        _noise_counts(result),
        job_step_period_s(rows),
        settle_steps=settled,
        phase=phase,
        session_ended_at_step=watch.ended_at_step,
    )


# -- reporting -------------------------------------------------------------------------


@dataclass(slots=True)
class CurvePoint:
    label: str
    magnitude: float
    scores: list[EpisodeScore]
    measured: list[float]
    slack_s: list[float]

    def as_json(self) -> dict[str, Any]:
        detected = [s for s in self.scores if s.detected]
        steps = [s.latency_steps for s in detected if s.latency_steps is not None]
        secs = [s.latency_s for s in detected if s.latency_s is not None]
        return {
            "magnitude": _json_float(self.magnitude),
            "in_scope": all(s.episode.in_scope for s in self.scores),
            "episodes": len(self.scores),
            "detected_share": len(detected) / len(self.scores),
            "named_share": _share_named(self.scores),
            "median_latency_steps": median(steps),
            "worst_latency_steps": max(steps) if steps else None,
            "median_latency_s": median(secs),
            "worst_latency_s": max(secs) if secs else None,
            "median_slack_latency_s": median(self.slack_s),
            "coverage_median": median([s.coverage for s in detected]),
            "coverage_after_alert_median": median([s.coverage_after_alert for s in detected]),
            "measured_median": median(self.measured),
            "false_alerts": sorted(a.name for s in self.scores for a in (*s.false, *s.wrong_rank)),
        }


def _share_named(scores: list[EpisodeScore]) -> float | None:
    answered = [s for s in scores if s.named is not None]
    return sum(s.named is True for s in answered) / len(answered) if answered else None


def _json_float(value: float) -> float | str:
    return "nan" if math.isinf(value) else value


def curves(outcomes: Sequence[JobOutcome]) -> dict[str, list[CurvePoint]]:
    points: dict[tuple[str, float], CurvePoint] = {}
    for outcome in outcomes:
        for i, score in enumerate(outcome.score.episodes):
            ep = score.episode
            point = points.setdefault(
                (ep.label, ep.magnitude), CurvePoint(ep.label, ep.magnitude, [], [], [])
            )
            point.scores.append(score)
            if (m := outcome.measured.get(i)) is not None:
                point.measured.append(m)
            if (s := outcome.slack_latency_s.get(i)) is not None:
                point.slack_s.append(s)
    by_label: dict[str, list[CurvePoint]] = {}
    for (label, _), point in sorted(points.items()):
        by_label.setdefault(label, []).append(point)
    return by_label


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_curves(by_label: dict[str, list[CurvePoint]]) -> None:
    for label, points in by_label.items():
        print(f"\n{label}")
        rows = [p.as_json() for p in points]
        print(
            format_table(
                [
                    ("magnitude", lambda r: str(r["magnitude"])),
                    ("scope", lambda r: "yes" if r["in_scope"] else "no"),
                    ("n", lambda r: str(r["episodes"])),
                    ("detected", lambda r: _fmt(r["detected_share"])),
                    ("named", lambda r: _fmt(r["named_share"])),
                    ("lat steps med", lambda r: _fmt(r["median_latency_steps"], ".0f")),
                    ("worst", lambda r: _fmt(r["worst_latency_steps"], ".0f")),
                    ("lat s med", lambda r: _fmt(r["median_latency_s"])),
                    ("worst", lambda r: _fmt(r["worst_latency_s"])),
                    ("coverage", lambda r: _fmt(r["coverage_median"])),
                    ("after alert", lambda r: _fmt(r["coverage_after_alert_median"])),
                    ("measured", lambda r: _fmt(r["measured_median"])),
                    ("false", lambda r: ", ".join(r["false_alerts"]) or "-"),
                ],
                rows,
            )
        )


def _fault_steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 30 or steps % 10:
        raise argparse.ArgumentTypeError(f"fault steps: a multiple of 10 >= 30, got {text!r}")
    return steps


def parse_seeds(text: str, what: str = "seeds") -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what}: comma-separated integers, got {text!r}"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{what}: at least one")
    return seeds


def _world_sizes(text: str) -> list[int]:
    return parse_seeds(text, "world sizes")


def run_fault_jobs(
    kinds: Sequence[str], seeds: Sequence[int], quick: bool, sweep: Sweep = DEV
) -> list[JobOutcome]:
    """Every fault job of every seed, with a line per job and per episode as it ends."""
    outcomes: list[JobOutcome] = []
    for seed in seeds:
        for plan in plan_jobs(kinds, seed, quick, sweep):
            outcome = asyncio.run(run_job(plan, seed))
            outcomes.append(outcome)
            found = sum(s.detected for s in outcome.score.episodes)
            outside = [a.name for a in outcome.score.outside]
            print(
                f"{plan.name} seed {seed}: {found}/{len(plan.episodes)} episodes detected, "
                f"false alerts outside episodes: {outside or 'none'}, "
                f"steps sent urgent: {_fmt(outcome.urgent_share)}, straggler bar "
                f"{_bar_figures(outcome.bars)} ({outcome.wall_s:.0f} s)",
                flush=True,
            )
            for i, score in enumerate(outcome.score.episodes):
                ep = score.episode
                print(
                    f"  {ep.label} {ep.magnitude:g} rank {ep.rank} step {ep.onset_step}: "
                    f"detected={score.detected} named={score.named} "
                    f"latency={_fmt(score.latency_s)} s/{score.latency_steps} steps "
                    f"coverage={_fmt(score.coverage)} "
                    f"after alert={_fmt(score.coverage_after_alert)} "
                    f"measured={_fmt(outcome.measured.get(i))} "
                    f"false={[a.name for a in (*score.false, *score.wrong_rank)]} "
                    f"symptoms={[a.name for a in score.symptoms]}",
                    flush=True,
                )
    return outcomes


def run_clean_jobs(
    rank_steps: int, seed: int, world_sizes: Sequence[int] = CLEAN_WORLD_SIZES
) -> list[CleanOutcome]:
    """The clean jobs, one per world size, ``rank_steps`` rank-steps each."""
    outcomes = []
    for world_size in world_sizes:
        outcome = asyncio.run(run_clean(world_size, rank_steps, seed))
        outcomes.append(outcome)
        print(
            f"clean {world_size} ranks, {outcome.rank_steps} rank-steps, noise "
            f"{outcome.noise}, bursty CPU load: alerts: "
            f"{[a.name for a in outcome.alerts] or 'none'}, straggler bar "
            f"{_bar_figures(outcome.bars)}, steps sent urgent: {_fmt(outcome.urgent_share)} "
            f"({outcome.wall_s:.0f} s)",
            flush=True,
        )
    return outcomes


def run_tuning_job(seed: int, settle_steps: int) -> CleanOutcome:
    outcome = asyncio.run(run_tuning(seed, settle_steps))
    fired = [f"{a.name} at step {a.first_step}" for a in outcome.alerts]
    print(
        f"autotune session ({outcome.phase}, ended at step {outcome.session_ended_at_step}), "
        f"no fault, {outcome.settle_steps} steps after it: alerts: {fired or 'none'}, "
        f"straggler bar {_bar_figures(outcome.bars)} ({outcome.wall_s:.0f} s)",
        flush=True,
    )
    return outcome


def straggler_thresholds(scores: Sequence[EpisodeScore]) -> dict[str, float | None]:
    """Per world size w of the straggler jobs, ``straggler_min_ratio_detected_{w}``: the
    smallest ratio the steps table measured from which on every episode (every seed,
    steady and on/off) was caught naming its rank; and ``..._knob``: the same read on
    the slowdown asked of the fault (before 2026-12-06 the figure's only scale)."""
    found: dict[str, float | None] = {}
    stragglers = [s for s in scores if s.episode.kind == "straggler"]
    worlds = sorted({_world(s.episode.label) for s in stragglers}, reverse=True)
    for world in worlds:
        at = [s for s in stragglers if _world(s.episode.label) == world]
        found[f"straggler_min_ratio_detected_{world}"] = min_magnitude_detected(at)
        knob = [replace(s, episode=replace(s.episode, measured=None)) for s in at]
        found[f"straggler_min_ratio_detected_{world}_knob"] = min_magnitude_detected(knob)
    return found


def _world(label: str) -> int:
    """The world size in a straggler label (``straggler steady 4 ranks``)."""
    return int(label.rsplit(" ", 2)[-2])


def build_report(
    outcomes: Sequence[JobOutcome],
    clean: Sequence[CleanOutcome],
    tuning: Sequence[CleanOutcome],
    by_label: dict[str, list[CurvePoint]],
) -> dict[str, Any]:
    scores = [s for o in outcomes for s in o.score.episodes]
    clean_jobs = [c.alerts for c in clean]
    tuning_jobs = [t.alerts for t in tuning]
    summary = summarize([o.score for o in outcomes], clean_jobs, tuning_jobs)
    clean_rank_steps = sum(c.rank_steps for c in clean)
    false_in_fault_jobs = [
        a.name
        for o in outcomes
        for a in (
            *o.score.outside,
            *(x for s in o.score.episodes for x in (*s.false, *s.wrong_rank)),
        )
    ]
    return {
        "grace": {kind: {"steps": st, "s": sec} for kind, (st, sec) in GRACE.items()},
        "symptom_grace_s": SYMPTOM_GRACE_S,
        "onset_slack_steps": ONSET_SLACK_STEPS,
        **straggler_thresholds(scores),
        "coverage_median": summary.coverage_median,
        "coverage_median_all_kinds": summary.coverage_median_all,
        "coverage_after_alert_median": summary.coverage_after_alert_median,
        "fault_steps": FAULT_STEPS,
        "recall": summary.recall,
        "recall_all": summary.recall_all,
        "attribution": summary.attribution,
        "precision_runs": summary.precision_runs,
        "precision_units": {"true": summary.true_units, "false": summary.false_units},
        "median_latency_steps": summary.median_latency_steps,
        "median_latency_s": summary.median_latency_s,
        "worst_latency_s": summary.worst_latency_s,
        "latency_by_kind": {k: v.as_json() for k, v in summary.latency_by_kind.items()},
        "episodes": len(scores),
        "false_alerts_in_fault_jobs": sorted(false_in_fault_jobs),
        "clean_false_alerts": sum(len(j) for j in clean_jobs) if clean else None,
        "clean_alerts": [a.name for j in clean_jobs for a in j],
        "clean_rank_steps": clean_rank_steps if clean else None,
        "false_alerts_clean_per_10k_rank_steps": (
            _per_10k(sum(len(j) for j in clean_jobs), clean_rank_steps) if clean else None
        ),
        # The straggler bar relative to compute (a slow step's least ratio to its peers'
        # median), per clean job's world size: where the clean figures were measured.
        "effective_bar_clean": {str(c.world_size): _bar_figures(c.bars) for c in clean},
        "clean_jobs": {c.name: c.as_json() for c in clean},
        "tuning_false_alerts": sum(len(j) for j in tuning_jobs) if tuning else None,
        "tuning_alerts": [a.name for j in tuning_jobs for a in j],
        "tuning_jobs": [t.as_json() for t in tuning],
        # The bar in each fault job, beside its figures.
        "effective_bar_fault_jobs": {
            f"{o.plan.name}-{o.seed}": _bar_figures(o.bars) for o in outcomes
        },
        # How much of each job went through the fast lane: on a fault job both the faults
        # and noise open it; on a clean job only noise does.
        "urgent_share_fault_jobs": [o.urgent_share for o in outcomes],
        "urgent_share_clean_jobs": [c.urgent_share for c in clean],
        "curves": {label: [p.as_json() for p in points] for label, points in by_label.items()},
    }


def rescore(dirs: Sequence[Path]) -> dict[str, Any]:
    """The figures of the jobs ``--dump`` wrote into ``dirs`` (fault jobs and clean
    jobs), scored again with today's scoring."""
    paths = sorted(p for d in dirs for p in d.glob("*.json"))
    if not paths:
        raise SystemExit(f"no dumps (*.json) in {', '.join(map(str, dirs))}")
    runs, clean = [], []
    for path in paths:
        dump = json.loads(path.read_text())
        if "plan" in dump:
            runs.append(score_dump(dump)[0])
        else:
            clean.append([FiredAlert(a[0], a[1], a[2]) for a in dump["alerts"]])
    summary = summarize(runs, clean, [])
    scores = [s for r in runs for s in r.episodes]
    return {
        "jobs": len(paths),
        "episodes": len(scores),
        **straggler_thresholds(scores),
        "recall": summary.recall,
        "recall_all": summary.recall_all,
        "attribution": summary.attribution,
        "precision_runs": summary.precision_runs,
        "precision_units": {"true": summary.true_units, "false": summary.false_units},
        "coverage_median": summary.coverage_median,
        "coverage_after_alert_median": summary.coverage_after_alert_median,
        "median_latency_steps": summary.median_latency_steps,
        "latency_by_kind": {k: v.as_json() for k, v in summary.latency_by_kind.items()},
        "false_alerts_in_fault_jobs": sorted(
            a.name
            for r in runs
            for a in (*r.outside, *(x for s in r.episodes for x in (*s.false, *s.wrong_rank)))
        ),
    }


#: The figures printed before the JSON line.
HEADLINE = (
    "recall",
    "attribution",
    "precision_runs",
    "coverage_median",
    "coverage_after_alert_median",
    "latency_by_kind",
    "clean_false_alerts",
    "false_alerts_clean_per_10k_rank_steps",
    "effective_bar_clean",
    "tuning_false_alerts",
    "wall_s",
)


def main(argv: list[str] | None = None) -> int:
    global DUMP_DIR, FAULT_STEPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one seed, two straggler magnitudes at two world sizes, 1 000 clean rank-steps",
    )
    parser.add_argument(
        "--dev",
        action="store_true",
        help=f"the development seeds {DEV.seeds} and sweep (default: the report seeds "
        f"{REPORT.seeds}, never used to change a detector)",
    )
    parser.add_argument(
        "--seeds", type=parse_seeds, default=None, help="comma-separated seeds instead"
    )
    parser.add_argument(
        "--kinds", nargs="*", default=list(SWEPT_KINDS), choices=SWEPT_KINDS, help="(all)"
    )
    parser.add_argument(
        "--clean-rank-steps",
        type=int,
        default=None,
        help=f"rank-steps of each clean job ({CLEAN_RANK_STEPS}; --quick 1 000)",
    )
    parser.add_argument(
        "--clean-world-sizes",
        type=_world_sizes,
        default=list(CLEAN_WORLD_SIZES),
        help="comma-separated world sizes of the clean jobs (4,8)",
    )
    parser.add_argument(
        "--settle-steps",
        type=int,
        default=None,
        help=f"steps after the tuning session ends ({TUNING_SETTLE_STEPS}; --quick 100)",
    )
    parser.add_argument("--no-clean", action="store_true", help="skip the clean jobs")
    parser.add_argument("--no-tuning", action="store_true", help="skip the autotune session")
    parser.add_argument(
        "--dump", type=Path, default=None, help="write each job's steps and alerts here (JSON)"
    )
    parser.add_argument(
        "--fault-steps",
        type=_fault_steps,
        default=FAULT_STEPS,
        help=f"steps a straggler or regression lasts, a multiple of 10 >= 30 ({FAULT_STEPS})",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="score the jobs --dump wrote into DIR again (no job runs) and print the figures",
    )
    args = parser.parse_args(argv)
    if args.rescore is not None:
        print(json.dumps(rescore(args.rescore)))
        return 0
    DUMP_DIR = args.dump
    FAULT_STEPS = args.fault_steps
    sweep = DEV if args.dev else REPORT
    seeds = args.seeds or (list(sweep.seeds[:1]) if args.quick else list(sweep.seeds))
    rank_steps = args.clean_rank_steps or (1000 if args.quick else CLEAN_RANK_STEPS)
    settle_steps = args.settle_steps or (100 if args.quick else TUNING_SETTLE_STEPS)
    if rank_steps < 1 or settle_steps < 1:
        parser.error("--clean-rank-steps and --settle-steps must be >= 1")
    if any(w < 2 for w in args.clean_world_sizes):
        parser.error("--clean-world-sizes: at least 2 ranks a job")
    if os.geteuid() != 0 and "slow-link" in args.kinds:
        print("slow-link needs root (network namespaces); leaving it out", file=sys.stderr)
        args.kinds = [k for k in args.kinds if k != "slow-link"]

    started = time.monotonic()
    outcomes = run_fault_jobs(args.kinds, seeds, args.quick, sweep)
    clean = [] if args.no_clean else run_clean_jobs(rank_steps, seeds[0], args.clean_world_sizes)
    tuning = [] if args.no_tuning else [run_tuning_job(seeds[0], settle_steps)]
    by_label = curves(outcomes)
    print_curves(by_label)
    report = {
        "sweep": sweep.name,
        "seeds": seeds,
        "kinds": args.kinds,
        "quick": args.quick,
        **build_report(outcomes, clean, tuning, by_label),
        "wall_s": time.monotonic() - started,
    }
    print()
    for key in sorted(k for k in report if k.startswith("straggler_min_ratio_detected_")):
        print(f"{key}: {report[key]}")
    for key in HEADLINE:
        print(f"{key}: {report.get(key)}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
