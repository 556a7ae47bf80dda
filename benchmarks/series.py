"""CPU cost of the aggregator's in-memory series store, side by side with a bare baseline.

The store (``torshmon.aggregator.core.series.SeriesStore``) takes every step metric
of every rank. This script feeds ~10^5 points (256 ranks x 4 step metrics) three
ways, interleaved over rounds so drift in the machine's load hits all arms alike:

- ``bare``: append to two Python lists per series in a dict (what the store cannot
  beat: no windows, no out-of-order rule, no change tracking);
- ``add``: ``SeriesStore.add`` once per point;
- ``add_many``: ``SeriesStore.add_many`` once per rank and step, as ingest calls it.

Prints, per arm, the median and spread (min..max) of the CPU seconds per 10^5
points over the rounds and the ratio of its median to ``bare``'s; the last line
of stdout is one JSON object with the same figures.

Usage::

    python benchmarks/series.py            # 15 rounds, a few seconds
    python benchmarks/series.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import format_table

from torshmon.aggregator.core.series import SeriesStore, labelset

RANKS = 256
METRICS = ("step_duration_seconds", "compute_seconds", "comm_wait_seconds", "loss")
STEPS = 100_000 // (RANKS * len(METRICS)) + 1
POINTS = STEPS * RANKS * len(METRICS)


def run_bare() -> None:
    series: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for step in range(STEPS):
        for rank in range(RANKS):
            for metric in METRICS:
                ts, values = series.setdefault((metric, rank), ([], []))
                ts.append(float(step))
                values.append(1.0)


def run_add() -> None:
    store = SeriesStore()
    ranks = [labelset(job="j", rank=str(rank)) for rank in range(RANKS)]
    for step in range(STEPS):
        for labels in ranks:
            for metric in METRICS:
                store.add(metric, labels, float(step), 1.0)
    assert store.series_count() == RANKS * len(METRICS)


def run_add_many() -> None:
    store = SeriesStore()
    ranks = [labelset(job="j", rank=str(rank)) for rank in range(RANKS)]
    one = {metric: [1.0] for metric in METRICS}
    for step in range(STEPS):
        for labels in ranks:
            store.add_many(labels, [float(step)], one)
    assert store.series_count() == RANKS * len(METRICS)


ARMS: dict[str, Callable[[], None]] = {
    "bare": run_bare,
    "add": run_add,
    "add_many": run_add_many,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    per_1e5: dict[str, list[float]] = {name: [] for name in ARMS}
    names = list(ARMS)
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            started = time.process_time()
            ARMS[name]()
            per_1e5[name].append((time.process_time() - started) * 100_000 / POINTS)
    bare = statistics.median(per_1e5["bare"])
    rows = [
        {
            "arm": name,
            "median_cpu_s_per_1e5": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "ratio_vs_bare": statistics.median(values) / bare,
        }
        for name, values in per_1e5.items()
    ]
    print(f"{POINTS} points ({RANKS} ranks x {len(METRICS)} metrics), {args.rounds} rounds")
    print(
        format_table(
            [
                ("arm", lambda r: str(r["arm"])),
                ("median CPU s / 1e5", lambda r: f"{r['median_cpu_s_per_1e5']:.4f}"),
                ("min..max", lambda r: f"{r['min_s']:.4f}..{r['max_s']:.4f}"),
                ("ratio vs bare", lambda r: f"{r['ratio_vs_bare']:.2f}"),
            ],
            rows,
        )
    )
    print(json.dumps({"points": POINTS, "rounds": args.rounds, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
