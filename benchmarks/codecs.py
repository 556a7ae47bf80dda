"""Step time of every gradient codec x DDP bucket cap on a 2-rank gloo DDP job, per link.

One rank job per link (unshaped, then ``--rate``, 1 Gbit/s by default, both over
the same namespaced veths when link shaping is available) trains an MLP of
~7.3 M float32 parameters (29 MB) and switches between all configurations
inside that one process group with ``mon.request_config`` (torshmon's live
reconfiguration rebuilds DDP's Reducer in place). Each switch is followed by
warm-up steps that are discarded (the switch step itself, the first step after
a bucket change, which DDP runs with one bucket before it rebuilds its buckets,
and PowerSGD's warm start); then a few steps are timed, wall clock around the
whole step: forward, backward, optimizer and the ``mon.step()`` scope.

Configurations are visited in a rotated order in every round, so drift in the
machine's load hits all of them alike. A configuration's step time is the
median over rounds of the per-round median of the job's step time (the slower
rank's, step by step). ``ratio_vs_default`` is the default's step time over the
configuration's on the same link. Above 1 is faster. The default is what torch
does out of the box (25 MB bucket cap with DDP's 1 MB first bucket, no
compression), set like every other row with ``mon.request_config``. The other
rows use the cap for the first bucket too, as ``DDP(bucket_cap_mb=...)`` does,
so "none at 25 MB" is a row of its own: on this 29 MB model it is one bucket
instead of the default's two.

Prints a table; the last line of stdout is one JSON object with ``rows`` and
``best_shaped_speedup`` (on the shaped link, the ratio of the row the even rounds rank
best, measured on the odd rounds; null when link shaping is unavailable here, in
which case only the unshaped link is run).

Usage::

    python benchmarks/codecs.py --quick   # under a minute
    python benchmarks/codecs.py           # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torshmon
from torshmon import linkshape
from torshmon.launch import run_ranks

WORLD_SIZE = 2
UNSHAPED = "unshaped"

#: Codec choices by name: (torshmon codec, its params). ``powersgd-r1`` is opt-in.
CODEC_CHOICES: dict[str, tuple[str, dict[str, float | int]]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "powersgd": ("powersgd", {"rank": 4}),
    "powersgd-r1": ("powersgd", {"rank": 1}),
    "topk": ("topk", {"ratio": 0.01}),
    "int8": ("int8", {}),
}
DEFAULT_CODECS = ("none", "fp16", "bf16", "powersgd", "topk", "int8")
DEFAULT_CAPS_MB = (1.0, 4.0, 25.0, 100.0)
DEFAULT_CAP_MB = 25.0  # DDP's own, in MiB


# -- what is measured -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CommChoice:
    """One configuration: a codec choice (a CODEC_CHOICES key) and bucket caps in MiB.

    Every configuration, torch's default included, is applied to the running job
    with ``mon.request_config``; the bucket layout depends on the two caps alone.
    ``first_bucket_mb`` None means the same as ``bucket_cap_mb``, as
    ``DDP(bucket_cap_mb=...)`` does.
    """

    choice: str
    bucket_cap_mb: float
    first_bucket_cap_mb: float | None = None

    @property
    def codec(self) -> str:
        return CODEC_CHOICES[self.choice][0]

    @property
    def codec_params(self) -> dict[str, float | int]:
        return dict(CODEC_CHOICES[self.choice][1])

    @property
    def first_bucket_mb(self) -> float:
        return self.bucket_cap_mb if self.first_bucket_cap_mb is None else self.first_bucket_cap_mb

    @property
    def torch_default(self) -> bool:
        return self == TORCH_DEFAULT


# torch's out-of-the-box DDP: a 25 MiB cap with a 1 MiB first bucket, no codec.
TORCH_DEFAULT = CommChoice("none", DEFAULT_CAP_MB, dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a rank needs; picklable, so it crosses the spawn boundary.

    ``widths``: the MLP's layer widths (input first). Each configuration in each
    round runs 1 switch step + ``warmup_steps`` discarded, then ``measured_steps``.
    """

    configs: tuple[CommChoice, ...]
    widths: tuple[int, ...]
    batch_size: int
    rounds: int
    warmup_steps: int
    measured_steps: int
    seed: int


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's step times: ``step_s[config index][round]`` is a list of seconds.

    ``buckets[config index]``: DDP's buckets per step under that config (0 if unknown);
    ``codec_params[config index]``: the codec's params in force, defaults included.
    """

    step_s: dict[int, list[list[float]]]
    buckets: dict[int, int]
    codec_params: dict[int, dict[str, float | int]]
    dropped_records: int


def build_mlp(widths: Sequence[int]) -> nn.Module:
    """Linear layers between consecutive ``widths``, ReLU between them."""
    layers: list[nn.Module] = []
    for index, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def parameter_count(widths: Sequence[int]) -> int:
    return sum(n_in * n_out + n_out for n_in, n_out in itertools.pairwise(widths))


# 1024 -> 2048 -> 2048 -> 512: 7.3 M float32 parameters (29 MB), as in overhead.py.
FULL_WIDTHS = (1024, 2048, 2048, 512)
# 2.6 M parameters (10.5 MB): same shape of job, a third of the traffic.
QUICK_WIDTHS = (1024, 1024, 1024, 512)


# -- the rank side --------------------------------------------------------------------
class _Session:
    """The job's DDP model (torch's defaults) with a monitor attached."""

    def __init__(self, plan: Plan, x: torch.Tensor, y: torch.Tensor) -> None:
        torch.manual_seed(plan.seed)
        self.ddp = DistributedDataParallel(build_mlp(plan.widths))
        self._optimizer = torch.optim.SGD(self.ddp.parameters(), lr=1e-3)
        self._x, self._y, self._batch_size = x, y, plan.batch_size
        # No agent: the probe drops its records (counted), which costs next to nothing.
        # sync_every=1 so a requested config applies at the end of the very next step.
        self.mon = torshmon.attach(
            self.ddp, job="codecs-bench", agent_socket="/nonexistent", sync_every=1
        )

    def step(self) -> float:
        """One training step; wall seconds around all of it, ``mon.step()`` scope included."""
        start = time.perf_counter()
        with self.mon.step(batch_size=self._batch_size) as scope:
            self._optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(self.ddp(self._x), self._y)
            loss.backward()
            self._optimizer.step()
            scope.loss = loss
        return time.perf_counter() - start

    def apply(self, config: CommChoice, is_rank0: bool) -> None:
        """Request ``config`` (rank 0) and run the step at whose end every rank applies it."""
        if is_rank0:
            self.mon.request_config(
                bucket_cap_mb=config.bucket_cap_mb,
                first_bucket_cap_mb=config.first_bucket_mb,
                codec=config.codec,
                codec_params=config.codec_params,
            )
        self.step()

    def close(self) -> int:
        """Detach the monitor; returns the step records it dropped."""
        self.mon.close()
        return self.mon.dropped_records_total


def rank_main(rank: int, world_size: int, plan: Plan) -> RankResult:
    """Measure every config of ``plan`` in one job (every rank runs the same schedule)."""
    generator = torch.Generator().manual_seed(plan.seed + 1 + rank)
    x = torch.randn(plan.batch_size, plan.widths[0], generator=generator)
    y = torch.randn(plan.batch_size, plan.widths[-1], generator=generator)
    step_s: dict[int, list[list[float]]] = {i: [] for i in range(len(plan.configs))}
    buckets: dict[int, int] = {}
    params: dict[int, dict[str, float | int]] = {}
    session = _Session(plan, x, y)
    try:
        for round_index in range(plan.rounds):
            for index in rotation(len(plan.configs), round_index, plan.rounds):
                config = plan.configs[index]
                session.apply(config, rank == 0)
                for _ in range(plan.warmup_steps):
                    session.step()
                params[index] = _check_applied(session.mon.config, config)
                step_s[index].append([session.step() for _ in range(plan.measured_steps)])
                if index not in buckets:
                    buckets[index] = _bucket_count(session.ddp)
        dist.barrier()
    finally:
        dropped = session.close()
    return RankResult(step_s, buckets, params, dropped)


def rotation(count: int, round_index: int, rounds: int) -> list[int]:
    """Config indices in the order of one round: rounds start evenly spread over the list."""
    shift = round_index * count // max(1, rounds)
    return [(shift + i) % count for i in range(count)]


def _check_applied(current: Any, wanted: CommChoice) -> dict[str, float | int]:
    """The codec params in force (defaults filled in); RuntimeError if ``wanted`` is not."""
    if (
        current is None
        or current.codec != wanted.codec
        or current.bucket_cap_mb != wanted.bucket_cap_mb
        or current.first_bucket_cap_mb != wanted.first_bucket_mb
        or any(current.codec_params.get(k) != v for k, v in wanted.codec_params.items())
    ):
        raise RuntimeError(f"config not applied: wanted {wanted}, in force {current}")
    return dict(current.codec_params)


def _bucket_count(ddp: DistributedDataParallel) -> int:
    """Buckets per step after DDP rebuilt them (0 if DDP does not say)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
    except Exception:
        return 0
    return len([s for s in sizes.split(",") if s.strip()])


