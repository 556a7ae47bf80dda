"""Two real ``torshmon demo`` launches under one job name: each is its own run, in the
history, the report and ``--compare``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torshmon.history.query import run_query
from torshmon.report import report_from_db

pytestmark = pytest.mark.integration


def _torshmon(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


#: A fault each run alerts on for certain: a 7 s hang of rank 1 at step 10 (a clean small
#: demo may or may not page on its communication wait: stop 53's CI had none).
HANG = "hang:rank=1,from=10,seconds=7"


def _demo(steps: int, cwd: Path) -> None:
    done = _torshmon(
        "demo",
        *("--steps", str(steps), "--hidden", "64", "--layers", "2", "--db", "h.db"),
        *("--inject", HANG),
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr


def test_two_demos_under_one_job_name_are_two_runs(tmp_path: Path) -> None:
    _demo(30, tmp_path)
    _demo(20, tmp_path)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    runs = run_query(url, "SELECT run_id, world_size FROM runs ORDER BY started_unix_ns").rows
    assert len(runs) == 2 and runs[0][0] != runs[1][0]
    assert [r[1] for r in runs] == [2, 2]

    latest = report_from_db(url, "demo")
    first = report_from_db(url, "demo", run=runs[0][0])
    assert latest.run_id == runs[1][0]
    assert [r.run_id for r in latest.runs] == [runs[0][0], runs[1][0]]
    # Each run's own steps: not 50 a rank, and numbered 1..N once (no zig-zag).
    assert {r.rank: r.steps for r in latest.ranks} == {0: 20, 1: 20}
    assert {r.rank: r.steps for r in first.ranks} == {0: 30, 1: 30}
    for series in latest.series:
        assert series.step == tuple(range(1, 21))
    # Each run's own alerts: those that started after its start, none of the other's.
    started = {r.run_id: r.started_unix_s for r in latest.runs}
    assert all(a.starts_at_unix_s >= started[latest.run_id] for a in latest.alerts)
    assert all(a.starts_at_unix_s < started[latest.run_id] for a in first.alerts)
    # Each run's own hang: one Hung Collective naming rank 1 in each.
    for report in (latest, first):
        hangs = [a for a in report.alerts if a.rule == "Hung Collective"]
        assert [a.rank for a in hangs] == [1], report.alerts
    every = run_query(url, "SELECT count(*) FROM alerts").rows[0][0]
    assert len(latest.alerts) + len(first.alerts) == every
    assert not {a.id for a in latest.alerts} & {a.id for a in first.alerts}

    shown = _torshmon("report", "demo", "--db", "h.db", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"run 2 of 2 ({runs[1][0]})" in shown.stdout
    compared = _torshmon(
        "report", "demo", "--db", "h.db", "--run", "1", "--compare", "-1", cwd=tmp_path
    )
    assert compared.returncode == 0, compared.stderr
    (records,) = [line for line in compared.stdout.splitlines() if line.startswith("step records")]
    assert records.split()[-2:] == ["60", "40"]
    unknown = _torshmon("report", "demo", "--db", "h.db", "--run", "9", cwd=tmp_path)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().endswith(f"oldest first: {runs[0][0]}, {runs[1][0]}")
