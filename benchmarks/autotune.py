"""The autotuner against the full grid and random search, measured like for like.

Per link (``unshaped``; ``shaped``: every rank at ``--rate``, 1 Gbit/s by default;
``hetero4``: 4 ranks, rank 3 at a quarter of ``--rate``; the shaped links run in
network namespaces over tc tbf, ``torshmon.linkshape``) one gloo DDP job (an MLP of
``--hidden`` x ``--layers``, 29.4 MB by default, batch 64 per rank) runs everything
below in one process group, switching configs live with ``mon.request_config``:

1. **Evidence**: a pairwise link check (the probe's ``run_link_check``; the slowest
   link, as the aggregator reads it) and the share of step time not spent computing
   (``no_sync`` steps, no all-reduce, against normal steps at the default config).
2. **Grid**: every config of the benchmark's search space, which is also the space
   every session below searches (``--quick``: a smaller space, stated in the JSON),
   ``--warmup`` steps discarded after each switch, then the median of ``--grid-steps``.
3. **Sessions, interleaved**: the tuner with its prior, the tuner without it
   (``prior=False``) and ``--random`` random searches (``proposer="random"``), each a
   ``TuningSession`` (the state machine the aggregator runs) with the same settings and
   trial budget (``--max-trials``, the baseline included), driven on rank 0 from its
   own step times. They take turns trial by trial, so each meets the same drifts of a
   shared machine. A session's steps and seconds are its own turns'.
4. **Final rounds**: torch's default, every session's final config, the grid's best
   few (its best whose codec the tuner did not reject, and its best of any codec) and,
   when given, the config the tuner reached through the real path, each measured
   again, interleaved over ``--rounds`` rounds (median of per-round medians). Every
   fraction and ratio comes from these rounds: no config is scored by the pass that
   chose it.

Then, for ``shaped`` only (``--real``, on by default), **the real path**:
``torshmon.demo.run_system`` with ``autotune=True`` runs an aggregator (default rules:
straggler, step-time anomaly, link checks), an agent and the job; the session is the
aggregator's own, fed from the probe's step records over the agent. From it: what the
session costs the job (steps and seconds in trials, the worst trial's slowdown) and
``session_alerts``, the alerts that fired while it ran (the Autotune Finished
notification excluded).

Break-even: the session's seconds beyond what its steps would have taken at the
default's step time, divided by what each later step saves at the tuned config; the
steps after the session until the job has won back what it spent on trials (0 when
the session cost nothing, null when the tuned config is not faster).

Prints a table per link; the last line of stdout is one JSON object (keys in ``main``).

The figures are only as good as the machine is quiet: on 2 cores shared with ~35
runnable processes, step times moved 2-3x between neighbouring measurements and every
comparison drowned in it. Run it on a quiet machine.

Usage::

    python benchmarks/autotune.py --quick --hidden 512  # 35 configs, 1 random search;
                                                        # ~10 min per link on 2 busy cores
    python benchmarks/autotune.py                       # 90 configs, 3 random searches
    python benchmarks/autotune.py --links shaped --real-only  # session cost and alerts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import msgspec

from torshmon import linkshape
from torshmon.aggregator.core.localization import localize
from torshmon.aggregator.core.tuner import (
    DEFAULT_CODECS,
    ApplyConfig,
    Decision,
    SearchSpace,
    StepSample,
    Trial,
    TrialConfig,
    TunerSettings,
    TuningSession,
)
from torshmon.demo import DemoConfig, run_system
from torshmon.launch import run_ranks

BATCH_SIZE = 64
#: What torch does out of the box: 25 MB buckets, a 1 MB first bucket, no codec.
TORCH_DEFAULT = TrialConfig(25.0, 1.0, "none")
REJECTED = ("rejected_error", "rejected_loss")
FINISHED_RULE = "Autotune Finished"
LINK_CHECK_BYTES = 4 * 2**20


@dataclass(frozen=True, slots=True)
class Plan:
    hidden: int
    layers: int
    space: SearchSpace
    tuner: TunerSettings
    warmup_steps: int
    grid_steps: int
    final_steps: int
    rounds: int
    finalists: int
    random_sessions: int
    seed: int
    #: False (hetero4): no grid and no baselines, only the tuner against the default.
    compare: bool = True

    def sessions(self) -> list[tuple[str, TunerSettings, int]]:
        """(name, settings, seed) of every session the comparison runs."""
        out = [("tuner", self.tuner, self.seed)]
        if not self.compare:
            return out
        out.append(("tuner_no_prior", _replace(self.tuner, prior=False), self.seed))
        for i in range(self.random_sessions):
            out.append((f"random{i}", _replace(self.tuner, proposer="random"), self.seed + i))
        return out


def _replace(settings: TunerSettings, **changes: Any) -> TunerSettings:
    return msgspec.structs.replace(settings, **changes)


def build_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        labels = {"none", "fp16", "powersgd(rank=1)", "powersgd(rank=4)", "topk(ratio=0.001)"}
        labels |= {"topk(ratio=0.01)", "int8"}
        codecs = tuple(c for c in DEFAULT_CODECS if c.label in labels)
        space = SearchSpace(max_bucket_cap_mb=16.0, steps_per_octave=1, codecs=codecs)
        tuner = TunerSettings(
            max_trials=args.max_trials, warmup_steps=2, window_steps=4, windows=4, min_windows=3
        )
    else:
        space = SearchSpace(steps_per_octave=1)
        tuner = TunerSettings(
            max_trials=args.max_trials, warmup_steps=3, window_steps=6, windows=4, min_windows=3
        )
    return Plan(
        hidden=args.hidden,
        layers=args.layers,
        space=space,
        tuner=tuner,
        warmup_steps=args.warmup,
        grid_steps=args.grid_steps,
        final_steps=args.final_steps,
        rounds=args.rounds,
        finalists=args.finalists,
        random_sessions=args.random,
        seed=args.seed,
    )


# -- the job: every rank runs the same loop, rank 0 decides -----------------------------

STOP, STEP, NO_SYNC, LINK_CHECK = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Switch:
    config: TrialConfig


@dataclass(frozen=True, slots=True)
class Stepped:
    """One of rank 0's steps: its index, the config version it ran with, seconds, loss."""

    step: int
    version: int
    duration_s: float
    loss: float


