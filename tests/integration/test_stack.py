"""The shipped monitoring stack against a real demo: Prometheus, Alertmanager, dashboards.

One demo run (aggregator + agent + a 2-rank gloo DDP job with an injected straggler
and a live codec change) is scraped by a real Prometheus using deploy/prometheus.yml
and deploy/torshmon-rules.yml (no relabel rule), with only the targets and intervals
rewritten. Then every PromQL query of every dashboard (template variables substituted
as Grafana does) must parse and return data. The aggregator pushes its alerts to a real
Alertmanager running deploy/alertmanager.yml, which must list the straggler alert
and deliver it to a local stand-in for Slack. deploy/train.py, the job of
docker-compose.yml and the Kubernetes manifest, runs under torchrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.integration.conftest import ReceiverThread
from torshmon.aggregator.notify.targets import AlertmanagerTarget
from torshmon.demo import DemoConfig, run_system
from torshmon.faults import parse_fault

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
SCRAPE_INTERVAL_S = 1
#: Grafana's $__rate_interval for a 1 s scrape interval: max(4 x scrape, interval + scrape).
RATE_INTERVAL = "4s"
#: Dashboard metrics this demo cannot produce: it starts no tuning session. Their panels
#: must parse and run, and must stay empty (data means this list is out of date).
NO_DATA_IN_DEMO = {
    "torshmon_tuner_trials_total": "the demo starts no tuning session",
    "torshmon_tuner_best_score": "the demo starts no tuning session",
    "torshmon_tuner_state": "the demo starts no tuning session",
    "torshmon_node_link_bandwidth_bytes_per_second": "every rank runs on one host: no node "
    "pairs (tests/integration/test_multinode.py checks the series)",
}
#: Metrics that only exist on a node with NVIDIA GPUs (read through NVML).
GPU_METRICS = frozenset(
    {
        "torshmon_gpu_utilization_ratio",
        "torshmon_gpu_memory_used_bytes",
        "torshmon_gpu_memory_total_bytes",
    }
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def server_process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server binary, stopped (SIGTERM, then SIGKILL) when the block ends."""
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


async def wait_ready(session: aiohttp.ClientSession, url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.2)
    pytest.fail(f"{url} not ready after 30 s; log:\n{log.read_text()[-3000:]}")


def prometheus_config(tmp: Path, aggregator_port: int, agent_port: int) -> Path:
    """deploy/prometheus.yml with the test's targets, 1 s intervals and absolute rule paths."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    interval = f"{SCRAPE_INTERVAL_S}s"
    config["global"].update(
        scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval
    )
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    ports = {"torshmon-aggregator": aggregator_port, "torshmon-agent": agent_port}
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        assert len(static["targets"]) == 1, "the shipped config scrapes one target per job"
        static["targets"] = [f"127.0.0.1:{ports[job['job_name']]}"]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def alertmanager_config(tmp: Path, slack_url: str) -> Path:
    """deploy/alertmanager.yml with the Slack URL file pointing at the test's receiver and
    group waits of a second."""
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    url_file = tmp / "slack_webhook_url"
    url_file.write_text(slack_url)
    config["global"]["slack_api_url_file"] = str(url_file)
    for route in [config["route"], *config["route"].get("routes", [])]:
        route["group_wait"] = "1s"
        route["group_interval"] = "1s"
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Observed:
    """What the test saw while the demo ran."""

    alerts: list[dict[str, Any]] = field(default_factory=list)
    slack: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)
    command_sent_at_step: int | None = None
    commands: list[asyncio.Future[Any]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def slack_stand_in(observed: Observed) -> AsyncIterator[str]:
    async def receive(request: web.Request) -> web.Response:
        observed.slack.append(await request.json())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/services/T0/B0/secret", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/services/T0/B0/secret"
    finally:
        await runner.cleanup()


async def watch(
    session: aiohttp.ClientSession,
    observed: Observed,
    urls: dict[str, str],
    done: asyncio.Event,
) -> None:
    """Poll Alertmanager's alerts and take one /metrics snapshot late in the run."""
    while not done.is_set():
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(urls["alertmanager"] + "/api/v2/alerts") as response:
                observed.alerts.extend(await response.json())
        if observed.command_sent_at_step is not None and not observed.metrics:
            # After the codec change, so compression series are in the snapshot.
            await asyncio.sleep(3)
            for name in ("aggregator", "agent"):
                async with session.get(urls[name] + "/metrics") as response:
                    observed.metrics[name] = await response.text()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), 0.5)


