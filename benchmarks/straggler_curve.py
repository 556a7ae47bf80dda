"""The straggler detector's trade-off between delay and false pages, as a curve.

For each page persistence (``page_steps`` slow steps of the last ``page_window_steps``)
and each noise bar (``z_threshold``), over random draws of ``tests/straggler_draws.py``
(development seeds, never the suite's): the share of jobs with a healthy rank paged
(clean 4-rank jobs of 1000 steps and 4-rank jobs with an 8-step burst at 1.5x on one
rank, pooled) and the steps a steady 1.2x straggler at 3 ranks takes to page (median,
95th percentile). docs/detectors/straggler.md has the output of the default run.

    python benchmarks/straggler_curve.py [--draws 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.straggler_draws import Fault, draw, score
from torshmon.aggregator.core.straggler import StragglerSettings

#: Development seeds (the suite's are tests.straggler_draws.TEST_SEEDS).
CLEAN_SEEDS = 5000
BURST_SEEDS = 8000
STEADY_SEEDS = 6000
NEVER = 10**6


def point(settings: StragglerSettings, draws: int) -> tuple[float, int, int]:
    """(false-page share, median and p95 steps to page a 1.2x straggler at 3 ranks)."""
    false = 0
    for seed in range(CLEAN_SEEDS, CLEAN_SEEDS + draws):
        false += bool(any(score(draw(seed, 4, 1000), settings).paged))
    for seed in range(BURST_SEEDS, BURST_SEEDS + draws):
        rows = draw(seed, 4, 400, [Fault(3, 1.5, ((300, 308),))])
        false += bool(any(score(rows, settings).paged))
    delays = []
    for seed in range(STEADY_SEEDS, STEADY_SEEDS + draws):
        seen = score(draw(seed, 3, 240, [Fault(1, 1.2, ((60, 180),))]), settings)
        delays.append(seen.first(1, 60, page=True) or NEVER)
    delays.sort()
    return false / (2 * draws), int(statistics.median(delays)), delays[int(0.95 * draws)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200, help="draws per scenario (200)")
    args = parser.parse_args()
    print("| z_threshold | page_steps / 28 | false pages | steps to page 1.2x (median / p95) |")
    print("|---|---|---|---|")
    for z in (1.6, 2.0, 2.5):
        for page_steps in (10, 12, 14, 16, 18):
            settings = StragglerSettings(z_threshold=z, page_steps=page_steps)
            false, median, p95 = point(settings, args.draws)
            shown = "never" if p95 >= NEVER else str(p95)
            print(f"| {z} | {page_steps} | {100 * false:.2f} % | {median} / {shown} |", flush=True)


if __name__ == "__main__":
    main()
