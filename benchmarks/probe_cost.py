"""Where the probe's cost goes on a real 2-rank gloo DDP job, part by part.

``overhead.py`` says how much slower a step is with the probe; this script says what
the probe spends, per step and rank, on each of its paths, as it is by default, with its
fast lane forced shut and with its run-queue clocks on, alternated in one run on the same
job (``overhead.py``'s models and
steps, one core per rank):

- the training thread: each of the probe's entry points (step enter and exit, the
  forward hooks, the last gradient's hook, the end of backward) and the parts of them
  that cost most (the run-queue clocks, the config consensus, reading the loss): the
  median wall time of a call, and the thread's CPU time in it per step. Wall time on a
  rank's one core includes the job's other threads (gloo's) running meanwhile; CPU time
  is what the probe spends. The timing wrapper's own cost (two clock reads a call) is
  printed, measured in a tight loop; in the training loop everything costs several
  times what it does there (caches the step's compute evicted);
- the shipper thread: its CPU time per step (``pthread_getcpuclockid``);
- the share of steps the fast lane sent urgent (as the agent's stand-in counted them).

Prints one table per arm, then a JSON object (the last line).

Usage::

    python benchmarks/probe_cost.py --quick          # small model, ~15 s (2 cores)
    python benchmarks/probe_cost.py                  # small model, ~1 min
    python benchmarks/probe_cost.py --model mlp --steps 300     # ~1 min
    python benchmarks/probe_cost.py --quick --entry-points-only  # no nested timers
    # the default probe, its run-queue clocks on, and the timers' own cost beside them
    python benchmarks/probe_cost.py --entry-points-only --arms lane runqueue --calibrate

Arms (``--arms``): ``lane`` (the default probe), ``lane_shut`` (``fast_lane=False``),
``runqueue`` (``cpu_wait=True``: the run-queue clocks read). ``--calibrate`` adds
``timers``: the default probe, each entry point run untimed right after a timed no-op in
its place. Its figure is what the timers themselves cost in the training loop, where
the step's compute has evicted their path from the caches (30-37 us a step on the
shared 2-core box, against 1.7-2.5 us a call in a tight loop), and each arm's figure less it
is printed beside it: the probe's own cost, as near as this method gets (the entry
point's first system call, warm after the timer's, is the part it may understate).

The parts' timers sit inside the entry points' and their four clock reads a call (two
of them system calls: the thread's CPU clock) count in the entry points' CPU time, 5
nested calls a step. ``--entry-points-only`` leaves them out (the parts' rows are then
not printed); the default keeps them, so its figure compares with earlier runs. On the
shared 2-core machine the difference is within the noise of loaded runs (two runs:
about 50 us a step; 12 alternated pairs later, under heavier load: none resolved).

Where a step's cost goes (``--entry-points-only``, on the shared 2-core machine, less the
timers): the default probe about 85 us of the training thread's CPU a step, more as the
machine's load grows; the ``runqueue`` arm 150-170: the three places a step reads a
run-queue clock, the last gradient (``_on_grad``), the end of backward
(``_on_backward_end``: hardly anything else) and the step's end (the process clock,
about a third of ``_exit_step``), each paying a system call on caches the step's compute
has evicted (``runqueue.py``); the default mode's parts rows show them. The rest is
Python, which in the training loop costs several times what it does in a tight loop:
every call and object counts (reading the loss, building the step's record, the
in-flight entry and backward-end callback that the last gradient queues). The timers'
own thread-CPU reads (a system call each, two a call) count too: the forward hooks' few
us a step are mostly theirs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import overhead
import torch.distributed as dist

import torshmon
from torshmon.agent.receiver import ThreadedReceiver
from torshmon.launch import run_ranks
from torshmon.probe import monitor as monitor_module
from torshmon.probe import runqueue
from torshmon.wire import Batch, ProbeMessage

#: Each arm's ``attach`` options: the default probe, its lane forced shut, the default
#: with its run-queue clocks on (``cpu_wait=True``), and ``timers``: the default probe with
#: each entry point run untimed right after a timed no-op in its place, so the timers' own
#: cost in the training loop (cold caches included) is measured where the other arms pay
#: it. All passed in full, so $TORSHMON_FAST_LANE / $TORSHMON_CPU_WAIT cannot change an arm.
ARM_OPTIONS: dict[str, dict[str, bool]] = {
    "lane": {"fast_lane": True, "cpu_wait": False},
    "lane_shut": {"fast_lane": False, "cpu_wait": False},
    "runqueue": {"fast_lane": True, "cpu_wait": True},
    "timers": {"fast_lane": True, "cpu_wait": False},
}
DEFAULT_ARMS = ("lane", "lane_shut", "runqueue")

#: The probe's entry points on the training thread: what a step pays in all.
ENTRY_POINTS = (
    "_enter_step",
    "_exit_step",
    "_on_forward_start",
    "_on_forward_end",
    "_on_grad",
    "_on_backward_end",
)
#: Parts inside them, reported on their own (already counted in the entry points).
PARTS = ("thread run-queue clock", "process run-queue clock", "_sync_config", "_host_loss")

#: Each timed call's (wall, CPU) nanoseconds, by name (the rank's training thread only).
_CALLS: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    calls = _CALLS[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            calls.append((time.perf_counter_ns() - wall, time.thread_time_ns() - cpu))

    return wrapper


def wrapper_cost_us(calls: int = 20_000) -> float:
    """What the timing wrapper itself adds to a call, in a tight loop (us)."""
    noop = _timed("wrapper", lambda: None)
    start = time.perf_counter_ns()
    for _ in range(calls):
        noop()
    cost = (time.perf_counter_ns() - start) / calls / 1e3
    del _CALLS["wrapper"]
    return cost


#: Whether the entry points run untimed after a timed no-op (the ``timers`` arm).
_NOOP_TIMED = [False]


def _timed_or_noop(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    timed, noop = _timed(name, function), _timed(name, lambda: None)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _NOOP_TIMED[0]:
            noop()
            return function(*args, **kwargs)
        return timed(*args, **kwargs)

    return wrapper


def _instrument(*, parts: bool) -> None:
    """Wrap the probe's entry points, and with ``parts`` the parts inside them (before
    ``attach``, which binds the hooks)."""
    for name in ENTRY_POINTS:
        original = getattr(monitor_module.Monitor, name)
        setattr(monitor_module.Monitor, name, _timed_or_noop(name, original))
    if not parts:
        return
    name = "_sync_config"
    setattr(monitor_module.Monitor, name, _timed(name, getattr(monitor_module.Monitor, name)))
    monitor_module._host_loss = _timed("_host_loss", monitor_module._host_loss)
    clocks = (
        (runqueue.RunQueueClock, "thread run-queue clock"),
        (runqueue.ProcessRunQueue, "process run-queue clock"),
    )
    for cls, name in clocks:
        cls.read_ns = _timed(name, cls.read_ns)  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    steps: int
    rounds: int
    agent_socket: str
    parts: bool = True
    arms: tuple[str, ...] = DEFAULT_ARMS


def _shipper_cpu_s() -> float:
    for thread in threading.enumerate():
        if thread.name == "torshmon-shipper" and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    raise RuntimeError("no shipper thread")


def _rotated(arms: tuple[str, ...], round_index: int) -> Iterator[str]:
    shift = round_index % len(arms)
    yield from arms[shift:] + arms[:shift]


def rank_main(rank: int, world_size: int, plan: Plan) -> dict[str, Any]:
    """Per arm: each round's per-call timings, shipper CPU and step counts."""
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    _instrument(parts=plan.parts)
    spec = overhead.MODELS[plan.model]
    x, y = overhead._batch(spec, seed=1 + rank)
    out: dict[str, Any] = {
        arm: {"calls": collections.defaultdict(list), "shipper_s": []} for arm in plan.arms
    }
    for round_index in range(plan.rounds):
        for arm in _rotated(plan.arms, round_index):
            ddp, optimizer = overhead._build(spec, seed=0)
            dist.barrier()
            _NOOP_TIMED[0] = arm == "timers"
            mon = torshmon.attach(
                ddp, job=f"cost-{arm}", agent_socket=plan.agent_socket, **ARM_OPTIONS[arm]
            )
            step = overhead._train_step(ddp, optimizer, x, y)
            for index in range(20 + plan.steps):
                if index == 20:  # past DDP's bucket rebuild and the lane's history
                    for calls in _CALLS.values():
                        calls.clear()
                    shipper_start = _shipper_cpu_s()
                with mon.step(batch_size=spec.batch_size) as scope:
                    scope.loss = step()
            out[arm]["shipper_s"].append((_shipper_cpu_s() - shipper_start) / plan.steps)
            for name, timed in _CALLS.items():
                out[arm]["calls"][name].extend(timed)
            mon.close()
    for arm in plan.arms:
        out[arm]["calls"] = dict(out[arm]["calls"])
    return out


