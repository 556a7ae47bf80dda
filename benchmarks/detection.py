"""Detection benchmark: does torshmon find each injected fault, name the rank, fast,
and stay quiet when nothing is wrong?

Each run is ``torshmon demo``'s whole system (aggregator with the default rules, agent,
a real multi-process gloo DDP job; ``demo.run_system``) with one fault injected for
real (``torshmon.faults``), and a local HTTP receiver standing in for Slack. For every
kind and seed the faulted rank and the onset step are drawn from the seed.

Per run:

- **detected**: an alert of the kind's rule fired after the onset (straggler ->
  Straggler, regression -> Step Time Anomaly, hang -> Hung Collective, memory-leak ->
  Memory Leak, loss-spike -> Loss Spike or Non-finite Loss, slow-link -> Slow Link);
- **named**: that alert's ``rank`` label is the faulted rank (kinds with one rank);
- **latency**: seconds from the onset (the moment the faulted rank started the fault,
  or the link rate changed) to the alert firing (``alerts.fired_at``) and to the Slack
  message reaching the receiver; steps: how many steps of the job the aggregator had
  seen from the onset step on when the alert fired (0 for a hang: no step completes);
- **resolved**: the alert resolved after the fault stopped;
- **false alerts**: alerts that fired and are neither the kind's rule naming the right
  rank after the onset nor a symptom rule after the onset (a slower job legitimately
  shows Step Time Anomaly and High Communication Overhead for straggler, regression,
  hang and slow-link; a memory leak makes the leaking rank compute slower, so Step
  Time Anomaly, and Straggler naming that rank, are its symptoms); anything that fired
  before the onset is false.

A clean run of ``--clean-steps`` steps (2 000 by default) counts every alert that fires.

``precision`` = right alerts / (right alerts + false alerts), counted in alerts,
over the fault runs and the clean run (symptom alerts are left out of it);
``recall`` = detected runs / runs; ``attribution`` = named / detected runs of kinds
with a rank. Prints a table per run, a summary, then one JSON object (the last line).

Usage::

    python benchmarks/detection.py --quick        # 1 seed, 600 clean steps (~6 min)
    python benchmarks/detection.py                # 3 seeds, 2000 clean steps (~17 min)
    python benchmarks/detection.py --kinds hang --seeds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import format_table
from torshmon.faults import KINDS, parse_fault

#: The rule that must catch each kind.
EXPECTED: dict[str, tuple[str, ...]] = {
    "straggler": ("Straggler",),
    "regression": ("Step Time Anomaly",),
    "hang": ("Hung Collective",),
    "memory-leak": ("Memory Leak",),
    "loss-spike": ("Loss Spike", "Non-finite Loss"),
    "slow-link": ("Slow Link",),
}
#: Rules a fault of the kind legitimately fires as well: the job did get slower.
SYMPTOMS: dict[str, tuple[str, ...]] = {
    "straggler": ("Step Time Anomaly", "High Communication Overhead"),
    "regression": ("High Communication Overhead",),
    "hang": ("Step Time Anomaly", "High Communication Overhead"),
    "memory-leak": ("Step Time Anomaly",),
    "loss-spike": (),
    "slow-link": ("Step Time Anomaly", "High Communication Overhead"),
}
#: Rules a fault of the kind legitimately fires when they name the faulted rank. A leak
#: of 4 MB a step makes the leaking rank compute 1.3-2x slower in the benchmark's small
#: model (page faults on fresh memory; 6.7 -> 9.5 ms measured): it is a straggler.
RANK_SYMPTOMS: dict[str, tuple[str, ...]] = {"memory-leak": ("Straggler",)}
#: Kinds whose fault has no single rank.
JOB_WIDE = ("regression",)
#: Slow links need three ranks: with two, one link's pair test cannot tell whose it is.
WORLD_SIZE = {"slow-link": 3}


@dataclass(slots=True)
class RunResult:
    kind: str
    seed: int
    spec: str
    rank: int | None
    detected: bool = False
    named: bool | None = None
    latency_s: float | None = None
    slack_latency_s: float | None = None
    latency_steps: int | None = None
    resolved: bool = False
    right_alerts: int = 0
    false_alerts: list[str] = field(default_factory=list)
    symptom_alerts: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def fault_spec(kind: str, seed: int, world_size: int) -> tuple[str, int, int]:
    """The fault of one run: its spec, onset step and total steps of the job."""
    rng = random.Random(f"{kind}-{seed}")
    rank = rng.randrange(world_size)
    onset = rng.randint(40, 60)
    if kind == "straggler":
        return f"straggler:rank={rank},slowdown=1,from={onset},to={onset + 60}", onset, onset + 120
    if kind == "regression":
        return f"regression:slowdown=1,from={onset},to={onset + 60}", onset, onset + 120
    if kind == "hang":
        return f"hang:rank={rank},from={onset},seconds=8", onset, onset + 60
    if kind == "memory-leak":
        # ~35 MB/s at ~115 ms a step for ~14 s, then ~14 s for the slope to settle.
        return f"memory-leak:rank={rank},from={onset},to={onset + 120},mb=4", onset, onset + 240
    if kind == "loss-spike":
        nan = seed % 2
        return f"loss-spike:rank={rank},from={onset},to={onset + 5},nan={nan}", onset, onset + 60
    return f"slow-link:rank={rank},rate=100mbit,from={onset},to={onset + 60}", onset, onset + 140


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
    """``run_system``'s tick hook: the job's last step when each alert first fired."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.first_step: dict[tuple[str, str | None], int] = {}

    def __call__(self, aggregator: Any, shaper: Any) -> None:
        summary = aggregator.live.job_summary(self.job)
        last = summary["last_step"] if summary else -1
        for alert in aggregator.alerts.active():
            if alert.state == "firing":
                self.first_step.setdefault((alert.rule, alert.labels.get("rank")), last)