# -- analysis -------------------------------------------------------------------------
def job_step_s(per_rank: Sequence[RankResult]) -> dict[int, list[list[float]]]:
    """Per config and round, each step's time for the job: its slowest rank's.

    Every rank ran the same schedule, so step i of round r is the same step everywhere.
    """
    first = per_rank[0].step_s
    return {
        index: [
            [max(s) for s in zip(*(r.step_s[index][i] for r in per_rank), strict=True)]
            for i in range(len(rounds))
        ]
        for index, rounds in first.items()
    }


def typical_step_s(rounds: list[list[float]]) -> float:
    """Median over rounds of each round's median step, in seconds.

    A round's median ignores single hiccups; the median across rounds ignores a
    round that ran while the machine was busier.
    """
    return statistics.median(statistics.median(r) for r in rounds)


def round_spread(rounds: list[list[float]]) -> float:
    """(max - min) of the per-round medians over their median: a noise gauge."""
    medians = [statistics.median(r) for r in rounds]
    return (max(medians) - min(medians)) / statistics.median(medians)


@dataclass(frozen=True, slots=True)
class Row:
    """One (link, config) result; the JSON row and the table come from these fields."""

    link: str
    codec: str
    codec_params: dict[str, float | int]
    bucket_cap_mb: float
    first_bucket_mb: float
    torch_default: bool
    step_s: float
    ratio_vs_default: float  # default's step_s / this step_s on the same link: > 1 is faster
    # The same ratio from the even rounds only (which picks the best row) and from the odd
    # rounds only (which measures it): the best of ~25 noisy ratios overstates its row,
    # a ratio from rounds that did not pick it does not.
    ratio_even_rounds: float
    ratio_odd_rounds: float
    round_spread: float
    buckets: int
    steps: int


