"""``torshmon demo`` as a user runs it: a real command, real ranks, real records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torshmon.agent.receiver import read_messages
from torshmon.wire import Batch

pytestmark = pytest.mark.integration


def _torshmon(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_demo_runs_a_real_job_and_summarises_it(tmp_path: Path) -> None:
    done = _torshmon(
        "demo",
        "--steps",
        "25",
        "--hidden",
        "128",
        "--layers",
        "3",
        "--world-size",
        "3",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "job throughput:" in done.stdout
    assert "DDP buckets:" in done.stdout
    assert "dropped records: 0" in done.stdout
    batches = [m for m in read_messages(tmp_path / "torshmon-demo.jsonl") if isinstance(m, Batch)]
    for rank in range(3):
        steps = [s.step for b in batches if b.rank == rank for s in b.steps]
        assert steps == list(range(1, 26))


def test_demo_rejects_a_bad_flag_clearly(tmp_path: Path) -> None:
    done = _torshmon("demo", "--steps", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert "--steps" in done.stderr and "positive integer" in done.stderr
