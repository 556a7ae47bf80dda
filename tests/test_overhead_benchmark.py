"""The overhead benchmark's verdict (benchmarks/overhead.py): the interval of its paired
ratio over rounds, and what that interval says about the probe's 1.01 target."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.benchmark_loader import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("overhead.py", "overhead_bench")


def _noisy_rounds(rng: random.Random, n: int, cost: float) -> tuple[list[list[float]], ...]:
    """``n`` rounds of 20 steps, each round at its own machine speed (what pairing removes)
    with 8 % noise a step; the probe's steps take ``cost`` times bare's."""
    bare, probe = [], []
    for _ in range(n):
        speed = rng.uniform(0.8, 1.2)
        bare.append([speed * rng.gauss(1.0, 0.08) for _ in range(20)])
        probe.append([cost * speed * rng.gauss(1.0, 0.08) for _ in range(20)])
    return bare, probe


def test_the_interval_holds_the_true_cost_and_narrows_with_rounds(bench: ModuleType) -> None:
    rng = random.Random(3)
    widths = []
    for n in (10, 160):
        bare, probe = _noisy_rounds(rng, n, cost=1.04)
        ratios = bench.round_ratios(probe, bare)
        low, high = bench.ratio_interval(ratios)
        assert low <= statistics.median(ratios) <= high
        assert low <= 1.04 <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2


def test_the_interval_is_reproducible_and_a_point_without_spread(bench: ModuleType) -> None:
    ratios = [1.0, 1.03, 0.98, 1.06, 1.01, 0.99, 1.02]
    assert bench.ratio_interval(ratios) == bench.ratio_interval(list(ratios))
    assert bench.ratio_interval([1.02, 1.02, 1.02]) == (1.02, 1.02)
    assert bench.ratio_interval([1.05]) == (1.05, 1.05)


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(0.99, 1.01, "met"), (1.011, 1.05, "not met"), (0.995, 1.03, "not resolved")],
)
def test_the_verdict_needs_the_whole_interval_on_one_side(
    bench: ModuleType, low: float, high: float, verdict: str
) -> None:
    cell = bench.ConfigStats(
        model="small",
        config="probe",
        median_step_s=0.015,
        round_iqr=0.07,
        ratio=(low + high) / 2,
        ratio_low=low,
        ratio_high=high,
        unpaired_ratio=1.0,
        mean_ratio=1.0,
        cpu_s_per_step=0.02,
        cpu_ratio=1.0,
        steps=1200,
    )
    assert bench.target_verdict(cell) == verdict


def _quick_small_round(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """A real ``overhead.py --quick`` run of one round of the small model, with ``args``:
    the finished process and its summary (the last line of stdout)."""
    command = [sys.executable, str(BENCHMARKS / "overhead.py"), "--quick", "--models", "small"]
    done = subprocess.run(
        [*command, "--rounds", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def test_the_ablations_run_the_probe_with_their_part_changed(bench: ModuleType) -> None:
    """``--ablate``: a real 2-rank round of every config, the ablations among them:
    the shut lane's records all come at a flush, the run-queue ones carry a run-queue
    reading, and the probe's own carry none, as attach's default says (even with the
    environment saying otherwise: the benchmark measures the defaults); none of their
    records is lost."""
    assert bench.parse_args(["--ablate"]).ablate and not bench.parse_args([]).ablate
    configs = (*bench.CONFIGS, *bench.ABLATIONS)
    assert sorted(bench.rotation(1, configs)) == sorted(configs)
    done, summary = _quick_small_round(
        "--ablate", env={**os.environ, "TORSHMON_FAST_LANE": "0", "TORSHMON_CPU_WAIT": "1"}
    )
    assert summary["world_size"] == 2
    for config in bench.ABLATIONS:
        assert summary[f"steps_small_{config}"] == summary["steps_small_probe"] > 0
        assert summary[f"{config}_ratio_small"] > 0
    assert summary["urgent_share_probe_lane_shut"] == 0.0
    assert summary["cpu_wait_share_probe_runqueue"] == 1.0
    assert summary["cpu_wait_share_probe"] == summary["cpu_wait_share_probe_lane_shut"] == 0.0
    # Every record of every config's monitor arrived (warm-up and measured steps, both
    # ranks). Not the run's total: the direct scope measure's 20 000 empty steps a rank
    # may overflow the outbox on a loaded machine (counted as dropped there).
    small = bench.QUICK_PLAN[0]
    for config in ("probe", *bench.ABLATIONS):
        assert summary[f"records_{config}"] == 2 * (small.warmup_steps + small.measured_steps)
    assert "with a run-queue reading" in done.stdout


def test_one_rank_runs_with_its_probe_threads_left_a_core(bench: ModuleType) -> None:
    """``--world-size 1 --pin training-thread``: the rank with a core to spare (as on a
    GPU node): its training thread trains on core 0, its shipper may run on core 1."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--world-size", "0"])
    assert bench.parse_args(["--no-pin"]).pin == "none"
    assert bench.parse_args([]).pin == "rank"
    _, summary = _quick_small_round("--world-size", "1", "--pin", "training-thread")
    assert summary["world_size"] == 1 and summary["pin"] == "training-thread"
    small = bench.QUICK_PLAN[0]
    assert summary["records_probe"] == small.warmup_steps + small.measured_steps
    assert summary["probe_ratio_small"] > 0