class UrgentCounter:
    """Steps received per job, and how many came urgent (receiver's thread)."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = collections.Counter()
        self.urgent: dict[str, int] = collections.Counter()

    def __call__(self, message: ProbeMessage) -> None:
        if isinstance(message, Batch):
            self.steps[message.job] += len(message.steps)
            if message.urgent:
                self.urgent[message.job] += len(message.steps)


def summarize(results: list[dict[str, Any]], plan: Plan, counter: UrgentCounter) -> dict[str, Any]:
    """Per arm and rank: per part, calls a step, median us a call, mean us a step."""
    total_steps = plan.steps * plan.rounds
    summary: dict[str, Any] = {
        "model": plan.model,
        "steps": plan.steps,
        "rounds": plan.rounds,
        "parts_timed": plan.parts,
        "wrapper_cost_us": wrapper_cost_us(),
        "arms": list(plan.arms),
    }
    for arm in plan.arms:
        ranks = []
        for result in results:
            calls = result[arm]["calls"]
            parts = {}
            for name in (*ENTRY_POINTS, *PARTS):
                timed = calls.get(name) or [(0, 0)]
                parts[name] = {
                    "calls_per_step": len(calls.get(name, [])) / total_steps,
                    "median_wall_us": statistics.median(w for w, _ in timed) / 1e3,
                    "cpu_us_per_step": sum(c for _, c in timed) / total_steps / 1e3,
                }
            ranks.append(
                {
                    "parts": parts,
                    "training_thread_cpu_us_per_step": sum(
                        parts[n]["cpu_us_per_step"] for n in ENTRY_POINTS
                    ),
                    "shipper_cpu_us_per_step": statistics.median(result[arm]["shipper_s"]) * 1e6,
                }
            )
        job = f"cost-{arm}"
        summary[arm] = {
            "ranks": ranks,
            "urgent_share": counter.urgent[job] / counter.steps[job]
            if counter.steps[job]
            else None,
        }
    if "timers" in plan.arms:
        # Each arm's figure less what the timers cost where it paid them, per rank.
        timers = summary["timers"]["ranks"]
        for arm in plan.arms:
            for rank, own in zip(summary[arm]["ranks"], timers, strict=True):
                rank["less_timers_cpu_us_per_step"] = (
                    rank["training_thread_cpu_us_per_step"] - own["training_thread_cpu_us_per_step"]
                )
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    names = (*ENTRY_POINTS, *PARTS) if summary["parts_timed"] else ENTRY_POINTS
    for arm in summary["arms"]:
        rows = [(name, [r["parts"][name] for r in summary[arm]["ranks"]]) for name in names]
        print(
            f"\n{arm} ({summary['model']}, {summary['steps']} steps x {summary['rounds']}"
            " rounds; rank 0 | rank 1)"
        )
        print(
            _table.format_table(
                [
                    ("part", lambda row: row[0]),
                    ("calls/step", lambda row: f"{row[1][0]['calls_per_step']:.2f}"),
                    (
                        "median wall us/call",
                        lambda row: " | ".join(f"{p['median_wall_us']:.1f}" for p in row[1]),
                    ),
                    (
                        "CPU us/step",
                        lambda row: " | ".join(f"{p['cpu_us_per_step']:.1f}" for p in row[1]),
                    ),
                ],
                rows,
            )
        )
        ranks = summary[arm]["ranks"]
        print(
            "training thread's CPU in the probe, us/step: "
            + " | ".join(f"{r['training_thread_cpu_us_per_step']:.1f}" for r in ranks)
            + "; shipper CPU, us/step: "
            + " | ".join(f"{r['shipper_cpu_us_per_step']:.1f}" for r in ranks)
            + f"; steps sent urgent: {summary[arm]['urgent_share']:.2f}"
        )
        if "less_timers_cpu_us_per_step" in ranks[0] and arm != "timers":
            print(
                "the same less the timers' own cost (the timers arm), us/step: "
                + " | ".join(f"{r['less_timers_cpu_us_per_step']:.1f}" for r in ranks)
            )
    print(
        "\nthe timing wrapper's own cost, in a tight loop: "
        f"{summary['wrapper_cost_us']:.2f} us a call"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(overhead.MODELS), default="small")
    parser.add_argument("--quick", action="store_true", help="200 steps, one round")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per arm and round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (each runs every arm)")
    parser.add_argument(
        "--entry-points-only",
        action="store_true",
        help="time the entry points alone: the parts' timers, nested in them, add their own "
        "clock reads to the entry points' CPU time",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=sorted(ARM_OPTIONS),
        default=list(DEFAULT_ARMS),
        help="the arms to alternate (default: lane lane_shut runqueue)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="add the timers arm and print each arm's figure less the timers' own cost",
    )
    args = parser.parse_args(argv)
    arms = tuple(dict.fromkeys([*args.arms, *(["timers"] if args.calibrate else [])]))
    if args.calibrate and not args.entry_points_only:
        parser.error("--calibrate needs --entry-points-only (the parts' timers are not calibrated)")
    args.steps = args.steps or (200 if args.quick else 1000)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    counter = UrgentCounter()
    with tempfile.TemporaryDirectory(prefix="torshmon-cost-") as tmp:
        plan = Plan(
            args.model,
            args.steps,
            args.rounds,
            str(Path(tmp) / "agent.sock"),
            parts=not args.entry_points_only,
            arms=arms,
        )
        with ThreadedReceiver(plan.agent_socket, on_message=counter):
            results = run_ranks(rank_main, overhead.WORLD_SIZE, plan, timeout_s=3600)
    summary = summarize(results, plan, counter)
    print_summary(summary)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
