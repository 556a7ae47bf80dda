"""An aggregator host: ``pip install 'torshmon[aggregator]'`` in a fresh venv, no torch.

The wheel is built from this checkout and installed with its real dependencies into a
venv of its own (one for the module: about 30 s, most of it unpacking scipy and numpy),
and every command runs from a folder outside the source tree. The daemons, the client
commands and the database tools work; the probe and the demo say in one line that they
need the ``torch`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.venvs import daemon, http_get, make_venv, pip_install, run
from torshmon.launch import free_port
from torshmon.probe import MISSING_TORCH

pytestmark = pytest.mark.integration

RULES = """\
rules:
  - name: Slow Steps
    kind: threshold
    metric: step_duration_seconds
    op: ">"
    value: 2.0
    for: 30s
    severity: warning
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """The ``bin`` folder of a venv holding the wheel and its dependencies, and no torch."""
    work = tmp_path_factory.mktemp("no-torch")
    bin_dir = make_venv(work / "venv")
    pip_install(bin_dir, f"torshmon[aggregator] @ {wheel.as_uri()}")
    yield bin_dir


def test_the_venv_has_the_wheel_and_no_torch(venv: Path, tmp_path: Path) -> None:
    no_torch = run(venv, tmp_path, "python", "-c", "import torch")
    assert no_torch.returncode == 1
    assert "No module named 'torch'" in no_torch.stderr
    where = run(venv, tmp_path, "python", "-c", "import torshmon; print(torshmon.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv.parent)


def test_the_daemons_run_without_torch(venv: Path, tmp_path: Path) -> None:
    """The aggregator and an agent forwarding to it, each answering /healthz."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    (tmp_path / "token").write_text("a-token\n")
    aggregator = [
        "aggregator", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'history.db'}",
        "--token-file", "token",
    ]  # fmt: skip
    agent = [
        "agent", "--socket", str(tmp_path / "agent.sock"), "--spool", "spool.db",
        "--metrics-port", str(metrics_port), "--aggregator", url, "--token-file", "token",
        "--node", "node-a", "--sample-interval-s", "0.5",
    ]  # fmt: skip

    def healthy(base: str) -> bool:
        return bool(json.loads(http_get(f"{base}/healthz"))["status"] == "ok")

    def agent_ready() -> bool:
        return healthy(f"http://127.0.0.1:{metrics_port}") and (tmp_path / "agent.sock").exists()

    with (
        daemon(venv, tmp_path, aggregator, lambda: healthy(url)),
        daemon(venv, tmp_path, agent, agent_ready),
    ):
        families = {f.name for f in text_string_to_metric_families(
            http_get(f"http://127.0.0.1:{metrics_port}/metrics"))}  # fmt: skip
        assert any(name.startswith("torshmon_") for name in families), families
        # The tuning client against the live aggregator: a real request, a one-line answer.
        tune = run(venv, tmp_path, "torshmon", "tune", "--url", url, "--token-file", "token",
                   "no-such-job")  # fmt: skip
        assert tune.returncode == 2
        assert tune.stderr.startswith("torshmon tune:") and "no-such-job" in tune.stderr
        assert len(tune.stderr.strip().splitlines()) == 1, tune.stderr


def test_db_query_rules_and_tune_without_torch(venv: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgraded = run(venv, tmp_path, "torshmon", "db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    query = run(venv, tmp_path, "torshmon", "query", "--db", url, "--format", "json",
                "SELECT count(*) AS n FROM steps")  # fmt: skip
    assert query.returncode == 0, query.stderr
    assert json.loads(query.stdout) == [{"n": 0}]
    (tmp_path / "rules.yaml").write_text(RULES)
    checked = run(venv, tmp_path, "torshmon", "rules", "check", "rules.yaml")
    assert checked.returncode == 0, checked.stderr
    assert "OK: 1 rule" in checked.stdout
    exported = run(venv, tmp_path, "torshmon", "rules", "export", "--format", "prometheus")
    assert exported.returncode == 0, exported.stderr
    assert "Straggler" in exported.stdout
    tune_help = run(venv, tmp_path, "torshmon", "tune", "--help")
    assert tune_help.returncode == 0 and "--max-trials" in tune_help.stdout


def test_the_probe_and_the_demo_say_in_one_line_that_they_need_torch(
    venv: Path, tmp_path: Path
) -> None:
    for code in ("import torshmon.probe", "import torshmon; torshmon.attach"):
        probe = run(venv, tmp_path, "python", "-c", code)
        assert probe.returncode == 1
        # The traceback's last line is the whole story; no chained "During handling" one.
        assert probe.stderr.strip().splitlines()[-1] == f"ImportError: {MISSING_TORCH}"
        assert "During handling" not in probe.stderr
    assert "pip install 'torshmon[torch]'" in MISSING_TORCH
    demo = run(venv, tmp_path, "torshmon", "demo", "--steps", "5")
    assert (demo.returncode, demo.stderr) == (2, f"torshmon demo: {MISSING_TORCH}\n")
    assert not (tmp_path / "torshmon.db").exists()
