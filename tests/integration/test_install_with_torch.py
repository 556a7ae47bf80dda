"""A training host: torch first, then ``pip install 'torshmon[torch]'`` in a fresh venv.

As the README tells users (and ``scripts/setup`` does): ``pip install torch==2.13.0``
(the local CPU wheel), then the wheel built from this checkout with its ``torch`` extra
under a constraint that pins that torch, so pip never resolves another one. Both are
real installs into a venv of the module's own, no links to the tests' torch (about 80 s
here, half torch, half the other dependencies). Every command runs from a folder
outside the source tree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.venvs import daemon, http_get, make_venv, pip_install, run
from torshmon.launch import free_port

pytestmark = pytest.mark.integration

TORCH = "torch==2.13.0"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """The ``bin`` folder of a venv holding torch 2.13.0 and the wheel with its extra."""
    work = tmp_path_factory.mktemp("with-torch")
    bin_dir = make_venv(work / "venv")
    pip_install(bin_dir, TORCH)
    constraints = work / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    pip_install(bin_dir, "-c", str(constraints), f"torshmon[torch,aggregator] @ {wheel.as_uri()}")
    yield bin_dir


def test_the_wheel_keeps_the_pinned_torch(venv: Path, tmp_path: Path) -> None:
    code = "import torch, torshmon; print(torch.__version__); print(torshmon.__file__)"
    done = run(venv, tmp_path, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    version, where = done.stdout.split()
    assert version.split("+")[0] == "2.13.0"
    assert Path(where).is_relative_to(venv.parent)


def test_db_upgrade_and_the_aggregator(venv: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'history.db'}"
    upgraded = run(venv, tmp_path, "torshmon", "db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    port = free_port()
    (tmp_path / "token").write_text("a-token\n")
    argv = ["aggregator", "--port", str(port), "--db", url, "--token-file", "token"]

    def healthy() -> bool:
        return bool(json.loads(http_get(f"http://127.0.0.1:{port}/healthz"))["status"] == "ok")

    with daemon(venv, tmp_path, argv, healthy):
        assert "torshmon_" in http_get(f"http://127.0.0.1:{port}/metrics")


def test_a_short_demo(venv: Path, tmp_path: Path) -> None:
    """Two gloo ranks for a few steps of a small model, history in ./torshmon.db."""
    demo = run(
        venv, tmp_path, "torshmon", "demo",
        "--steps", "10", "--hidden", "64", "--layers", "2", "--world-size", "2",
        timeout=240,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert f"history: sqlite:///{tmp_path / 'torshmon.db'}" in demo.stdout
    query = run(
        venv, tmp_path, "torshmon", "query", "--db", "torshmon.db",
        "--format", "json", "SELECT rank, count(*) AS n FROM steps GROUP BY rank ORDER BY rank",
    )  # fmt: skip
    assert query.returncode == 0, query.stderr
    assert json.loads(query.stdout) == [{"rank": 0, "n": 10}, {"rank": 1, "n": 10}]
