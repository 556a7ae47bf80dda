"""A real Prometheus scrapes both daemons with no relabel rule, and every sum is the truth.

``torshmon aggregator`` and ``torshmon agent`` run as the CLI starts them; a 2-rank gloo
DDP job (deploy/train.py under torchrun) trains through the agent until Prometheus has
scraped both ranks' process series, then stops on SIGTERM at a step both ranks agree
on. Prometheus scrapes both daemons every second with a config that has no relabel
rule at all. Once the agent has flushed its spool and stopped, the history database
holds every step, and the sums Prometheus computes over the scraped series must equal
what the job ran (steps, step time, communication wait, compute, collective calls and
bytes, from the history tables). Each series comes from one daemon (only
``torshmon_build_info`` from both, told apart by its ``daemon`` label),
``torshmon_rank_info`` names each rank once, and no network series is a loopback
interface's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from torshmon.launch import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = "/usr/bin/prometheus"
JOB = "sums"
WORLD_SIZE = 2


@contextlib.contextmanager
def process(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A server process, stopped (SIGTERM, then SIGKILL) when the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_for(url: str, log: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as response:
            if response.status == 200:
                return
        if time.monotonic() > deadline:
            pytest.fail(f"{url} not ready after {timeout_s} s; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def scrape_config(tmp: Path, aggregator_port: int, agent_port: int) -> Path:
    """Both daemons, scraped as they are: honor_labels (the training job's `job` label
    wins) and no relabel rule of any kind."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": name,
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
            }
            for name, port in (("aggregator", aggregator_port), ("agent", agent_port))
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def query(prometheus: str, expr: str, at: float) -> list[dict[str, Any]]:
    """The result vector of an instant query at ``at`` (unix seconds)."""
    params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{params}", timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(prometheus: str, expr: str, at: float) -> float:
    result = query(prometheus, expr, at)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def history(db: Path) -> dict[str, float]:
    """What the job ran, as the aggregator stored it."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        steps, step_s, wait_s, compute_s = conn.execute(
            "SELECT count(*), sum(duration_s), sum(comm_wait_s), sum(compute_s) "
            "FROM steps WHERE job = ?",
            (JOB,),
        ).fetchone()
        calls, size = conn.execute(
            "SELECT sum(count), sum(size_bytes) FROM collectives WHERE job = ?", (JOB,)
        ).fetchone()
    return {
        "steps": steps,
        "step_s": step_s or 0.0,
        "wait_s": wait_s or 0.0,
        "compute_s": compute_s or 0.0,
        "calls": calls or 0,
        "bytes": size or 0,
    }


def test_sums_over_both_daemons_without_relabelling_are_the_truth(tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("aggregator", "agent", "prometheus")}
    prometheus = f"http://127.0.0.1:{ports['prometheus']}"
    db = tmp_path / "history.db"
    token = tmp_path / "token"
    token.write_text("sums-token\n")
    token.chmod(0o600)
    socket_path = tmp_path / "agent.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("TORSHMON_AGENT_SOCKET", "TORSHMON_AGENT_SPOOL", "TORSHMON_DB"):
        env.pop(name, None)
    torshmon = [sys.executable, "-m", "torshmon.cli"]
    aggregator = [
        *torshmon, "aggregator",
        "--port", str(ports["aggregator"]),
        "--db", f"sqlite:///{db}",
        "--token-file", str(token),
    ]  # fmt: skip
    agent = [
        *torshmon, "agent",
        "--metrics-port", str(ports["agent"]),
        "--sample-interval-s", "0.5",
        "--aggregator", f"http://127.0.0.1:{ports['aggregator']}",
        "--token-file", str(token),
        "--socket", str(socket_path),
        "--spool", str(tmp_path / "spool.db"),
    ]  # fmt: skip
    prom = [
        PROMETHEUS,
        f"--config.file={scrape_config(tmp_path, ports['aggregator'], ports['agent'])}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
    ]
    logs = {name: tmp_path / f"{name}.log" for name in ("aggregator", "agent", "prometheus")}
    with (
        process(aggregator, logs["aggregator"], env),
        process(prom, logs["prometheus"]),
    ):
        wait_for(f"http://127.0.0.1:{ports['aggregator']}/healthz", logs["aggregator"])
        wait_for(f"{prometheus}/-/ready", logs["prometheus"])
        with process(agent, logs["agent"], env) as agent_process:
            wait_for(f"http://127.0.0.1:{ports['agent']}/metrics", logs["agent"])
            run_job(tmp_path, env, socket_path, prometheus)
            # SIGTERM: the agent forwards what it spooled before it exits.
            agent_process.terminate()
            assert agent_process.wait(30) == 0, tail(logs["agent"])
        with contextlib.closing(sqlite3.connect(tmp_path / "spool.db")) as spool:
            assert spool.execute("SELECT count(*) FROM records").fetchone() == (0,)
        truth = history(db)
        assert truth["steps"] > 0 and truth["steps"] % WORLD_SIZE == 0, truth
        at = wait_for_steps(prometheus, truth["steps"])
        check_sums(prometheus, at, truth)
        check_one_exporter_per_series(prometheus, at)


def run_job(tmp_path: Path, env: dict[str, str], socket_path: Path, prometheus: str) -> None:
    """Train until Prometheus holds both ranks' RSS and rank_info series, check those
    while the ranks live, then stop the job."""
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(WORLD_SIZE),
        str(ROOT / "deploy" / "train.py"),
        "--steps", "0", "--hidden", "32", "--layers", "2", "--sleep-s", "0.01",
        "--bucket-timing",
    ]  # fmt: skip
    job_env = {**env, "TORSHMON_AGENT_SOCKET": str(socket_path), "TORSHMON_JOB": JOB}
    log = tmp_path / "torchrun.log"
    # The agent's series and the aggregator's steps, which check_rank_info joins: the
    # two daemons are scraped apart, and the join was once empty for want of the latter.
    seen = (
        f'count(torshmon_rank_memory_rss_bytes{{job="{JOB}"}}) == {WORLD_SIZE} '
        f'and count(torshmon_rank_info{{job="{JOB}"}}) == {WORLD_SIZE} '
        f'and count(torshmon_steps_total{{job="{JOB}"}}) == {WORLD_SIZE}'
    )
    with log.open("wb") as out:
        torchrun = subprocess.Popen(argv, env=job_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not query(prometheus, seen, time.time()):
            assert torchrun.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no process series in 60 s:\n" + tail(log)
            time.sleep(0.2)
        check_rank_info(prometheus)
        # torchrun itself exits 1 on SIGTERM; its ranks stop at a step both agreed on
        # and flush what they measured (the history shows what they ran).
        torchrun.send_signal(signal.SIGTERM)
        torchrun.wait(60)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait(10)


def check_rank_info(prometheus: str) -> None:
    """Each rank once, with its local rank and pid; a join on (job, rank) finds its node."""
    info = query(prometheus, f'torshmon_rank_info{{job="{JOB}"}}', time.time())
    by_rank = {s["metric"]["rank"]: s["metric"] for s in info}
    assert sorted(by_rank) == ["0", "1"], info
    assert {m["local_rank"] for m in by_rank.values()} == {"0", "1"}
    assert len({m["pid"] for m in by_rank.values()}) == WORLD_SIZE
    joined = query(
        prometheus,
        f'torshmon_steps_total{{job="{JOB}"}} * on (job, rank) group_left (node) '
        f'torshmon_rank_info{{job="{JOB}"}}',
        time.time(),
    )
    assert len(joined) == WORLD_SIZE and all(s["metric"]["node"] for s in joined), joined
    interfaces = query(prometheus, "torshmon_network_receive_bytes_total", time.time())
    assert "lo" not in {s["metric"]["interface"] for s in interfaces}


def wait_for_steps(prometheus: str, steps: float) -> float:
    """A time at which Prometheus's latest scrape of the aggregator holds every step."""
    expr = f'sum by (job) (torshmon_steps_total{{job="{JOB}"}})'
    deadline = time.monotonic() + 20
    while True:
        at = time.time()
        result = query(prometheus, expr, at)
        if result and float(result[0]["value"][1]) >= steps:
            return at
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus never saw {steps} steps: {result}")
        time.sleep(0.2)


