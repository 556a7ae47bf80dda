"""deploy/multinode/run-node.sh as a user runs it: two "nodes" on this machine (each its
own agent, run folder and node name), torchrun across them with two ranks each, one
aggregator. Every rank's steps arrive once, attributed to its node by both the agent
(``--node``) and the probe (``TORSHMON_NODE``)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_stack import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "multinode" / "run-node.sh"
BIN = Path(sys.executable).parent
STEPS = 30


def _wait_healthy(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return
        except OSError:
            assert proc.poll() is None, "the aggregator exited"
            assert time.monotonic() < deadline, "the aggregator did not start"
            time.sleep(0.2)


def test_two_nodes_with_an_agent_each_under_torchrun(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("multinode-example-token\n")
    port, db = free_port(), tmp_path / "history.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with (tmp_path / "aggregator.log").open("wb") as log:
        aggregator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torshmon.cli",
                "aggregator",
                "--port",
                str(port),
                "--db",
                f"sqlite:///{db}",
                "--token-file",
                str(tmp_path / "token"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        _wait_healthy(port, aggregator)
        master_port = free_port()
        for rank, name in enumerate(("node-a", "node-b")):
            node_env = {
                **env,
                "AGGREGATOR_URL": f"http://127.0.0.1:{port}",
                "TOKEN_FILE": str(tmp_path / "token"),
                "NNODES": "2",
                "NODE_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                "NODE": name,
                "JOB": "example",
                "RUN_DIR": str(tmp_path / name),
                "METRICS_PORT": str(free_port()),  # two agents on one machine
            }
            with (tmp_path / f"{name}.log").open("wb") as log:
                argv = [str(SCRIPT), "--steps", str(STEPS), "--hidden", "64", "--layers", "2"]
                nodes.append(
                    subprocess.Popen(
                        argv,
                        env=node_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=240) for p in nodes]
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("node-*.log")}
        assert codes == [0, 0], logs
        # The agents flushed their spools on SIGTERM before the script returned.
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            steps = conn.execute(
                "SELECT rank, node, COUNT(*), COUNT(DISTINCT step) FROM steps "
                "WHERE job = 'example' GROUP BY rank, node ORDER BY rank"
            ).fetchall()
            hellos = conn.execute(
                "SELECT rank, local_rank, node FROM probe_sessions WHERE job = 'example' "
                "ORDER BY rank"
            ).fetchall()
    finally:
        for node in nodes:
            if node.poll() is None:  # its agent and torchrun with it
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        aggregator.send_signal(signal.SIGTERM)
        aggregator.wait(timeout=30)
    assert steps == [
        (0, "node-a", STEPS, STEPS),
        (1, "node-a", STEPS, STEPS),
        (2, "node-b", STEPS, STEPS),
        (3, "node-b", STEPS, STEPS),
    ], logs
    assert hellos == [(0, 0, "node-a"), (1, 1, "node-a"), (2, 0, "node-b"), (3, 1, "node-b")]