def link_rows(link: str, plan: Plan, per_rank: Sequence[RankResult]) -> list[Row]:
    """One Row per config of ``plan`` measured on ``link``."""
    job = job_step_s(per_rank)
    default_index = plan.configs.index(TORCH_DEFAULT)
    default_rounds = job[default_index]
    default_s = typical_step_s(default_rounds)

    def half_ratio(rounds: list[list[float]], parity: int) -> float:
        # With a single round both halves are that round.
        mine = rounds[parity::2] or rounds
        theirs = default_rounds[parity::2] or default_rounds
        return typical_step_s(theirs) / typical_step_s(mine)

    rows = []
    for index, config in enumerate(plan.configs):
        rounds = job[index]
        rows.append(
            Row(
                link=link,
                codec=config.codec,
                codec_params=per_rank[0].codec_params[index],
                bucket_cap_mb=config.bucket_cap_mb,
                first_bucket_mb=config.first_bucket_mb,
                torch_default=config.torch_default,
                step_s=typical_step_s(rounds),
                ratio_vs_default=default_s / typical_step_s(rounds),
                ratio_even_rounds=half_ratio(rounds, 0),
                ratio_odd_rounds=half_ratio(rounds, 1),
                round_spread=round_spread(rounds),
                buckets=per_rank[0].buckets.get(index, 0),
                steps=sum(len(r) for r in rounds),
            )
        )
    return rows