async def run_one(
    kind: str | None, seed: int, *, steps: int | None = None, step_sleep_s: float = 0.1
) -> tuple[RunResult, list[dict[str, Any]]]:
    from torshmon.aggregator.notify.targets import SlackTarget
    from torshmon.demo import DemoConfig, run_system

    world_size = WORLD_SIZE.get(kind or "", 2)
    if kind is None:
        spec, onset, total = "clean", 0, steps or 2000
        faults: tuple[Any, ...] = ()
    else:
        spec, onset, total = fault_spec(kind, seed, world_size)
        faults = (parse_fault(spec),)
    receiver = SlackReceiver()
    await receiver.start()
    watch = FiringWatch("bench")
    try:
        with tempfile.TemporaryDirectory(prefix="torshmon-detect-") as tmp:
            config = DemoConfig(
                world_size=world_size,
                steps=total,
                hidden=512,
                layers=3,
                job="bench",
                db=Path(tmp) / "history.db",
                step_sleep_s=step_sleep_s,
                faults=faults,
                linger_s=3.0,
                quiet=True,
            )
            # Look at the alerts every 50 ms: at the default 0.25 s a tick could add two
            # steps of ~115 ms to the step latency it reads.
            result = await run_system(
                config, targets=[SlackTarget(receiver.url)], on_tick=watch, tick_s=0.05
            )
    finally:
        await receiver.stop()
    fault = faults[0] if faults else None
    run = RunResult(kind or "clean", seed, spec, fault.rank if fault else None)
    run.wall_s = result.wall_s
    events: dict[str, float] = dict(result.fault_events)
    for per_rank in result.results:
        events.update({k: v for k, v in per_rank.items() if k.startswith("fault0_")})
    fired = [a for a in result.alerts if a["fired_at_unix_s"] is not None]
    onset_s = events.get("fault0_onset_unix_s")
    expected = EXPECTED.get(kind or "", ())
    symptoms = SYMPTOMS.get(kind or "", ())
    first = None
    wrong_rank = False
    for alert in fired:
        rank = alert["rank"]
        name = f"{alert['rule']}" + (f" (rank {rank})" if rank is not None else "")
        right_rank = fault is None or fault.rank is None or rank == fault.rank
        after_onset = onset_s is not None and alert["fired_at_unix_s"] >= onset_s - 0.5
        if alert["rule"] in expected and after_onset and right_rank:
            run.right_alerts += 1
            if first is None or alert["fired_at_unix_s"] < first["fired_at_unix_s"]:
                first = alert
        elif after_onset and (
            alert["rule"] in symptoms
            or (alert["rule"] in RANK_SYMPTOMS.get(kind or "", ()) and right_rank)
        ):
            run.symptom_alerts.append(name)
        else:
            # another rule, anything before the onset, or the right rule naming the
            # wrong rank
            wrong_rank = wrong_rank or (alert["rule"] in expected and after_onset)
            run.false_alerts.append(name)
    if first is None:
        run.detected = wrong_rank  # caught, but blamed on the wrong rank
        run.named = False if wrong_rank else None
        return run, result.alerts
    assert onset_s is not None
    run.detected = True
    run.named = None if kind in JOB_WIDE else True
    run.latency_s = first["fired_at_unix_s"] - onset_s
    slack = [
        t for t, text in receiver.messages if first["rule"] in text and "FIRING" in text.upper()
    ]
    run.slack_latency_s = min(slack) - onset_s if slack else None
    seen = watch.first_step.get(
        (first["rule"], str(first["rank"]) if first["rank"] is not None else None)
    )
    if seen is not None:
        run.latency_steps = max(0, seen - onset + 1)
    run.resolved = first["state"] == "resolved"
    return run, result.alerts


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 600 clean steps")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per kind (default 3)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--clean-steps", type=int, default=None, help="default 2000")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    clean_steps = args.clean_steps or (600 if args.quick else 2000)
    if os.geteuid() != 0 and "slow-link" in args.kinds:
        print("slow-link needs root (network namespaces); leaving it out", file=sys.stderr)
        args.kinds = [k for k in args.kinds if k != "slow-link"]

    runs: list[RunResult] = []
    for kind in args.kinds:
        for seed in range(seeds):
            run, _ = asyncio.run(run_one(kind, seed))
            runs.append(run)
            print(
                f"{kind:12} seed {seed}: detected={run.detected} named={run.named} "
                f"latency={_fmt(run.latency_s)} s slack={_fmt(run.slack_latency_s)} s "
                f"steps={run.latency_steps} resolved={run.resolved} "
                f"false={run.false_alerts} ({run.wall_s:.0f} s)",
                flush=True,
            )
    clean: RunResult | None = None
    if not args.no_clean:
        clean, _ = asyncio.run(run_one(None, 0, steps=clean_steps))
        print(
            f"clean run of {clean_steps} steps: alerts fired: {clean.false_alerts or 'none'} "
            f"({clean.wall_s:.0f} s)",
            flush=True,
        )

    print()
    print(
        format_table(
            [
                ("kind", lambda r: r.kind),
                ("seed", lambda r: str(r.seed)),
                ("fault", lambda r: r.spec),
                ("detected", lambda r: "yes" if r.detected else "NO"),
                ("named", lambda r: {None: "-", True: "yes", False: "NO"}[r.named]),
                ("latency s", lambda r: _fmt(r.latency_s)),
                ("slack s", lambda r: _fmt(r.slack_latency_s)),
                ("steps", lambda r: "-" if r.latency_steps is None else str(r.latency_steps)),
                ("resolved", lambda r: "yes" if r.resolved else "no"),
                ("false", lambda r: str(len(r.false_alerts))),
                ("symptoms", lambda r: str(len(r.symptom_alerts))),
            ],
            runs,
        )
    )
    detected = [r for r in runs if r.detected]
    with_rank = [r for r in detected if r.named is not None]
    latencies = [r.latency_s for r in detected if r.latency_s is not None]
    slack = [r.slack_latency_s for r in detected if r.slack_latency_s is not None]
    steps = [r.latency_steps for r in detected if r.latency_steps is not None]
    right = sum(r.right_alerts for r in runs)
    false = sum(len(r.false_alerts) for r in runs) + (len(clean.false_alerts) if clean else 0)
    per_kind = {
        kind: {
            "recall": sum(r.detected for r in runs if r.kind == kind)
            / max(1, sum(1 for r in runs if r.kind == kind)),
            "median_latency_s": _median([r.latency_s for r in runs if r.kind == kind]),
            "median_slack_latency_s": _median([r.slack_latency_s for r in runs if r.kind == kind]),
            "median_latency_steps": _median([r.latency_steps for r in runs if r.kind == kind]),
            "resolved": sum(r.resolved for r in runs if r.kind == kind),
        }
        for kind in args.kinds
    }
    summary = {
        "runs": len(runs),
        "seeds": seeds,
        "recall": len(detected) / len(runs) if runs else None,
        "precision": right / (right + false) if right + false else None,
        "attribution": sum(r.named is True for r in with_rank) / len(with_rank)
        if with_rank
        else None,
        "median_latency_steps": _median(steps),
        "median_latency_s": _median(latencies),
        "median_slack_latency_s": _median(slack),
        "worst_latency_s": max(latencies) if latencies else None,
        "worst_slack_latency_s": max(slack) if slack else None,
        "resolved": sum(r.resolved for r in detected),
        "false_alerts_in_fault_runs": sum(len(r.false_alerts) for r in runs),
        "clean_steps": clean_steps if clean else 0,
        "clean_false_alerts": len(clean.false_alerts) if clean else None,
        "clean_alerts": clean.false_alerts if clean else None,
        "per_kind": per_kind,
    }
    print()
    for key in ("recall", "precision", "attribution", "median_latency_steps"):
        print(f"{key}: {summary[key]}")
    print(
        f"latency onset -> alert: median {_fmt(summary['median_latency_s'])} s, worst "
        f"{_fmt(summary['worst_latency_s'])} s; onset -> Slack: median "
        f"{_fmt(summary['median_slack_latency_s'])} s, worst "
        f"{_fmt(summary['worst_slack_latency_s'])} s"
    )
    print(json.dumps(summary))
    return 0


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


if __name__ == "__main__":
    raise SystemExit(main())
