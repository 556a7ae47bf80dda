"""The agent's /metrics: its node, the training processes on it, and its own health.

Training series (steps, loss, collectives) are the aggregator's alone; the agent must
not export them (tests/test_catalogue.py checks the whole name set per daemon).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import wire_factory as wf
from torshmon.agent.metrics import AgentMetrics, AgentState, make_metrics_handler
from torshmon.version import __version__
from torshmon.wire import GpuSample, InterfaceSample, NodeSample, RankProcess

Families = dict[str, Any]


def _node_sample(**changes: Any) -> NodeSample:
    fields: dict[str, Any] = {
        "ts_unix_ns": 1,
        "node": "n1",
        "cpu_utilization_ratio": 0.25,
        "memory_utilization_ratio": 0.5,
        "memory_used_bytes": 8 * 2**30,
        "io_wait_ratio": 0.01,
        "net_rx_bytes_total": 1000,
        "net_tx_bytes_total": 2000,
        "disk_read_bytes_total": 3000,
        "disk_write_bytes_total": 4000,
        "gpus": [
            GpuSample(
                index=0,
                utilization_ratio=0.9,
                memory_used_bytes=5,
                memory_total_bytes=9,
                uuid="GPU-5a1c",
            )
        ],
        "ranks": [
            RankProcess(job="train", rank=0, pid=1000, rss_bytes=123456, cpu_s_total=7.5, gpu=0),
            RankProcess(job="train", rank=1, pid=1001, rss_bytes=654321, cpu_s_total=2.0),
        ],
        "interfaces": [
            InterfaceSample(name="eth0", rx_bytes_total=900, tx_bytes_total=1800),
            InterfaceSample(name="ib0", rx_bytes_total=100, tx_bytes_total=200),
        ],
    }
    return NodeSample(**{**fields, **changes})


def _feed(metrics: AgentMetrics) -> None:
    metrics.observe_node(_node_sample())
    metrics.observe_probes([wf.hello("train", 0, 2), wf.hello("train", 1, 2)])
    metrics.set_agent_state(
        AgentState(
            frames_rejected_total=3,
            probe_connections=2,
            spool_records=7,
            spool_bytes=4096,
            spool_dropped_records_total=1,
            forward_failures_total=4,
            forward_up=True,
        )
    )


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[CollectorRegistry], Any]]:
    runners: list[web.AppRunner] = []

    async def start(registry: CollectorRegistry) -> str:
        app = web.Application()
        app.router.add_get("/metrics", make_metrics_handler(registry))
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/metrics"

    yield start
    for runner in runners:
        await runner.cleanup()


async def _scrape(url: str) -> tuple[str, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return response.headers["Content-Type"], await response.text()


def _parse(text: str) -> Families:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def test_metrics_served_over_http_carry_no_training_series(
    serve: Callable[[CollectorRegistry], Any],
) -> None:
    registry = CollectorRegistry()
    _feed(AgentMetrics(registry, node="n1"))
    content_type, text = await _scrape(await serve(registry))
    assert content_type.startswith("text/plain")
    families = _parse(text)
    for name in ("torshmon_steps", "torshmon_loss", "torshmon_collective_duration_seconds"):
        assert name not in families, name
    types = {name: family.type for name, family in families.items()}
    for counter in (
        "torshmon_network_receive_bytes",
        "torshmon_disk_written_bytes",
        "torshmon_rank_cpu_seconds",
        "torshmon_agent_frames_rejected",
    ):
        assert types[counter] == "counter", counter
    assert types["torshmon_rank_memory_rss_bytes"] == "gauge"
    # No unbounded labels anywhere (pid is one per connected process).
    allowed = {
        "job", "rank", "node", "gpu", "gpu_uuid", "interface", "local_rank", "pid",
        "daemon", "version", "python", "implementation",
        "reason",  # of a GPU's throttling: NVML's nine reasons
    }  # fmt: skip
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample


def test_node_metrics_and_network_per_interface() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    node = {"node": "n1"}
    value = registry.get_sample_value
    assert value("torshmon_cpu_utilization_ratio", node) == 0.25
    assert value("torshmon_memory_utilization_ratio", node) == 0.5
    assert value("torshmon_node_cpu_iowait_ratio", node) == 0.01
    assert value("torshmon_disk_written_bytes_total", node) == 4000
    assert value("torshmon_network_receive_bytes_total", {**node, "interface": "eth0"}) == 900
    assert value("torshmon_network_transmit_bytes_total", {**node, "interface": "ib0"}) == 200
    gpu = {"node": "n1", "gpu": "0"}
    assert value("torshmon_gpu_utilization_ratio", gpu) == 0.9
    assert value("torshmon_gpu_memory_total_bytes", gpu) == 9
    assert value("torshmon_gpu_memory_utilization_ratio", gpu) == 5 / 9
    # A GPU that reports no power or ECC has no such series (absent, not zero).
    assert value("torshmon_gpu_power_watts", gpu) is None
    assert value("torshmon_gpu_ecc_uncorrected_errors_total", gpu) is None
    assert value("torshmon_gpu_xid_errors_total", gpu) == 0

    hot = GpuSample(
        index=0,
        utilization_ratio=1.0,
        memory_used_bytes=8,
        memory_total_bytes=8,
        power_watts=402.5,
        temperature_celsius=91.0,
        throttle_reasons=0x40 | 0x4,
        ecc_uncorrected_errors_total=2,
        xid_errors_total=1,
        last_xid=79,
    )
    metrics.observe_node(_node_sample(gpus=[hot]))
    assert value("torshmon_gpu_power_watts", gpu) == 402.5
    assert value("torshmon_gpu_temperature_celsius", gpu) == 91.0
    throttled = {
        reason
        for reason in ("hw_thermal_slowdown", "sw_power_cap", "hw_slowdown", "gpu_idle")
        if value("torshmon_gpu_throttle_active", {**gpu, "reason": reason}) == 1.0
    }
    assert throttled == {"hw_thermal_slowdown", "sw_power_cap"}
    assert value("torshmon_gpu_ecc_uncorrected_errors_total", gpu) == 2
    assert value("torshmon_gpu_xid_errors_total", gpu) == 1

    metrics.observe_node(_node_sample(gpus=[], interfaces=[]))
    assert value("torshmon_network_receive_bytes_total", {**node, "interface": "eth0"}) is None
    assert value("torshmon_gpu_utilization_ratio", gpu) is None


def test_process_metrics_and_rank_info_name_each_local_rank() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    value = registry.get_sample_value
    rank0 = {"job": "train", "rank": "0", "node": "n1"}
    assert value("torshmon_rank_memory_rss_bytes", rank0) == 123456
    assert value("torshmon_rank_cpu_seconds_total", rank0) == 7.5
    # The agent's own node name, not the probe's; the GPU where NVML saw the pid.
    info = {**rank0, "local_rank": "0", "pid": "1000", "gpu": "0", "gpu_uuid": "GPU-5a1c"}
    assert value("torshmon_rank_info", info) == 1
    info1 = {"job": "train", "rank": "1", "node": "n1", "local_rank": "1", "pid": "1001"}
    assert value("torshmon_rank_info", {**info1, "gpu": "", "gpu_uuid": ""}) == 1
    # A probe gone from the agent is gone from rank_info.
    metrics.observe_probes([wf.hello("train", 1, 2)])
    assert value("torshmon_rank_info", info) is None
    assert value("torshmon_rank_info", {**info1, "gpu": "", "gpu_uuid": ""}) == 1


def test_build_info_names_the_agent() -> None:
    registry = CollectorRegistry()
    AgentMetrics(registry, node="n1")
    labels = {
        "daemon": "agent",
        "version": __version__,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
    }
    assert registry.get_sample_value("torshmon_build_info", labels) == 1


async def test_agent_state_metrics(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    url = await serve(registry)
    families = _parse((await _scrape(url))[1])
    node = {"node": "n1"}
    # Before the daemon reports anything: zeros, and the forward is not up.
    assert registry.get_sample_value("torshmon_agent_forward_up", node) == 0

    _feed(metrics)
    families = _parse((await _scrape(url))[1])
    expected = {
        "torshmon_agent_frames_rejected_total": 3,
        "torshmon_agent_probe_connections": 2,
        "torshmon_agent_spool_records": 7,
        "torshmon_agent_spool_bytes": 4096,
        "torshmon_agent_spool_dropped_records_total": 1,
        "torshmon_agent_forward_failures_total": 4,
        "torshmon_agent_forward_up": 1,
    }
    for name, value in expected.items():
        assert registry.get_sample_value(name, node) == value, name
    assert families["torshmon_agent_frames_rejected"].type == "counter"
    assert families["torshmon_agent_spool_bytes"].type == "gauge"


def test_close_and_independent_registries() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    metrics = AgentMetrics(first, node="a")
    metrics.observe_node(_node_sample(node="a"))
    AgentMetrics(second, node="b")
    assert first.get_sample_value("torshmon_cpu_utilization_ratio", {"node": "a"}) == 0.25
    assert second.get_sample_value("torshmon_cpu_utilization_ratio", {"node": "a"}) is None
    metrics.close()
    metrics.close()
    assert first.get_sample_value("torshmon_cpu_utilization_ratio", {"node": "a"}) is None


async def test_promtool_accepts_exposition(serve: Callable[[CollectorRegistry], Any]) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not on PATH (apt-get install prometheus)"
    registry = CollectorRegistry()
    _feed(AgentMetrics(registry, node="n1"))
    _, text = await _scrape(await serve(registry))
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr
