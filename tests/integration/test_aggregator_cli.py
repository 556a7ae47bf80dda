"""The aggregator's command line as a user runs it: real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from torshmon.launch import free_port

pytestmark = pytest.mark.integration

GOOD_RULES = """\
rules:
  - name: Slow Steps
    kind: threshold
    metric: step_duration_seconds
    op: ">"
    value: 2.0
    for: 30s
    severity: warning
"""

BAD_RULES = """\
rules:
  - name: Slow Steps
    kind: threshold
    metric: step_duration_seconds
    op: "=>"
    value: 2.0
"""


def _torshmon(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_rules_check_and_export(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(GOOD_RULES)
    (tmp_path / "bad.yaml").write_text(BAD_RULES)
    done = _torshmon("rules", "check", "good.yaml", cwd=tmp_path)
    assert done.returncode == 0 and "OK: 1 rule" in done.stdout
    done = _torshmon("rules", "check", "bad.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert "bad.yaml:5" in done.stderr and "op" in done.stderr and "'=>'" in done.stderr
    done = _torshmon("rules", "export", "--format", "prometheus", cwd=tmp_path)
    assert done.returncode == 0
    (tmp_path / "exported.yaml").write_text(done.stdout)
    check = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "exported.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "HungCollective" in done.stdout and "Straggler" in done.stdout


def test_db_upgrade_and_query(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    done = _torshmon("db", "upgrade", "--db", url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _torshmon("db", "upgrade", "--db", url, cwd=tmp_path)  # idempotent
    assert done.returncode == 0, done.stderr
    done = _torshmon(
        "query", "--db", url, "--format", "json", "SELECT count(*) AS n FROM steps", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"n": 0}]
    done = _torshmon("query", "--db", url, "DELETE FROM steps", cwd=tmp_path)
    assert done.returncode == 2 and "torshmon query:" in done.stderr
    done = _torshmon(
        "query", "--db", f"sqlite:///{tmp_path / 'missing.db'}", "SELECT 1", cwd=tmp_path
    )
    assert done.returncode == 2 and "no history database" in done.stderr


def test_aggregator_process_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "token").write_text("tok\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torshmon.cli",
            "aggregator",
            "--port",
            str(port),
            "--db",
            f"sqlite:///{tmp_path / 'h.db'}",
            "--token-file",
            str(tmp_path / "token"),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert json.loads(r.read())["status"] == "ok"
                    break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "aggregator did not start"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"torshmon_ingest_batches" in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_aggregator_bad_settings_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(BAD_RULES)
    done = _torshmon("aggregator", "--rules", "bad.yaml", "--port", "0", cwd=tmp_path)
    assert done.returncode == 2 and "bad.yaml:5" in done.stderr
    (tmp_path / "conf.yaml").write_text("prot: 1234\n")
    done = _torshmon("aggregator", "--config", "conf.yaml", cwd=tmp_path)
    assert done.returncode == 2 and "conf.yaml:1: unknown setting 'prot'" in done.stderr
    done = _torshmon("aggregator", "--port", "99999", cwd=tmp_path)
    assert done.returncode == 2 and "port" in done.stderr
