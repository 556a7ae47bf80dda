"""The autotuner against an exhaustive grid and random search, on a 2-rank gloo DDP job.

Per link (unshaped, then ``--rate``, 1 Gbit/s by default, over namespaced tbf-shaped
veths):

1. **Autotune**, through the real path: ``torshmon.demo.run_system`` runs an
   aggregator, an agent and the demo job (an MLP of ``--hidden`` x ``--layers``,
   29.4 MB by default) with ``autotune=True``; the aggregator's TuningManager pushes
   configs as commands, the probe applies them by consensus, the session decides from
   rank 0's step records. Reports trials used and the config the job ended on.
2. **Grid**, in one long job with the same model (no restarts): every config of the
   tuner's search space on a grid of one bucket cap per doubling (1..256 MB) x every
   codec choice, plus torch's default and the tuned config, switched with
   ``mon.request_config``; after each switch ``--warmup`` steps are discarded, then
   the median of ``--grid-steps`` steps (the job's step: rank 0's wall time of a
   synchronous step) scores the config. The grid's best few, the default and the
   tuned config are then measured again, interleaved over ``--rounds`` rounds (median
   of per-round medians), so the final ratios compare configs measured side by side.
   When the session left the job alone, the tuned config IS the default: it is measured
   once and its ratio to the default is 1 by definition.
3. **Random search** with the same budget as the tuner's trials, on the grid's
   measurements: ``--draws`` times, draw that many distinct grid configs and keep the
   best scored; its fraction of the grid's best (both from the grid pass), median over
   draws.

Guardrails: the tuner rejects a codec choice whose measured relative error exceeds its
bound or whose loss degrades. The grid is timed only, so "grid best"
(``*_fraction_of_grid_best``, random search too) is the best grid config whose codec
choice the tuner did NOT reject in that link's session: codecs the tuner never tried
count as admissible, which can only make the target harder. The unconstrained grid
best is reported beside it (``*_fraction_of_unconstrained_grid_best``); with the default
bounds (none on PowerSGD and top-k) the two are usually the same.

Prints a table per link; the last line of stdout is one JSON object with
``shaped_fraction_of_grid_best``, ``shaped_trials_used``,
``random_search_fraction_of_grid_best``, ``unshaped_ratio_vs_default``,
``shaped_speedup_vs_default`` and the details. Without link shaping (not root, no
iproute2) only the unshaped link runs and the shaped keys are null.

Usage::

    python benchmarks/autotune.py --quick   # ~3.5 min: 6 trials, 5 caps x 6 codecs, 2 rounds
    python benchmarks/autotune.py           # ~8 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path

from torshmon import linkshape
from torshmon.aggregator.core.tuner import (
    DEFAULT_CODECS,
    SearchSpace,
    TrialConfig,
    TunerSettings,
    TuningSession,
)
from torshmon.demo import DemoConfig, run_system
from torshmon.launch import run_ranks

WORLD_SIZE = 2
BATCH_SIZE = 64
UNSHAPED = "unshaped"
#: What torch does out of the box: 25 MB buckets, a 1 MB first bucket, no codec.
TORCH_DEFAULT = TrialConfig(25.0, 1.0, "none")
REJECTED = ("rejected_error", "rejected_loss")


@dataclass(frozen=True, slots=True)
class Plan:
    hidden: int
    layers: int
    max_trials: int
    tuner: TunerSettings
    grid: tuple[TrialConfig, ...]
    warmup_steps: int
    grid_steps: int
    final_steps: int
    rounds: int
    finalists: int
    draws: int


def build_plan(args: argparse.Namespace) -> Plan:
    space = SearchSpace()
    caps = space.bucket_values(1)
    codecs = DEFAULT_CODECS
    if args.quick:
        caps = caps[::2]  # 1, 4, 16, 64, 256
        labels = {"none", "fp16", "bf16", "powersgd(rank=4)", "topk(ratio=0.01)", "int8"}
        codecs = tuple(c for c in codecs if c.label in labels)
    grid = tuple(space.make_config(cap, choice, None) for cap in caps for choice in codecs)
    tuner = (
        TunerSettings(max_trials=args.max_trials, warmup_steps=3, window_steps=6, windows=4)
        if args.quick
        else TunerSettings(max_trials=args.max_trials)
    )
    return Plan(
        hidden=args.hidden,
        layers=args.layers,
        max_trials=args.max_trials,
        tuner=tuner,
        grid=grid,
        warmup_steps=args.warmup,
        grid_steps=args.grid_steps,
        final_steps=args.final_steps,
        rounds=args.rounds,
        finalists=args.finalists,
        draws=args.draws,
    )


# -- 1. the autotuner, through aggregator + agent + probe -------------------------------


@dataclass(frozen=True, slots=True)
class Tuned:
    phase: str
    summary: str
    trials_used: int
    final: TrialConfig
    rejected: frozenset[str]  # codec choice labels the guardrails rejected
    wall_s: float


def autotune(plan: Plan, rate: str | None, note: Any) -> Tuned:
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-autotune-") as tmp:
        config = DemoConfig(
            world_size=WORLD_SIZE,
            steps=100_000,
            hidden=plan.hidden,
            layers=plan.layers,
            batch_size=BATCH_SIZE,
            job="autotune-bench",
            db=Path(tmp) / "history.db",
            quiet=True,
            link_rate=rate,
            autotune=True,
            tune_max_trials=plan.max_trials,
            timeout_s=1800.0,
        )
        result = asyncio.run(run_system(config, tuner_settings=plan.tuner))
    session = result.tuning
    if session is None:
        raise RuntimeError("the tuning session never started")
    _print_session(session, note)
    final = session.final_config or session.baseline or TORCH_DEFAULT
    used = sum(1 for t in session.trials if t.kind != "verify" and t.decision is not None)
    rejected = frozenset(t.config.choice.label for t in session.trials if t.decision in REJECTED)
    return Tuned(session.phase, session.summary(), used, final, rejected, result.wall_s)


def _print_session(session: TuningSession, note: Any) -> None:
    for t in session.trials:
        score = f"{t.score:.0f}" if t.score is not None else "-"
        note(f"  {t.kind:<8} {t.config.describe():<40} {score:>6} {session.unit} {t.decision}")


# -- 2. the grid, in one long job -------------------------------------------------------


def grid_rank(
    rank: int, world_size: int, plan: Plan, extra: tuple[TrialConfig, ...], admissible: list[bool]
) -> dict[str, Any]:
    """Every grid config once, then the finalists interleaved; rank 0's step seconds."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(plan.layers):
        layers += [torch.nn.Linear(plan.hidden, plan.hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    target = torch.randn(plan.hidden, plan.hidden, generator=generator) / plan.hidden**0.5
    # No agent: records are dropped (counted). sync_every=1: a request applies next step.
    mon = torshmon.attach(model, job="autotune-grid", agent_socket="/nonexistent", sync_every=1)

    def step() -> float:
        x = torch.randn(BATCH_SIZE, plan.hidden, generator=generator)
        start = time.perf_counter()
        with mon.step(batch_size=BATCH_SIZE) as scope:
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scope.loss = loss
        return time.perf_counter() - start

    def measure(config: TrialConfig, steps: int) -> float:
        if rank == 0:
            mon.request_config(**config.args())  # type: ignore[arg-type]
        step()  # the switch happens at the end of this step, on every rank
        for _ in range(plan.warmup_steps):
            step()
        return statistics.median(step() for _ in range(steps))

    configs = list(plan.grid) + list(extra)
    try:
        grid_s = [measure(c, plan.grid_steps) for c in configs]
        # Finalists: the default, the extra configs, and the grid's best admissible and
        # unconstrained configs, chosen by rank 0 (its step times decide) and broadcast.
        chosen: list[Any] = [None]
        if rank == 0:
            n = len(plan.grid)
            order = sorted(range(n), key=lambda i: grid_s[i])
            best = [i for i in order if admissible[i]][: plan.finalists] + order[:1]
            chosen = [sorted({*best, *range(n, len(configs))})]
        dist.broadcast_object_list(chosen, src=0)
        finalists: list[int] = chosen[0]
        final_s: dict[int, list[float]] = {i: [] for i in finalists}
        for r in range(plan.rounds):
            shift = r * len(finalists) // plan.rounds
            for k in range(len(finalists)):
                i = finalists[(shift + k) % len(finalists)]
                final_s[i].append(measure(configs[i], plan.final_steps))
        dist.barrier()
    finally:
        mon.close()
    return {"grid_s": grid_s, "final_s": final_s}


def run_grid(
    plan: Plan, rate: str | None, extra: tuple[TrialConfig, ...], admissible: list[bool]
) -> dict[str, Any]:
    args = (plan, extra, admissible)
    if rate is None:
        results = run_ranks(grid_rank, WORLD_SIZE, *args, timeout_s=1800)
    else:
        with linkshape.LinkShaper(WORLD_SIZE, rate) as shaper:
            results = shaper.run_ranks(grid_rank, *args, timeout_s=1800)
    out: dict[str, Any] = results[0]
    return out


# -- 3. analysis -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkResult:
    link: str
    tuned: Tuned
    default_sps: float
    tuned_sps: float
    grid_best: TrialConfig
    grid_best_sps: float
    unconstrained_best: TrialConfig
    unconstrained_best_sps: float
    random_fraction: float
    grid_s: list[float]
    wall_s: float

    @property
    def fraction_of_grid_best(self) -> float:
        return self.tuned_sps / self.grid_best_sps

    @property
    def ratio_vs_default(self) -> float:
        return self.tuned_sps / self.default_sps


def samples_per_s(step_s: float) -> float:
    return WORLD_SIZE * BATCH_SIZE / step_s


def random_search(
    scores: Sequence[float], admissible: Sequence[bool], budget: int, draws: int
) -> float:
    """Median over ``draws`` of (best of ``budget`` distinct admissible configs) / best."""
    pool = [s for s, ok in zip(scores, admissible, strict=True) if ok]
    best = max(pool)
    rng = random.Random(0)
    fractions = [max(rng.sample(pool, min(budget, len(pool)))) / best for _ in range(draws)]
    return statistics.median(fractions)


def run_link(plan: Plan, rate: str | None, note: Any) -> LinkResult:
    link = rate or UNSHAPED
    started = time.perf_counter()
    note(f"[{link}] autotuning (max {plan.max_trials} trials) ...")
    tuned = autotune(plan, rate, note)
    note(f"[{link}] session {tuned.phase} in {tuned.wall_s:.0f} s: {tuned.summary}")
    admissible = [c.choice.label not in tuned.rejected for c in plan.grid]
    # A session that left the job alone ends on the default itself: one config, measured
    # once (two slots of one config differ by noise alone, up to 6 % seen unshaped).
    unchanged = tuned.final.key() == TORCH_DEFAULT.key()
    extra = (TORCH_DEFAULT,) if unchanged else (TORCH_DEFAULT, tuned.final)
    note(f"[{link}] grid: {len(plan.grid)} configs + finalists x {plan.rounds} rounds ...")
    grid = run_grid(plan, rate, extra, admissible)
    n = len(plan.grid)
    final = {int(i): statistics.median(v) for i, v in grid["final_s"].items()}
    configs = list(plan.grid) + list(extra)
    grid_final = [i for i in final if i < n]
    best_adm = min((i for i in grid_final if admissible[i]), key=lambda i: final[i])
    best_any = min(grid_final, key=lambda i: final[i])
    scores = [samples_per_s(s) for s in grid["grid_s"][:n]]
    return LinkResult(
        link=link,
        tuned=tuned,
        default_sps=samples_per_s(final[n]),
        tuned_sps=samples_per_s(final[n if unchanged else n + 1]),
        grid_best=configs[best_adm],
        grid_best_sps=samples_per_s(final[best_adm]),
        unconstrained_best=configs[best_any],
        unconstrained_best_sps=samples_per_s(final[best_any]),
        random_fraction=random_search(scores, admissible, tuned.trials_used, plan.draws),
        grid_s=grid["grid_s"],
        wall_s=time.perf_counter() - started,
    )


def table(plan: Plan, r: LinkResult) -> str:
    rows = [
        ("torch default", TORCH_DEFAULT, r.default_sps),
        (f"autotuned ({r.tuned.trials_used} trials)", r.tuned.final, r.tuned_sps),
        ("grid best (admissible)", r.grid_best, r.grid_best_sps),
        ("grid best (any codec)", r.unconstrained_best, r.unconstrained_best_sps),
    ]
    columns: _table.Columns[tuple[str, TrialConfig, float]] = [
        ("what", lambda x: x[0]),
        ("config", lambda x: x[1].describe()),
        ("samples/s", lambda x: f"{x[2]:.0f}"),
        ("vs default", lambda x: f"{x[2] / r.default_sps:.3f}x"),
        ("vs grid best", lambda x: f"{x[2] / r.grid_best_sps:.3f}"),
    ]
    return (
        f"link {r.link}: {r.wall_s:.0f} s; rejected by the guardrails: "
        f"{', '.join(sorted(r.tuned.rejected)) or 'none'}; random search "
        f"({r.tuned.trials_used} of {len(plan.grid)} grid configs): "
        f"{r.random_fraction:.3f} of the grid best\n" + _table.format_table(columns, rows)
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 trials, 30 grid configs")
    parser.add_argument("--rate", default="1gbit", help="shaped link rate (default 1gbit)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7, help="default 7: 29.4 MB")
    parser.add_argument("--max-trials", type=int, default=None, help="12 (quick: 6)")
    parser.add_argument("--warmup", type=int, default=3, help="steps after each switch")
    parser.add_argument("--grid-steps", type=int, default=None, help="5 (quick: 3)")
    parser.add_argument("--final-steps", type=int, default=None, help="10 (quick: 6)")
    parser.add_argument("--rounds", type=int, default=None, help="3 (quick: 2)")
    parser.add_argument("--finalists", type=int, default=3, help="grid configs re-measured")
    parser.add_argument("--draws", type=int, default=2000, help="random search draws")
    parser.add_argument("--links", choices=("both", "unshaped", "shaped"), default="both")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (
        ("max_trials", 12, 6),
        ("grid_steps", 5, 3),
        ("final_steps", 10, 6),
        ("rounds", 3, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = build_plan(args)

    def note(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    ok, why = linkshape.available()
    rates: list[str | None] = []
    if args.links in ("both", "unshaped"):
        rates.append(None)
    if args.links in ("both", "shaped"):
        if ok:
            rates.append(args.rate)
        else:
            note(f"link shaping unavailable ({why}): the shaped link is skipped")
    started = time.perf_counter()
    results = {r.link: r for r in (run_link(plan, rate, note) for rate in rates)}
    for r in results.values():
        print(table(plan, r), end="\n\n")
    unshaped, shaped = results.get(UNSHAPED), results.get(args.rate)
    out: dict[str, Any] = {
        "model_mb": 4 * args.layers * (args.hidden**2 + args.hidden) / 1e6,
        "quick": args.quick,
        "rate": args.rate,
        "max_trials": plan.max_trials,
        "grid_configs": len(plan.grid),
        "wall_s": round(time.perf_counter() - started, 1),
        "shaped_fraction_of_grid_best": None,
        "shaped_trials_used": None,
        "random_search_fraction_of_grid_best": None,
        "unshaped_ratio_vs_default": None,
        "shaped_speedup_vs_default": None,
    }
    if shaped is not None:
        out.update(
            shaped_fraction_of_grid_best=round(shaped.fraction_of_grid_best, 4),
            shaped_trials_used=shaped.tuned.trials_used,
            random_search_fraction_of_grid_best=round(shaped.random_fraction, 4),
            shaped_speedup_vs_default=round(shaped.ratio_vs_default, 4),
        )
    if unshaped is not None:
        out["unshaped_ratio_vs_default"] = round(unshaped.ratio_vs_default, 4)
    for r in results.values():
        out[r.link] = {
            "session": r.tuned.phase,
            "summary": r.tuned.summary,
            "trials_used": r.tuned.trials_used,
            "tuned_config": r.tuned.final.to_dict(),
            "left_unchanged": r.tuned.final.key() == TORCH_DEFAULT.key(),
            "rejected_codecs": sorted(r.tuned.rejected),
            "default_samples_per_s": round(r.default_sps, 1),
            "tuned_samples_per_s": round(r.tuned_sps, 1),
            "grid_best_config": r.grid_best.to_dict(),
            "grid_best_samples_per_s": round(r.grid_best_sps, 1),
            "fraction_of_grid_best": round(r.fraction_of_grid_best, 4),
            "unconstrained_grid_best_config": r.unconstrained_best.to_dict(),
            "fraction_of_unconstrained_grid_best": round(r.tuned_sps / r.unconstrained_best_sps, 4),
            "random_search_fraction_of_grid_best": round(r.random_fraction, 4),
            "ratio_vs_default": round(r.ratio_vs_default, 4),
            "wall_s": round(r.wall_s, 1),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
