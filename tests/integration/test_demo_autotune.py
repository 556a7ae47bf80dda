"""``torshmon demo --link-rate R --autotune``: the whole loop on shaped links, and the
``run_system(on_tick=...)`` seam that hands hooks the running LinkShaper."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torshmon.demo import DemoConfig, run_system
from torshmon.history.query import run_query
from torshmon.linkshape import available, parse_rate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shaping() -> None:
    ok, reason = available()
    if not ok:
        pytest.skip(f"link shaping unavailable: {reason}")


def test_demo_link_rate_autotune_runs_the_whole_loop(shaping: None, tmp_path: Path) -> None:
    steps = 3000
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torshmon.cli",
            "demo",
            "--link-rate",
            "1gbit",
            "--autotune",
            "--max-trials",
            "3",
            "--hidden",
            "256",
            "--layers",
            "3",
            "--steps",
            str(steps),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "links: 1gbit per rank" in out
    assert "autotune: baseline none, bucket 25 MB (first 1): measuring" in out
    decided = [
        line for line in out.splitlines() if line.startswith("autotune: ") and " -> " in line
    ]
    assert len(decided) >= 3, out  # the baseline and two trials at least
    assert "autotune: session finished: " in out
    assert "autotune (finished): " in out and "the job ended on " in out
    # The job stopped soon after the session ended, long before its step bound, and
    # both ranks stopped at the same step.
    counts = run_query(
        f"sqlite:///{tmp_path / 'torshmon.db'}",
        "SELECT rank, count(*), max(step) FROM steps GROUP BY rank ORDER BY rank",
    )
    assert len(counts.rows) == 2 and counts.rows[0][1:] == counts.rows[1][1:]
    assert counts.rows[0][2] < steps


def test_demo_rejects_a_bad_link_rate(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torshmon.cli", "demo", "--link-rate", "1gbyte"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid link rate '1gbyte'" in done.stderr


async def test_on_tick_hands_hooks_the_running_shaper(shaping: None, tmp_path: Path) -> None:
    seen: list[tuple[int | None, ...]] = []
    changed_at: list[int] = []

    def tick(aggregator: object, shaper: object) -> None:
        from torshmon.linkshape import LinkShaper

        assert isinstance(shaper, LinkShaper)
        seen.append(shaper.rates_bps)
        if not changed_at:
            shaper.set_rate("100mbit", rank=1)
            changed_at.append(len(seen))

    config = DemoConfig(
        world_size=2,
        steps=60,
        hidden=128,
        layers=2,
        db=tmp_path / "h.db",
        step_sleep_s=0.02,
        link_rate="1gbit",
        quiet=True,
    )
    result = await run_system(config, on_tick=tick, tick_s=0.1)
    assert len(result.results) == 2
    assert seen[0] == (parse_rate("1gbit"), parse_rate("1gbit"))
    assert seen[-1] == (parse_rate("1gbit"), parse_rate("100mbit"))


async def test_a_fault_free_autotune_session_fires_no_alert(tmp_path: Path) -> None:
    """Every trial switches the job's config (new buckets, another codec): its step time
    and memory change with it. The detectors start over after a switch and step time rests
    for the whole session, so a session on a healthy job sets off nothing (it used to
    fire Memory Leak and Step Time Anomaly)."""
    config = DemoConfig(
        world_size=2,
        steps=3000,
        hidden=512,
        layers=3,
        db=tmp_path / "h.db",
        # ~115 ms steps, as real jobs take 0.1-1 s (see test_faults.py): on 2 shared
        # cores the aggregator's own bursts would span several 15 ms steps of one rank.
        # (In the step: a pause between steps is input wait, and leaves 15 ms steps.)
        step_compute_s=0.1,
        autotune=True,
        tune_max_trials=3,
        linger_s=2.0,
        quiet=True,
    )
    result = await run_system(config)
    assert result.tuning is not None and result.tuning.phase == "finished"
    fired = [(a["rule"], a["rank"]) for a in result.alerts if a["fired_at_unix_s"] is not None]
    assert fired == []
