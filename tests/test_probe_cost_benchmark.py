"""The probe-cost benchmark (benchmarks/probe_cost.py) runs a real 2-rank job and says,
per arm, what each of the probe's paths cost: every entry point timed once a step, the
thread clock twice where it is on, and the lane forced shut sending nothing urgent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmark_loader import BENCHMARKS


def test_a_short_run_reports_every_part_of_every_arm() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "probe_cost.py"), "--steps", "20", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["model"] == "small" and summary["steps"] == 20
    assert 0 < summary["wrapper_cost_us"] < 50
    assert summary["arms"] == ["lane", "lane_shut", "runqueue"]
    for arm in summary["arms"]:
        ranks = summary[arm]["ranks"]
        assert len(ranks) == 2
        for rank in ranks:
            parts = rank["parts"]
            for entry in ("_enter_step", "_exit_step", "_on_grad", "_on_backward_end"):
                assert parts[entry]["calls_per_step"] == 1.0, (arm, entry)
                assert parts[entry]["cpu_us_per_step"] > 0.0, (arm, entry)
            if arm == "runqueue":
                # Its own clock at the last gradient and the end of backward; at the
                # step's ends the process clock reads the thread's file with the others
                # (runqueue.py): once a step, twice where a step did not follow the last
                # at once.
                assert parts["thread run-queue clock"]["calls_per_step"] == 2.0
                assert 1.0 <= parts["process run-queue clock"]["calls_per_step"] <= 2.0
            assert rank["training_thread_cpu_us_per_step"] >= parts["_exit_step"]["cpu_us_per_step"]
            if arm != "lane_shut":  # the shut lane's may sleep through 20 short steps
                assert rank["shipper_cpu_us_per_step"] > 0.0
    assert summary["lane_shut"]["urgent_share"] == 0.0
    # The default's clocks are closed: each call returns at once, reading no file (the
    # process clock's first system call, on cold caches, is most of what it costs open).
    for closed, read in zip(summary["lane"]["ranks"], summary["runqueue"]["ranks"], strict=True):
        assert (
            closed["parts"]["process run-queue clock"]["cpu_us_per_step"]
            < 0.5 * read["parts"]["process run-queue clock"]["cpu_us_per_step"]
        )
    assert "training thread's CPU in the probe" in done.stdout


def test_entry_points_only_times_no_part_inside_them() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "probe_cost.py"),
            "--steps",
            "10",
            "--rounds",
            "1",
            "--entry-points-only",
            "--arms",
            "lane",
            "lane_shut",
            "runqueue",
            "--calibrate",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["parts_timed"] is False
    assert summary["arms"] == ["lane", "lane_shut", "runqueue", "timers"]
    timers = summary["timers"]["ranks"]
    for arm in summary["arms"]:
        for rank, own in zip(summary[arm]["ranks"], timers, strict=True):
            parts = rank["parts"]
            assert parts["_exit_step"]["calls_per_step"] == 1.0
            assert parts["thread run-queue clock"]["calls_per_step"] == 0.0
            assert parts["_sync_config"]["calls_per_step"] == 0.0
            # Each arm's figure less the timers arm's, rank by rank.
            assert rank["less_timers_cpu_us_per_step"] == pytest.approx(
                rank["training_thread_cpu_us_per_step"] - own["training_thread_cpu_us_per_step"]
            )
    table = done.stdout.split("{")[0]
    assert "run-queue clock" not in table
    assert table.count("the same less the timers' own cost") == 3  # not for timers itself
