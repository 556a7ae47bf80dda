"""Writes the synthetic straggler scenarios ``straggler_*_synthetic.json`` beside it.

Compute times per step and rank: 0.1 s times a job-wide factor (lognormal, sigma 5 %:
every rank's step shares the input and the machine), a rank's own jitter (lognormal,
sigma 4 %) and now and then a burst (1 % of a rank's steps start 1-3 steps at 1.3-1.8x:
a preempted process). The slow rank's compute is multiplied by the scenario's factor
in its slow steps. Seeded: running it again writes the same files.

    python tests/data/detection/make_stragglers.py
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
#: Steps after the fault ends that the scenario keeps going: room to resolve.
TAIL_STEPS = 60


def _rows(
    seed: int, world: int, steps: int, slow_rank: int | None, slow: list[list[int]], factor: float
) -> list[list[float]]:
    rng = random.Random(seed)
    burst_left = [0] * world
    burst_factor = [1.0] * world
    rows = []
    for step in range(steps):
        common = math.exp(rng.gauss(0.0, 0.05))
        row = []
        for rank in range(world):
            x = 0.1 * common * math.exp(rng.gauss(0.0, 0.04))
            if burst_left[rank] == 0 and rng.random() < 0.01:
                burst_left[rank] = rng.randint(1, 3)
                burst_factor[rank] = rng.uniform(1.3, 1.8)
            if burst_left[rank]:
                burst_left[rank] -= 1
                x *= burst_factor[rank]
            if rank == slow_rank and any(a <= step < b for a, b in slow):
                x *= factor
            row.append(round(x, 6))
        rows.append(row)
    return rows


def _on_off(start: int, on: int, off: int, periods: int) -> list[list[int]]:
    return [[start + i * (on + off), start + i * (on + off) + on] for i in range(periods)]


def scenario(
    name: str,
    description: str,
    *,
    seed: int,
    world: int,
    factor: float,
    slow: list[list[int]],
    slow_rank: int | None = 1,
    steps: int | None = None,
) -> dict[str, Any]:
    end = max((b for _, b in slow), default=0)
    steps = steps if steps is not None else end + TAIL_STEPS
    return {
        "description": description,
        "world_size": world,
        "slow_rank": slow_rank,
        "slowdown": factor,
        "slow_steps": slow,
        "steps": _rows(seed, world, steps, slow_rank, slow, factor),
        "name": name,
    }


SCENARIOS = [
    scenario(
        "steady_1.2x_3_ranks",
        "3 ranks, rank 1 computes 1.2x from step 60 to 180",
        seed=1,
        world=3,
        factor=1.2,
        slow=[[60, 180]],
    ),
    scenario(
        "steady_1.2x_4_ranks",
        "4 ranks, rank 1 computes 1.2x from step 60 to 180",
        seed=2,
        world=4,
        factor=1.2,
        slow=[[60, 180]],
    ),
    scenario(
        "steady_1.4x_3_ranks",
        "3 ranks, rank 1 computes 1.4x from step 60 to 180",
        seed=3,
        world=3,
        factor=1.4,
        slow=[[60, 180]],
    ),
    scenario(
        "steady_1.3x_2_ranks",
        "2 ranks, rank 1 computes 1.3x from step 60 to 180",
        seed=4,
        world=2,
        factor=1.3,
        slow=[[60, 180]],
    ),
    scenario(
        "steady_1.4x_2_ranks",
        "2 ranks, rank 1 computes 1.4x from step 60 to 180",
        seed=5,
        world=2,
        factor=1.4,
        slow=[[60, 180]],
    ),
    scenario(
        "onoff_10_10_1.4x_3_ranks",
        "3 ranks, rank 1 computes 1.4x on and off, 10 steps each, six times from step 60",
        seed=6,
        world=3,
        factor=1.4,
        slow=_on_off(60, 10, 10, 6),
    ),
    scenario(
        "onoff_15_20_1.2x_4_ranks",
        "4 ranks, rank 1 computes 1.2x for 15 steps, then 20 normal, five times from step 60",
        seed=7,
        world=4,
        factor=1.2,
        slow=_on_off(60, 15, 20, 5),
    ),
    scenario(
        "onoff_10_20_1.2x_3_ranks",
        "3 ranks, rank 1 computes 1.2x for 10 steps, then 20 normal, five times from step 60",
        seed=8,
        world=3,
        factor=1.2,
        slow=_on_off(60, 10, 20, 5),
    ),
    scenario(
        "onoff_20_15_1.3x_2_ranks",
        "2 ranks, rank 1 computes 1.3x for 20 steps, then 15 normal, four times from step 60",
        seed=9,
        world=2,
        factor=1.3,
        slow=_on_off(60, 20, 15, 4),
    ),
    scenario(
        "onoff_20_10_1.4x_2_ranks",
        "2 ranks, rank 1 computes 1.4x for 20 steps, then 10 normal, four times from step 60",
        seed=10,
        world=2,
        factor=1.4,
        slow=_on_off(60, 20, 10, 4),
    ),
    scenario(
        "clean_2_ranks",
        "2 ranks, nothing wrong: jitter and bursts only, 1000 steps",
        seed=11,
        world=2,
        factor=1.0,
        slow=[],
        slow_rank=None,
        steps=1000,
    ),
    scenario(
        "clean_3_ranks",
        "3 ranks, nothing wrong: jitter and bursts only, 1000 steps",
        seed=12,
        world=3,
        factor=1.0,
        slow=[],
        slow_rank=None,
        steps=1000,
    ),
    scenario(
        "clean_4_ranks",
        "4 ranks, nothing wrong: jitter and bursts only, 1000 steps",
        seed=13,
        world=4,
        factor=1.0,
        slow=[],
        slow_rank=None,
        steps=1000,
    ),
]


def main() -> None:
    for item in SCENARIOS:
        name = item.pop("name")
        path = HERE / f"straggler_{name}_synthetic.json"
        path.write_text(json.dumps(item, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