def substitute(expr: str, values: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation of every dashboard."""
    found = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        stack = list(board["panels"])
        while stack:
            panel = stack.pop(0)
            stack.extend(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((f"{path.name}: {panel['title']} {target['refId']}", target["expr"]))
        for annotation in board["annotations"]["list"]:
            if "expr" in annotation:
                found.append((f"{path.name}: annotation {annotation['name']}", annotation["expr"]))
    return found


def dashboard_variables() -> dict[str, tuple[str, str]]:
    """Variable name -> (selector, label) of its ``label_values(selector, label)`` query,
    which is the same in every dashboard."""
    variables: dict[str, tuple[str, str]] = {}
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
            assert match is not None, var["definition"]
            query = (match[1], match[2])
            assert variables.setdefault(var["name"], query) == query, var["name"]
    return variables


def sample_names(text: str) -> set[str]:
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def query_range(
    session: aiohttp.ClientSession, prometheus: str, expr: str, start: float, end: float
) -> tuple[str, list[dict[str, Any]], str]:
    """(status, result, error) of a range query with a 1 s step, as Grafana's panels run it."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    async with session.post(prometheus + "/api/v1/query_range", data=params) as response:
        body = await response.json()
    return body["status"], body.get("data", {}).get("result", []), body.get("error", "")


async def label_values(
    session: aiohttp.ClientSession,
    prometheus: str,
    selector: str,
    label: str,
    start: float,
    end: float,
) -> set[str]:
    """Grafana's ``label_values(selector, label)``, through the series API."""
    params = {"match[]": selector, "start": f"{start:.3f}", "end": f"{end:.3f}"}
    async with session.get(prometheus + "/api/v1/series", params=params) as response:
        body = await response.json()
    assert body["status"] == "success", body
    return {series[label] for series in body["data"] if label in series}


async def test_prometheus_dashboards_and_alertmanager_on_a_real_demo(tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("aggregator", "agent", "prometheus", "alertmanager")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    observed = Observed()
    prom_log, am_log = tmp_path / "prometheus.log", tmp_path / "alertmanager.log"
    async with slack_stand_in(observed) as slack_url, aiohttp.ClientSession() as session:
        prom_argv = [
            PROMETHEUS,
            f"--config.file={prometheus_config(tmp_path, ports['aggregator'], ports['agent'])}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
        ]
        am_argv = [
            ALERTMANAGER,
            f"--config.file={alertmanager_config(tmp_path, slack_url)}",
            f"--storage.path={tmp_path / 'am'}",
            f"--web.listen-address=127.0.0.1:{ports['alertmanager']}",
            "--cluster.listen-address=",  # no gossip port: one instance
        ]
        with server_process(prom_argv, prom_log), server_process(am_argv, am_log):
            await wait_ready(session, urls["prometheus"] + "/-/ready", prom_log)
            await wait_ready(session, urls["alertmanager"] + "/-/ready", am_log)
            started = time.time()
            result = await run_demo(session, observed, urls, tmp_path, ports)
            ended = time.time()
            await check_dashboards(session, urls["prometheus"], observed, started, ended)
            await check_one_copy_of_each_series(
                session, urls["prometheus"], observed, started, ended
            )
            await check_alertmanager(observed, result)
    check_metrics_lint(observed)


async def run_demo(
    session: aiohttp.ClientSession,
    observed: Observed,
    urls: dict[str, str],
    tmp_path: Path,
    ports: dict[str, int],
) -> Any:
    def progress(aggregator: Any) -> None:
        summary = aggregator.live.job_summary("demo")
        # Once the straggler is over, switch to fp16 with a smaller bucket cap: the
        # compression panels and the config-change panels get data.
        if summary and summary["last_step"] >= 110 and observed.command_sent_at_step is None:
            observed.command_sent_at_step = summary["last_step"]
            observed.commands.append(
                asyncio.ensure_future(
                    aggregator.dispatch.submit_command(
                        "demo", "config", {"codec": "fp16", "bucket_cap_mb": 4}
                    )
                )
            )

    config = DemoConfig(
        world_size=2,
        steps=220,
        hidden=256,
        layers=3,
        db=tmp_path / "history.db",
        port=ports["aggregator"],
        agent_metrics_port=ports["agent"],
        bucket_timing=True,
        step_sleep_s=0.03,
        linger_s=3.0,
        faults=(parse_fault("straggler:rank=1,slowdown=20,from=40,to=80"),),
        quiet=True,
    )
    done = asyncio.Event()
    watcher = asyncio.create_task(watch(session, observed, urls, done))
    try:
        result = await run_system(
            config,
            targets=[AlertmanagerTarget(urls["alertmanager"], resend_interval_s=2.0)],
            on_progress=progress,
        )
    finally:
        done.set()
        await watcher
    assert observed.command_sent_at_step is not None, "the job never reached step 110"
    for command in observed.commands:
        await command
    assert observed.metrics, "no /metrics snapshot was taken while the job ran"
    return result


async def check_dashboards(
    session: aiohttp.ClientSession, prometheus: str, observed: Observed, start: float, end: float
) -> None:
    variables = dashboard_variables()
    values = {"job": "demo"}
    found: dict[str, set[str]] = {}
    for name in ("job", "node", "rank", "op"):
        selector, label = variables[name]
        found[name] = await label_values(
            session, prometheus, substitute(selector, values), label, start, end
        )
    assert "demo" in found.pop("job")
    assert found["node"] == {socket.gethostname()}, found
    assert found["rank"] == {"0", "1"}, found
    assert "all_reduce" in found["op"], found
    values.update(
        {name: "(" + "|".join(sorted(v)) + ")" for name, v in found.items()},
        __rate_interval=RATE_INTERVAL,
        __interval=f"{SCRAPE_INTERVAL_S}s",
        __range=f"{int(end - start) + 1}s",
    )
    has_gpu = bool(GPU_METRICS & sample_names(observed.metrics["agent"]))
    failures = []
    checked = 0
    for where, template in dashboard_queries():
        expr = substitute(template, values)
        status, result, error = await query_range(session, prometheus, expr, start, end)
        checked += 1
        if status != "success":
            failures.append(f"{where}: {error}\n    {expr}")
            continue
        names = set(re.findall(r"\btorshmon_[a-z0-9_]+", expr))
        if names & NO_DATA_IN_DEMO.keys():
            assert not result, f"{where} has data now: take its metrics off NO_DATA_IN_DEMO"
            continue
        if not has_gpu and names and names <= GPU_METRICS:
            continue  # parsed and ran; there is no GPU to report on this machine
        if not result:
            failures.append(f"{where}: no data\n    {expr}")
    assert checked > 80
    assert not failures, f"{len(failures)} of {checked} queries failed:\n" + "\n".join(failures)


async def check_one_copy_of_each_series(
    session: aiohttp.ClientSession, prometheus: str, observed: Observed, start: float, end: float
) -> None:
    """With the shipped config (no relabel rule) every series Prometheus holds comes from
    one target: only build_info is exported by both daemons, one series each."""
    agent = sample_names(observed.metrics["agent"])
    aggregator = sample_names(observed.metrics["aggregator"])
    assert agent & aggregator == {"torshmon_build_info"}
    assert "torshmon_steps_total" in aggregator and "torshmon_cpu_utilization_ratio" in agent
    names = (agent | aggregator) - {"torshmon_build_info"}
    pattern = "|".join(sorted(names))
    expr = f'count by (__name__) (count by (__name__, instance) ({{__name__=~"{pattern}"}}))'
    status, result, error = await query_range(session, prometheus, expr, start, end)
    assert status == "success", error
    assert {series["metric"]["__name__"] for series in result} == names
    for series in result:
        counts = {float(v) for _, v in series["values"]}
        assert counts == {1.0}, f"{series['metric']['__name__']} comes from {counts} targets"


async def check_alertmanager(observed: Observed, result: Any) -> None:
    fired = [a for a in result.alerts if a["rule"] == "Straggler" and a["fired_at_unix_s"]]
    assert fired, f"the aggregator fired no Straggler alert: {result.alerts}"
    stragglers = [
        a
        for a in observed.alerts
        if a["labels"].get("alertname") == "Straggler" and a["labels"].get("job") == "demo"
    ]
    assert stragglers, "Alertmanager never listed the Straggler alert"
    assert {a["labels"].get("rank") for a in stragglers} >= {"1"}
    assert all(a["labels"]["severity"] == "high" for a in stragglers)
    # Alertmanager delivered it through the shipped Slack receiver, with its templates.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not _slack_about_rank_1(observed.slack):
        await asyncio.sleep(0.5)
    assert _slack_about_rank_1(observed.slack), f"no Slack message on rank 1: {observed.slack}"


def _slack_about_rank_1(messages: list[dict[str, Any]]) -> bool:
    """Whether a message (Alertmanager's Slack attachment) announces rank 1's straggler."""
    for message in messages:
        for attachment in message.get("attachments", []):
            title, text = attachment.get("title", ""), attachment.get("text", "")
            if title.endswith("Straggler in job demo") and "*high* rank 1:" in text:
                return True
    return False


def check_metrics_lint(observed: Observed) -> None:
    for name, text in observed.metrics.items():
        done = subprocess.run(
            ["promtool", "check", "metrics"],
            input=text,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{name} /metrics: {done.stdout}{done.stderr}"


#: How torchrun is started, and the job name the probe then reports: TORSHMON_JOB, else
#: torchrun's run id (--rdzv-id), not "default" (issue 18).
TORCHRUN_NAMING = [
    pytest.param({"TORSHMON_JOB": "compose-demo"}, ["--standalone"], "compose-demo", id="env"),
    pytest.param(
        {},
        ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"],
        "train-42",
        id="run-id",
    ),
]


@pytest.mark.parametrize(("naming", "launch", "job"), TORCHRUN_NAMING)
def test_deploy_train_py_runs_under_torchrun_and_stops_cleanly_on_sigterm(
    receiver: ReceiverThread, tmp_path: Path, naming: dict[str, str], launch: list[str], job: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORSHMON_JOB"}
    env |= {"TORSHMON_AGENT_SOCKET": str(receiver.socket_path), "OMP_NUM_THREADS": "1", **naming}
    if not naming:
        launch = [*launch, "--rdzv-id", job]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launch,
        "--nproc-per-node",
        "2",
        str(DEPLOY / "train.py"),
        "--steps",
        "0",
        "--hidden",
        "32",
        "--layers",
        "2",
        "--sleep-s",
        "0.02",
        "--bucket-timing",
    ]
    log = tmp_path / "torchrun.log"
    with log.open("wb") as out:
        torchrun = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while min(len(receiver.steps(0)), len(receiver.steps(1))) < 25:
            assert torchrun.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no steps within 60 s:\n" + log.read_text()
            time.sleep(0.2)
        torchrun.send_signal(signal.SIGTERM)
        torchrun.wait(60)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait(10)
    hellos = receiver.hellos()
    assert {(h.job, h.rank, h.world_size) for h in hellos} == {(job, 0, 2), (job, 1, 2)}
    # Both ranks stopped at the same agreed step and flushed everything on the way out.
    time.sleep(0.5)
    steps = [[s.step for s in receiver.steps(rank)] for rank in (0, 1)]
    assert steps[0] == steps[1] == list(range(1, len(steps[0]) + 1)), steps
    assert len(steps[0]) % 10 == 0, "ranks stop only at a step both agreed on"
    # The bucket all-reduces are timed, which the collectives dashboard needs.
    assert any(s.collectives for s in receiver.steps(0))
