"""CPU cost of the live state's step path with the bottleneck-report additions, side by side.

``LiveState.observe`` takes every ingested step (series, detectors, per-rank state).
This script feeds the same steps (64 ranks x 8 batches of 32 steps, one all-reduce
per step) to fresh live states, interleaved over rounds so drift in the machine's
load hits all arms alike:

- ``base``: steps without input wait, z-scores on step time and loss only (as before
  the report's additions);
- ``input_wait``: the same steps carrying ``input_wait_s`` (its series, efficiency
  over the step period, the rank's recent input waits);
- ``z_comm_throughput``: ``input_wait`` plus the z-scores on communication wait and
  throughput (on where a rule names them; the default rules do not);
- ``all``: ``z_comm_throughput`` plus the per-op collective series a rule on
  ``collective_duration_seconds`` turns on;
- ``report``: ``all`` plus one ``findings()`` (every job's bottleneck report) per batch
  round, as the rule evaluation runs it.

Prints, per arm, the median and spread (min..max) of the CPU seconds per 10^4 steps
over the rounds and the ratio of its median to ``base``'s; the last line of stdout is
one JSON object with the same figures.

Measured (7 rounds, shared 2-core box at load ~25): base 1.00, input_wait 1.12,
z_comm_throughput 1.40, all 1.54, report 1.71 (0.26 CPU s per 10^4 steps for base).

Usage::

    python benchmarks/live_observe.py            # 7 rounds, under a minute
    python benchmarks/live_observe.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import format_table

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.stored import Stored
from torshmon.wire import Batch

RANKS = 64
BATCHES = 8
STEPS_PER_BATCH = 32
STEPS = RANKS * BATCHES * STEPS_PER_BATCH
T0 = 1_700_000_000.0


def _batches(input_wait: bool) -> list[list[Batch]]:
    """Per batch round, one batch per rank."""
    hellos = [wf.hello("bench", rank, RANKS) for rank in range(RANKS)]
    rounds = []
    for b in range(BATCHES):
        batches = []
        for h in hellos:
            steps = []
            for i in range(STEPS_PER_BATCH):
                n = b * STEPS_PER_BATCH + i + 1
                step = wf.step(
                    n, duration_s=0.1 + 0.001 * (n % 7), end_unix_ns=int((T0 + n * 0.1) * 1e9)
                )
                if input_wait:
                    step = msgspec.structs.replace(step, input_wait_s=0.01 + 0.001 * (n % 3))
                steps.append(step)
            batches.append(wf.batch(h, b + 1, steps))
        rounds.append(batches)
    return rounds


def _arm(
    input_wait: bool, anomalies: tuple[str, ...], collectives: bool, report: bool
) -> Callable[[], None]:
    data = _batches(input_wait)
    hellos = [wf.hello("bench", rank, RANKS) for rank in range(RANKS)]

    def run() -> None:
        live = LiveState(idle_s=3600.0, anomaly_metrics=anomalies, collective_series=collectives)
        live.observe(Stored(acked_seq=0, hellos=hellos), T0)
        for batches in data:
            live.observe(Stored(acked_seq=0, batches=[(b, "n") for b in batches]), T0)
            if report:
                live.findings(T0)

    return run


DEFAULT_ANOMALIES = ("comm_wait_seconds", "throughput_samples_per_second")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    arms = {
        "base": _arm(False, (), False, False),
        "input_wait": _arm(True, (), False, False),
        "z_comm_throughput": _arm(True, DEFAULT_ANOMALIES, False, False),
        "all": _arm(True, DEFAULT_ANOMALIES, True, False),
        "report": _arm(True, DEFAULT_ANOMALIES, True, True),
    }
    per_1e4: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            started = time.process_time()
            arms[name]()
            per_1e4[name].append((time.process_time() - started) * 10_000 / STEPS)
    base = statistics.median(per_1e4["base"])
    rows = [
        {
            "arm": name,
            "median_cpu_s_per_1e4_steps": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "ratio_vs_base": statistics.median(values) / base,
        }
        for name, values in per_1e4.items()
    ]
    shape = f"{RANKS} ranks x {BATCHES} batches of {STEPS_PER_BATCH}"
    print(f"{STEPS} steps ({shape}), {args.rounds} rounds")
    print(
        format_table(
            [
                ("arm", lambda r: str(r["arm"])),
                ("median CPU s / 1e4 steps", lambda r: f"{r['median_cpu_s_per_1e4_steps']:.4f}"),
                ("min..max", lambda r: f"{r['min_s']:.4f}..{r['max_s']:.4f}"),
                ("ratio vs base", lambda r: f"{r['ratio_vs_base']:.2f}"),
            ],
            rows,
        )
    )
    print(json.dumps({"steps": STEPS, "rounds": args.rounds, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