def check_sums(prometheus: str, at: float, truth: dict[str, float]) -> None:
    """Sums over ranks, as a dashboard would take them, equal the stored truth: nothing
    counted twice. The aggregator's series come from one snapshot of its state, so
    every counter is as of the same ingests as ``steps_total``."""
    job = f'{{job="{JOB}"}}'

    def total(expr: str) -> float:
        return scalar(prometheus, f"sum by (job) ({expr})", at)

    assert total(f"torshmon_steps_total{job}") == truth["steps"]
    assert total(f"torshmon_step_duration_seconds_count{job}") == truth["steps"]
    for name, key in (
        ("torshmon_step_seconds_total", "step_s"),
        ("torshmon_step_duration_seconds_sum", "step_s"),
        ("torshmon_comm_wait_seconds_total", "wait_s"),
        ("torshmon_compute_seconds_total", "compute_s"),
    ):
        assert math.isclose(total(name + job), truth[key], rel_tol=1e-9), name
    assert truth["calls"] > 0, "the job timed no collective"
    assert total(f"torshmon_collective_duration_seconds_count{job}") == truth["calls"]
    assert total(f"torshmon_collective_bytes_total{job}") == truth["bytes"]
    # Job-level by default: one histogram per (op, pg), not one per rank.
    for series in query(prometheus, f"torshmon_collective_duration_seconds_count{job}", at):
        assert "rank" not in series["metric"], series
    # One RSS series per rank, under one name (the processes are gone now: look back).
    rss = f"count(last_over_time(torshmon_rank_memory_rss_bytes{job}[5m]))"
    assert scalar(prometheus, rss, at) == WORLD_SIZE


def check_one_exporter_per_series(prometheus: str, at: float) -> None:
    """No name is scraped from both daemons, but build_info (one per daemon). Over the
    last 30 s: the agent has exited by ``at``, and once Prometheus's scrape of it failed
    its series are stale at ``at`` (CI saw the agent's names missing so, once)."""
    latest = 'last_over_time({__name__=~"torshmon_.+"}[30s])'
    expr = f"count by (__name__) (count by (__name__, instance) ({latest}))"
    targets = {s["metric"]["__name__"]: float(s["value"][1]) for s in query(prometheus, expr, at)}
    assert "torshmon_steps_total" in targets and "torshmon_cpu_utilization_ratio" in targets
    assert {name for name, n in targets.items() if n > 1} == {"torshmon_build_info"}
    daemons = query(prometheus, "last_over_time(torshmon_build_info[30s])", at)
    assert sorted(s["metric"]["daemon"] for s in daemons) == ["agent", "aggregator"]


def tail(path: Path) -> str:
    try:
        return path.read_text()[-3000:]
    except OSError as exc:
        return f"({exc})"