def best_row(rows: Sequence[Row], shaped: bool) -> Row | None:
    """The fastest row relative to its link's default, on shaped or unshaped links, as
    the even rounds rank them; report its ``ratio_odd_rounds``, measured on rounds that
    played no part in choosing it."""
    chosen = [r for r in rows if (r.link != UNSHAPED) == shaped]
    return max(chosen, key=lambda r: r.ratio_even_rounds) if chosen else None


def _params_text(params: dict[str, float | int]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(params.items())) or "-"


# The table's columns: header and how each cell is written.
COLUMNS: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("link", lambda r: r.link),
    ("codec", lambda r: r.codec),
    ("params", lambda r: _params_text(r.codec_params)),
    ("cap MB", lambda r: f"{r.bucket_cap_mb:g}"),
    ("1st MB", lambda r: f"{r.first_bucket_mb:g}"),
    ("buckets", lambda r: str(r.buckets or "?")),
    ("step ms", lambda r: f"{r.step_s * 1e3:.1f}"),
    ("ratio", lambda r: f"{r.ratio_vs_default:.3f}"),
    ("even", lambda r: f"{r.ratio_even_rounds:.3f}"),
    ("odd", lambda r: f"{r.ratio_odd_rounds:.3f}"),
    ("spread", lambda r: f"{r.round_spread:.0%}"),
    ("steps", lambda r: str(r.steps)),
)


def format_table(rows: Sequence[Row]) -> str:
    return _table.format_table(COLUMNS, rows)


TABLE_NOTE = (
    "ratio = step time of torch's default on the same link / this step time: > 1 is "
    "faster than the default. The default (first row per link) is torch's own DDP layout: "
    "cap 25 MB, a 1 MB first bucket, codec none. Every row was applied with "
    "mon.request_config; the others use their cap for the first bucket too (1st MB). "
    "spread = (max - min) / median of the per-round medians. MB = MiB, as DDP counts. "
    "even / odd = the ratio from the even / odd rounds alone: the best row is picked on "
    "the even rounds and its speed-up reported from the odd ones, so the noise that "
    "made it look best does not inflate the figure."
)


# -- the command line -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Preset:
    widths: tuple[int, ...]
    codecs: tuple[str, ...]
    caps_mb: tuple[float, ...]
    rounds: int
    warmup_steps: int
    measured_steps: int


QUICK = Preset(QUICK_WIDTHS, ("none", "fp16", "powersgd", "int8"), (1.0, 25.0), 2, 2, 3)
FULL = Preset(FULL_WIDTHS, DEFAULT_CODECS, DEFAULT_CAPS_MB, 4, 3, 5)


def build_plan(args: argparse.Namespace) -> Plan:
    preset = QUICK if args.quick else FULL
    codecs = tuple(args.codecs or preset.codecs)
    caps = tuple(args.caps_mb or preset.caps_mb)
    configs = [CommChoice(codec, cap) for codec in codecs for cap in caps]
    configs.insert(0, TORCH_DEFAULT)  # every ratio is taken against it
    return Plan(
        configs=tuple(configs),
        widths=preset.widths,
        batch_size=args.batch_size,
        rounds=args.rounds or preset.rounds,
        warmup_steps=preset.warmup_steps if args.warmup_steps is None else args.warmup_steps,
        measured_steps=args.steps or preset.measured_steps,
        seed=args.seed,
    )


def measure(
    plan: Plan, links: Sequence[str], rate: str, timeout_s: float, note: Callable[[str], None]
) -> tuple[dict[str, list[RankResult]], str | None]:
    """Run one rank job per link; returns results by link and why shaping was off (or None).

    With shaping, the unshaped run uses the same namespaced veths and bridge as
    the shaped one (only tbf differs); without it, ranks talk over loopback.
    """
    ok, reason = linkshape.available()
    if not ok:
        note(f"link shaping unavailable ({reason}); running the unshaped link only")
        return {UNSHAPED: _run_link(plan, timeout_s, None, note, UNSHAPED)}, reason
    results: dict[str, list[RankResult]] = {}
    with linkshape.LinkShaper(WORLD_SIZE, rate=None) as shaper:
        if "unshaped" in links:
            results[UNSHAPED] = _run_link(plan, timeout_s, shaper, note, UNSHAPED)
        if "shaped" in links:
            shaper.set_rate(rate)
            results[rate] = _run_link(plan, timeout_s, shaper, note, rate)
    return results, None