Action = int | Switch
#: Rank 0's controller: yields actions, is sent each step's ``Stepped`` (a Switch is
#: sent the new config's version; a link check the slowest link, bytes/s).
Controller = Generator[Action, Any, dict[str, Any]]


def job_rank(rank: int, world_size: int, plan: Plan, extra: list[dict[str, Any]]) -> Any:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from torshmon.probe.linkcheck import run_link_check

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(plan.layers):
        layers += [torch.nn.Linear(plan.hidden, plan.hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    target = torch.randn(plan.hidden, plan.hidden, generator=generator) / plan.hidden**0.5
    # No agent: records are dropped (counted). sync_every=1: a request applies next step.
    mon = torshmon.attach(model, job="autotune-bench", agent_socket="/nonexistent", sync_every=1)
    side = dist.new_group(backend="gloo")
    control = torch.zeros(1, dtype=torch.int64)

    def step(no_sync: bool) -> Stepped:
        version = mon.config.version if mon.config is not None else 0
        x = torch.randn(BATCH_SIZE, plan.hidden, generator=generator)
        start = time.perf_counter()
        with mon.step(batch_size=BATCH_SIZE) as scope:
            if no_sync:
                # Compute alone; no update, so that every rank keeps the same model.
                with model.no_sync():
                    loss = torch.nn.functional.mse_loss(model(x), x @ target)
                    loss.backward()
            else:
                loss = torch.nn.functional.mse_loss(model(x), x @ target)
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scope.loss = loss
        duration = time.perf_counter() - start
        return Stepped(mon.steps, version, duration, float(loss.detach()))

    def link_check() -> float | None:
        timings = run_link_check(side, rank, world_size, LINK_CHECK_BYTES, repeats=3)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, [(t.peer, t.size_bytes, t.duration_s) for t in timings])
        pairs: dict[tuple[int, int], float] = {}
        for me, peers in enumerate(gathered):
            for peer, size, seconds in peers:
                pair = (min(me, peer), max(me, peer))
                pairs[pair] = max(pairs.get(pair, 0.0), size / seconds)
        by_rank = localize(world_size, pairs).bandwidth_by_rank
        return min(by_rank.values()) if by_rank else None

    controller = comparison(plan, world_size, extra) if rank == 0 else None
    action: Action = next(controller) if controller is not None else STEP
    result: dict[str, Any] = {}
    try:
        while True:
            reply: Any = None
            if controller is not None:
                while isinstance(action, Switch):
                    version = mon.request_config(**action.config.args())  # type: ignore[arg-type]
                    action = controller.send(version)
                control[0] = action
            dist.broadcast(control, src=0, group=side)
            code = int(control[0])
            if code == STOP:
                break
            reply = link_check() if code == LINK_CHECK else step(no_sync=code == NO_SYNC)
            if controller is not None:
                try:
                    action = controller.send(reply)
                except StopIteration as done:
                    result = done.value
                    action = STOP
        dist.barrier()
    finally:
        mon.close()
    return result


# -- rank 0's controller -------------------------------------------------------------------


@dataclass(slots=True)
class SessionRun:
    """One session of the comparison and what its turns cost."""

    name: str
    session: TuningSession
    pending: Decision | None = None
    steps: int = 0
    seconds: float = 0.0


def comparison(plan: Plan, world_size: int, extra: list[dict[str, Any]]) -> Controller:
    """The whole comparison as rank 0 drives it (see the module docstring)."""
    link = yield LINK_CHECK
    # Compute alone (no all-reduce) against normal steps at the default: communication's
    # share of the step, as the probe's comm wait would show it.
    yield Switch(TORCH_DEFAULT)
    for _ in range(1 + plan.warmup_steps):
        yield STEP
    synced = yield from timed(STEP, plan.grid_steps * 2)
    alone = yield from timed(NO_SYNC, plan.grid_steps * 2)
    compute_s = statistics.median(alone)
    comm_ratio = max(0.0, 1.0 - compute_s / statistics.median(synced))

    note(f"link check: {link or 0:.3g} bytes/s; communication {comm_ratio:.2f} of the step")
    grid = plan.space.grid() if plan.compare else []
    grid_s = []
    for config in grid:
        grid_s.append(statistics.median((yield from measure(config, plan, plan.grid_steps))))
    if grid:
        best = min(range(len(grid)), key=lambda i: grid_s[i])
        note(f"grid: {len(grid)} configs, fastest {grid[best].describe()} at {grid_s[best]:.3f} s")

    runs = [
        SessionRun(name, TuningSession(plan.space, settings, seed=seed))
        for name, settings, seed in plan.sessions()
    ]
    for run in runs:
        run.pending = run.session.start(time.time(), TORCH_DEFAULT, link_bytes_per_s=link)
    while any(not r.session.done for r in runs):
        for run in runs:
            if not run.session.done:
                yield from turn(run, compute_s)
                trial = [t for t in run.session.trials if t.decision is not None][-1]
                note(f"{run.name}: {trial.kind} {trial.config.describe()}: {trial.decision}")

    # The finalists: default, the sessions' configs, the given ones, the grid's best.
    tuner = runs[0].session
    rejected = {t.config.choice.label for t in tuner.trials if t.decision in REJECTED}
    order = sorted(range(len(grid)), key=lambda i: grid_s[i])
    admissible = [i for i in order if grid[i].choice.label not in rejected][: plan.finalists]
    configs: list[TrialConfig] = [TORCH_DEFAULT]
    configs += [grid[i] for i in [*admissible, *order[:1]]]
    configs += [r.session.final_config or TORCH_DEFAULT for r in runs]
    configs += [TrialConfig.from_dict(c) for c in extra]
    finalists = list({c.key(): c for c in configs}.values())
    note(f"final rounds: {len(finalists)} configs x {plan.rounds}")
    final_s: dict[int, list[float]] = {i: [] for i in range(len(finalists))}
    for r in range(plan.rounds):
        shift = r * len(finalists) // plan.rounds
        for k in range(len(finalists)):
            i = (shift + k) % len(finalists)
            final_s[i].append(statistics.median((yield from measure(finalists[i], plan))))
    return {
        "world_size": world_size,
        "link_bytes_per_s": link,
        "comm_ratio": comm_ratio,
        "grid": [c.to_dict() for c in grid],
        "grid_s": grid_s,
        "grid_admissible": admissible,
        "grid_best_any": order[0] if order else None,
        "finalists": [c.to_dict() for c in finalists],
        "final_s": [statistics.median(final_s[i]) for i in range(len(finalists))],
        "sessions": [session_json(r) for r in runs],
    }


def note(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def measure(
    config: TrialConfig, plan: Plan, steps: int | None = None
) -> Generator[Action, Any, list[float]]:
    """Switch to ``config``, discard the switch step and the warm-up, time ``steps``."""
    yield Switch(config)
    for _ in range(1 + plan.warmup_steps):
        yield STEP
    return (yield from timed(STEP, steps or plan.final_steps))


def timed(code: int, count: int) -> Generator[Action, Any, list[float]]:
    """``count`` steps of kind ``code`` (STEP, NO_SYNC): their seconds."""
    out = []
    for _ in range(count):
        stepped: Stepped = yield code
        out.append(stepped.duration_s)
    return out


def turn(run: SessionRun, compute_s: float) -> Generator[Action, Any, None]:
    """One turn of a session: apply its pending config and step until it decides."""
    session, decision = run.session, run.pending
    measured = False
    while isinstance(decision, ApplyConfig):
        if decision.purpose in ("rollback", "restore"):
            # Nothing to measure: another config is switched to right away.
            decision = session.on_applied(-1, 0, time.time())
            continue
        if measured:
            break  # the next config: at this session's next turn
        measured = True
        version = yield Switch(decision.config)
        switched: Stepped = yield STEP  # the config applies at the end of this step
        run.steps += 1
        run.seconds += switched.duration_s
        decision = session.on_applied(version, switched.step + 1, time.time())
        while decision is None and not session.done:
            s: Stepped = yield STEP
            run.steps += 1
            run.seconds += s.duration_s
            sample = StepSample(
                step=s.step,
                config_version=s.version,
                samples_per_s=BATCH_SIZE / s.duration_s,
                duration_s=s.duration_s,
                loss=s.loss,
                comm_wait_s=max(0.0, s.duration_s - compute_s),
            )
            decision = session.on_step(sample, time.time())
    run.pending = decision


def session_json(run: SessionRun) -> dict[str, Any]:
    session = run.session
    return {
        "name": run.name,
        "phase": session.phase,
        "summary": session.summary(),
        "evidence": session._s.evidence,
        "final_config": (session.final_config or TORCH_DEFAULT).to_dict(),
        "trials_used": trials_used(session.trials),
        "rejected": sorted(rejected_codecs(session.trials)),
        "trials": [trial_json(t) for t in session.trials],
        "steps": run.steps,
        "seconds": run.seconds,
    }


def trials_used(trials: Sequence[Trial]) -> int:
    return sum(1 for t in trials if t.kind != "verify" and t.decision is not None)


def rejected_codecs(trials: Sequence[Trial]) -> set[str]:
    return {t.config.choice.label for t in trials if t.decision in REJECTED}


def trial_json(t: Trial) -> dict[str, Any]:
    return {"kind": t.kind, "config": t.config.describe(), "score": t.score, "decision": t.decision}


def run_job(
    plan: Plan, world_size: int, rates: list[str | None] | None, extra: list[dict[str, Any]]
) -> dict[str, Any]:
    args = (plan, extra)
    if rates is None:
        results = run_ranks(job_rank, world_size, *args, timeout_s=3600)
    else:
        with linkshape.LinkShaper(world_size, rates[0]) as shaper:
            for rank, rate in enumerate(rates):
                if rate != rates[0]:
                    shaper.set_rate(rate, rank=rank)
            results = shaper.run_ranks(job_rank, *args, timeout_s=3600)
    out: dict[str, Any] = results[0]
    return out


# -- the real path: aggregator + agent + probe ------------------------------------------


@dataclass(frozen=True, slots=True)
class RealRun:
    session: TuningSession
    alerts: list[dict[str, Any]]
    wall_s: float


def real_path(plan: Plan, rate: str, note: Any) -> RealRun:
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-autotune-") as tmp:
        config = DemoConfig(
            world_size=2,
            steps=100_000,
            hidden=plan.hidden,
            layers=plan.layers,
            batch_size=BATCH_SIZE,
            job="autotune-bench",
            db=Path(tmp) / "history.db",
            quiet=True,
            link_rate=rate,
            autotune=True,
            tune_max_trials=plan.tuner.max_trials,
            timeout_s=3600.0,
        )
        result = asyncio.run(run_system(config, tuner_settings=plan.tuner))
    if result.tuning is None:
        raise RuntimeError("the real path's tuning session never started")
    for t in result.tuning.trials:
        note(f"  real: {t.kind:<8} {t.config.describe():<40} {t.score or 0:>7.0f} {t.decision}")
    return RealRun(result.tuning, result.alerts, result.wall_s)


def session_alerts(run: RealRun) -> list[str]:
    """Alerts that fired while the session ran (its own notification excluded)."""
    trials = run.session.trials
    start = trials[0].started_unix_s
    end = max((t.ended_unix_s or start for t in trials), default=start)
    return sorted(
        f"{a['rule']} (rank {a['rank']})" if a.get("rank") is not None else str(a["rule"])
        for a in run.alerts
        if a["rule"] != FINISHED_RULE
        and a.get("fired_at_unix_s") is not None
        and start <= a["fired_at_unix_s"] <= end + 5.0
    )


def real_cost(run: RealRun) -> dict[str, Any]:
    """Steps and seconds in trials, and the worst trial's slowdown vs the baseline."""
    state = run.session._s
    trials = run.session.trials
    base = trials[0].score
    scores = [t.score for t in trials[1:] if t.score is not None]
    worst = 1.0 - min(scores) / base if base and scores else None
    settings = state.settings
    # Each measured config: the switch step, the warm-up, then its windows.
    steps = sum(1 + settings.warmup_steps + len(t.windows) * settings.window_steps for t in trials)
    return {
        "trials_used": trials_used(trials),
        "steps": steps,
        "seconds": round((state.ended_unix_s or 0.0) - (state.started_unix_s or 0.0), 1),
        "worst_trial_slowdown": None if worst is None else round(max(0.0, worst), 4),
        "final_config": (run.session.final_config or TORCH_DEFAULT).to_dict(),
        "summary": run.session.summary(),
    }


# -- analysis --------------------------------------------------------------------------------


def break_even_steps(steps: int, seconds: float, default_s: float, tuned_s: float) -> int | None:
    """Steps after the session until the job has won back the seconds its trials cost
    beyond the default's step time; 0 if they cost nothing, None if tuning never pays."""
    spent = seconds - steps * default_s
    if spent <= 0:
        return 0
    saving = default_s - tuned_s
    if saving <= 0:
        return None
    return math.ceil(spent / saving)


def fraction(job: dict[str, Any], config: dict[str, Any]) -> float | None:
    """The final-round throughput of ``config`` over the grid's best finalist's (None
    without a grid)."""
    finalists = [TrialConfig.from_dict(c).key() for c in job["finalists"]]
    grid_keys = {TrialConfig.from_dict(c).key() for c in job["grid"]}
    grid_s = [float(s) for k, s in zip(finalists, job["final_s"], strict=True) if k in grid_keys]
    return min(grid_s) / seconds_of(job, config) if grid_s else None


def seconds_of(job: dict[str, Any], config: dict[str, Any]) -> float:
    key = TrialConfig.from_dict(config).key()
    for c, s in zip(job["finalists"], job["final_s"], strict=True):
        if TrialConfig.from_dict(c).key() == key:
            return float(s)
    raise KeyError(f"{config} was not a finalist")


def summarise(job: dict[str, Any]) -> dict[str, Any]:
    """Fractions of the grid's best, ratios to the default, break-even, per session."""
    default_s = seconds_of(job, TORCH_DEFAULT.to_dict())
    out: dict[str, Any] = {
        "link_gbit_s": None if job["link_bytes_per_s"] is None else job["link_bytes_per_s"] * 8e-9,
        "communication_ratio": round(job["comm_ratio"], 3),
        "grid_configs": len(job["grid"]),
        "default_samples_per_s": round(BATCH_SIZE / default_s, 1),
    }
    out["grid_best_any"] = out["grid_best_any_ratio_vs_default"] = None
    if job["grid_best_any"] is not None:
        best_any = job["grid"][job["grid_best_any"]]
        out["grid_best_any"] = TrialConfig.from_dict(best_any).describe()
        out["grid_best_any_ratio_vs_default"] = round(default_s / seconds_of(job, best_any), 4)
    sessions = {}
    for s in job["sessions"]:
        tuned_s = seconds_of(job, s["final_config"])
        part = fraction(job, s["final_config"])
        sessions[s["name"]] = {
            "final_config": TrialConfig.from_dict(s["final_config"]).describe(),
            "trials_used": s["trials_used"],
            "rejected_codecs": s["rejected"],
            "evidence": s["evidence"],
            "fraction_of_grid_best": None if part is None else round(part, 4),
            "ratio_vs_default": round(default_s / tuned_s, 4),
            "steps": s["steps"],
            "seconds": round(s["seconds"], 1),
            "worst_trial_slowdown": worst_slowdown(s["trials"]),
            "break_even_steps": break_even_steps(s["steps"], s["seconds"], default_s, tuned_s),
            "summary": s["summary"],
        }
    out["sessions"] = sessions
    randoms = [v["fraction_of_grid_best"] for k, v in sessions.items() if k.startswith("random")]
    out["random_search_fraction_of_grid_best"] = statistics.median(randoms) if randoms else None
    return out


def worst_slowdown(trials: list[dict[str, Any]]) -> float | None:
    base: float | None = trials[0]["score"] if trials else None
    scores: list[float] = [t["score"] for t in trials[1:] if t["score"] is not None]
    if not base or not scores:
        return None
    return round(max(0.0, 1.0 - min(scores) / base), 4)


def table(link: str, summary: dict[str, Any]) -> str:
    rows = [(name, s) for name, s in summary["sessions"].items()]
    columns: _table.Columns[tuple[str, dict[str, Any]]] = [
        ("session", lambda x: x[0]),
        ("ended on", lambda x: x[1]["final_config"]),
        ("trials", lambda x: str(x[1]["trials_used"])),
        ("of grid best", lambda x: _num(x[1]["fraction_of_grid_best"])),
        ("vs default", lambda x: f"{x[1]['ratio_vs_default']:.3f}x"),
        ("steps", lambda x: str(x[1]["steps"])),
        ("seconds", lambda x: f"{x[1]['seconds']:.0f}"),
        ("break-even", lambda x: str(x[1]["break_even_steps"])),
        ("rejected", lambda x: ", ".join(x[1]["rejected_codecs"]) or "-"),
    ]
    link_text = "unmeasured" if summary["link_gbit_s"] is None else f"{summary['link_gbit_s']:.2f}"
    grid = "no grid"
    if summary["grid_best_any"] is not None:
        grid = (
            f"grid {summary['grid_configs']} configs, best {summary['grid_best_any']} "
            f"({summary['grid_best_any_ratio_vs_default']:.3f}x default)"
        )
    return (
        f"link {link}: link check {link_text} Gbit/s, communication "
        f"{summary['communication_ratio']:.2f} of the step; {grid}\n"
        + _table.format_table(columns, rows)
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller space, 1 random search")
    parser.add_argument("--rate", default="1gbit", help="shaped link rate (default 1gbit)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7, help="default 7: 29.4 MB")
    parser.add_argument("--max-trials", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps after each switch")
    parser.add_argument("--grid-steps", type=int, default=3)
    parser.add_argument("--final-steps", type=int, default=None, help="8 (quick: 5)")
    parser.add_argument("--rounds", type=int, default=None, help="3 (quick: 2)")
    parser.add_argument("--finalists", type=int, default=3, help="grid configs re-measured")
    parser.add_argument("--random", type=int, default=None, help="random searches (3; quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--links",
        default="unshaped,shaped,hetero4",
        help="comma-separated: unshaped, shaped, hetero4 (default all)",
    )
    parser.add_argument("--no-real", dest="real", action="store_false", help="skip the real path")
    parser.add_argument(
        "--real-only", action="store_true", help="only the real path (session cost and alerts)"
    )
    args = parser.parse_args(argv)
    for name, full, short in (("final_steps", 8, 5), ("rounds", 3, 2), ("random", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    links = [link.strip() for link in args.links.split(",") if link.strip()]
    run_real = args.real and ("shaped" in links or args.real_only)
    if args.real_only:
        links = []

    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    ok, why = linkshape.available()
    if not ok:
        note(f"link shaping unavailable ({why}): only the unshaped link runs")
        links = [link for link in links if link == "unshaped"]
    started = time.perf_counter()
    quarter = f"{linkshape.parse_rate(args.rate) // 4}bit"
    real: RealRun | None = None
    if run_real and ok:
        note(f"[real path] autotuning through aggregator + agent + probe at {args.rate} ...")
        real = real_path(plan, args.rate, note)
        note(f"[real path] {real.session.phase}: {real.session.summary()}")
    summaries: dict[str, dict[str, Any]] = {}
    for link in links:
        link_started = time.perf_counter()
        world, rates = {
            "unshaped": (2, None),
            "shaped": (2, [args.rate, args.rate]),
            "hetero4": (4, [args.rate] * 3 + [quarter]),
        }[link]
        extra = []
        if link == "shaped" and real is not None and real.session.final_config is not None:
            extra.append(real.session.final_config.to_dict())
        link_plan = plan if link != "hetero4" else replace(plan, compare=False)
        note(f"[{link}] {world} ranks, sessions {[n for n, _, _ in link_plan.sessions()]} ...")
        job = run_job(link_plan, world, rates, extra)
        summary = summarise(job)
        if extra:
            summary["real_path_fraction_of_grid_best"] = fraction(job, extra[0])
        summary["wall_s"] = round(time.perf_counter() - link_started, 1)
        summaries[link] = summary
        print(table(link, summary), end="\n\n", flush=True)
    print(json.dumps(report(args, plan, summaries, real, time.perf_counter() - started)))
    return 0


def report(
    args: argparse.Namespace,
    plan: Plan,
    summaries: dict[str, dict[str, Any]],
    real: RealRun | None,
    wall_s: float,
) -> dict[str, Any]:
    shaped, unshaped, hetero = (summaries.get(k) for k in ("shaped", "unshaped", "hetero4"))

    def tuner(summary: dict[str, Any] | None, key: str) -> Any:
        return None if summary is None else summary["sessions"]["tuner"][key]

    out: dict[str, Any] = {
        "model_mb": 4 * args.layers * (args.hidden**2 + args.hidden) / 1e6,
        "quick": args.quick,
        "rate": args.rate,
        "space": {
            "bucket_caps_mb": list(plan.space.bucket_values()),
            "codecs": [c.label for c in plan.space.codecs],
        },
        "max_trials": plan.tuner.max_trials,
        "wall_s": round(wall_s, 1),
        "shaped_fraction_of_grid_best": tuner(shaped, "fraction_of_grid_best"),
        "shaped_trials_used": tuner(shaped, "trials_used"),
        "shaped_no_prior_fraction_of_grid_best": (
            None
            if shaped is None
            else shaped["sessions"]["tuner_no_prior"]["fraction_of_grid_best"]
        ),
        "random_search_fraction_of_grid_best": (
            None if shaped is None else shaped["random_search_fraction_of_grid_best"]
        ),
        "shaped_speedup_vs_default": tuner(shaped, "ratio_vs_default"),
        "unshaped_ratio_vs_default": tuner(unshaped, "ratio_vs_default"),
        "hetero4_speedup_vs_default": tuner(hetero, "ratio_vs_default"),
        "break_even_steps": tuner(shaped, "break_even_steps"),
        "session_alerts": None,
        "links": summaries,
    }
    if real is not None:
        out["session_alerts"] = session_alerts(real)
        out["real_path"] = real_cost(real)
        if shaped is not None and "real_path_fraction_of_grid_best" in shaped:
            out["real_path"]["fraction_of_grid_best"] = shaped["real_path_fraction_of_grid_best"]
    return out


if __name__ == "__main__":
    sys.exit(main())
