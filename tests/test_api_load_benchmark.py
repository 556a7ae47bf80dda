"""benchmarks/api_load.py: a short run against a real aggregator says what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benchmark_loader import BENCHMARKS

pytestmark = pytest.mark.integration


def test_a_short_run_reports_pages_queries_and_slow_clients() -> None:
    args = ["--seconds", "1", "--header-timeout", "1", "--query-timeout", "20"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "api_load.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["backend"] == "sqlite"
    assert summary["queries_running"] == 4 and summary["queries_refused"] > 0
    assert summary["ingest_failures"] == 0
    latency = summary["latency_ms"]
    assert set(latency) == {
        f"{phase}|{what}"
        for phase in ("0 runaway", "12 runaway")
        for what in (
            "GET /api/v1/jobs",
            "GET /api/v1/jobs/benchjob",
            "GET /",
            "POST ingest",
        )
    }
    # Far under the 20 s statement timeout, whatever the machine's load.
    assert all(0 < figures["max"] < 5000 for figures in latency.values()), latency
    assert summary["slow_clients"] == 150 and summary["held_after_timeout"] == 0
    assert 1.0 <= summary["hold_median_s"] <= summary["hold_max_s"] < 6.0