def _run_link(
    plan: Plan,
    timeout_s: float,
    shaper: linkshape.LinkShaper | None,
    note: Callable[[str], None],
    link: str,
) -> list[RankResult]:
    started = time.perf_counter()
    options: dict[str, Any] = {}
    if shaper is not None:
        options = {
            "netns": shaper.netns_names,
            "rank_env": shaper.rank_env,
            "master_addr": shaper.master_addr,
        }
    results: list[RankResult] = run_ranks(
        rank_main, WORLD_SIZE, plan, timeout_s=timeout_s, **options
    )
    elapsed_s = time.perf_counter() - started
    note(f"link {link}: {len(plan.configs)} configs x {plan.rounds} rounds in {elapsed_s:.0f} s")
    return results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller model, fewer configs (< 1 min)"
    )
    parser.add_argument(
        "--codecs",
        nargs="+",
        choices=sorted(CODEC_CHOICES),
        default=None,
        help=f"codec choices (default: {' '.join(DEFAULT_CODECS)}; powersgd is rank 4)",
    )
    parser.add_argument(
        "--caps-mb",
        nargs="+",
        type=float,
        default=None,
        help=f"bucket caps in MB (default: {' '.join(f'{c:g}' for c in DEFAULT_CAPS_MB)})",
    )
    parser.add_argument("--rate", default="1gbit", help="the shaped link's rate (tc units)")
    parser.add_argument(
        "--links",
        nargs="+",
        choices=("unshaped", "shaped"),
        default=["unshaped", "shaped"],
        help="links to run (default: both)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds per link (override)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per config and round")
    parser.add_argument("--warmup-steps", type=int, default=None, help="discarded after a switch")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit per link's job")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    for cap in args.caps_mb or ():
        if not 0.001 <= cap <= 4096:
            parser.error(f"--caps-mb must be between 0.001 and 4096, got {cap:g}")
    try:
        linkshape.parse_rate(args.rate)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    plan = build_plan(args)
    results, shaping_off = measure(plan, args.links, args.rate, args.timeout_s, print)
    rows = [row for link, per_rank in results.items() for row in link_rows(link, plan, per_rank)]
    best_shaped = best_row(rows, shaped=True)
    best_unshaped = best_row(rows, shaped=False)
    print(TABLE_NOTE)
    print(format_table(rows))
    for label, best in (("shaped", best_shaped), ("unshaped", best_unshaped)):
        if best is not None:
            print(
                f"best {label} ({best.link}): {best.codec} {_params_text(best.codec_params)}, "
                f"cap {best.bucket_cap_mb:g} MB: {best.ratio_odd_rounds:.3f}x the default's speed "
                f"on the held-out (odd) rounds ({best.ratio_even_rounds:.3f}x on the even "
                "rounds that picked it)"
            )
    summary = {
        "rows": [asdict(r) for r in rows],
        # Held out: measured on the odd rounds, the row picked on the even ones.
        "best_shaped_speedup": best_shaped.ratio_odd_rounds if best_shaped else None,
        "best_shaped": asdict(best_shaped) if best_shaped else None,
        "best_unshaped_speedup": best_unshaped.ratio_odd_rounds if best_unshaped else None,
        "link_shaping_unavailable": shaping_off,
        "shaped_rate": args.rate if args.rate in results else None,
        "model_params": parameter_count(plan.widths),
        "model_bytes": parameter_count(plan.widths) * 4,
        "batch_size": plan.batch_size,
        "rounds": plan.rounds,
        "warmup_steps": plan.warmup_steps,
        "measured_steps": plan.measured_steps,
        "probe_dropped_records": sum(r.dropped_records for rs in results.values() for r in rs),
        "quick": bool(args.quick),
        "world_size": WORLD_SIZE,
        "cpus": os.cpu_count(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
