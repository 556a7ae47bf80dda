"""An agent host (a training node's sidecar): ``pip install torshmon``, no extra.

The wheel with its base dependencies only, in a venv of its own: the agent runs and
serves /metrics; the aggregator's packages are not there, and the commands that need
them say in one line which extra brings them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.venvs import daemon, http_get, make_venv, pip_install, run
from torshmon.cli import AGGREGATOR_PACKAGES
from torshmon.launch import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("agent-only")
    bin_dir = make_venv(work / "venv")
    pip_install(bin_dir, str(wheel))
    yield bin_dir


def test_none_of_the_aggregators_packages_is_installed(venv: Path, tmp_path: Path) -> None:
    code = (
        "import importlib.util, sys; "
        f"print(sorted(p for p in {sorted(AGGREGATOR_PACKAGES)!r} "
        "if importlib.util.find_spec(p)))"
    )
    done = run(venv, tmp_path, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_agent_runs_and_serves_its_metrics(venv: Path, tmp_path: Path) -> None:
    metrics_port = free_port()
    agent = [
        "agent", "--socket", str(tmp_path / "agent.sock"), "--spool", "spool.db",
        "--metrics-port", str(metrics_port), "--aggregator", f"http://127.0.0.1:{free_port()}",
        "--node", "node-a", "--sample-interval-s", "0.5",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{metrics_port}"

    def ready() -> bool:
        return bool(json.loads(http_get(f"{base}/healthz"))["status"] == "ok")

    with daemon(venv, tmp_path, agent, ready):
        assert "torshmon_cpu_utilization_ratio" in http_get(f"{base}/metrics")


@pytest.mark.parametrize(
    "argv",
    [
        ["aggregator", "--port", "0", "--db", "sqlite:///h.db"],
        ["report", "demo", "--db", "sqlite:///h.db"],
        ["db", "upgrade", "--db", "sqlite:///h.db"],
    ],
    ids=lambda argv: argv[0],
)
def test_commands_that_need_the_aggregator_extra_say_so_in_one_line(
    venv: Path, tmp_path: Path, argv: list[str]
) -> None:
    done = run(venv, tmp_path, "torshmon", *argv)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install 'torshmon[aggregator]'" in lines[0]
    assert "Traceback" not in done.stderr
