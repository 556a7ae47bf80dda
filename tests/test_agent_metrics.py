from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import wire_factory as wf
from torshmon.agent.metrics import (
    STEP_DURATION_BUCKETS_S,
    AgentMetrics,
    AgentState,
    make_metrics_handler,
)
from torshmon.labels import MAX_LABEL_VALUES, OTHER, LabelCap
from torshmon.wire import (
    DURATION_BUCKETS_S,
    SCHEMA_VERSION,
    AppliedConfig,
    Batch,
    BucketStat,
    CollectiveStat,
    DdpStats,
    GpuSample,
    InflightOp,
    NodeSample,
    RankProcess,
    StepRecord,
)

#: The DESIGN.md contract metrics an agent without GPUs can know.
CONTRACT = (
    "torshmon_communication_time_ratio",
    "torshmon_memory_utilization_ratio",
    "torshmon_io_wait_time_ratio",
    "torshmon_training_efficiency_ratio",
    "torshmon_throughput_samples_per_second",
    "torshmon_step_duration_seconds",
    "torshmon_collective_duration_seconds",
    "torshmon_compression_ratio",
    "torshmon_ddp_bucket_cap_bytes",
)

Families = dict[str, Any]


def _hist(**counts_by_bucket: int) -> list[int]:
    """A duration_hist with counts at the given bucket indexes (``b3=2``; ``inf`` = overflow)."""
    counts = [0] * (len(DURATION_BUCKETS_S) + 1)
    for key, count in counts_by_bucket.items():
        counts[-1 if key == "inf" else int(key[1:])] = count
    return counts


def _allreduce(
    duration_hist: list[int], *, size: int, duration: float, busbw: float, dtype: str = "f32"
) -> CollectiveStat:
    return CollectiveStat(
        op="all_reduce",
        pg="default",
        dtype=dtype,
        count=sum(duration_hist),
        size_bytes=size,
        duration_s=duration,
        max_duration_s=duration,
        algbw_bytes_per_s=busbw / 2,
        busbw_bytes_per_s=busbw,
        duration_hist=duration_hist,
    )


def _step(step: int, duration: float, comm: float, **kwargs: Any) -> StepRecord:
    return StepRecord(
        step=step,
        end_unix_ns=1_700_000_000_000_000_000 + step,
        duration_s=duration,
        comm_wait_s=comm,
        compute_s=duration - comm,
        communication_time_ratio=comm / duration,
        comm_busy_s=comm,
        **kwargs,
    )


def _batch(seq: int, steps: list[StepRecord], *, rank: int = 0, **kwargs: Any) -> Batch:
    return Batch(
        v=SCHEMA_VERSION,
        session="s-1",
        seq=seq,
        job="train",
        rank=rank,
        sent_unix_ns=0,
        dropped_records_total=kwargs.pop("dropped", 0),
        steps=steps,
        **kwargs,
    )


def _node_sample() -> NodeSample:
    return NodeSample(
        ts_unix_ns=1,
        node="n1",
        cpu_utilization_ratio=0.25,
        memory_utilization_ratio=0.5,
        memory_used_bytes=8 * 2**30,
        io_wait_ratio=0.01,
        net_rx_bytes_total=1000,
        net_tx_bytes_total=2000,
        disk_read_bytes_total=3000,
        disk_write_bytes_total=4000,
        gpus=[GpuSample(index=0, utilization_ratio=0.9, memory_used_bytes=5, memory_total_bytes=9)],
        ranks=[RankProcess(job="train", rank=0, pid=4242, rss_bytes=123456)],
    )


def _feed(metrics: AgentMetrics) -> None:
    metrics.observe_node(_node_sample())
    first = _step(
        1,
        0.2,
        0.05,
        samples_per_s=320.0,
        loss=2.5,
        collectives=[
            _allreduce(_hist(b5=3, b7=1), size=1000, duration=0.03, busbw=1e9),
            _allreduce(_hist(b4=1), size=24, duration=0.001, busbw=2e9, dtype="i64"),
        ],
        buckets=[
            BucketStat(
                index=0,
                size_bytes=100,
                parameters=25,
                duration_s=0.01,
                codec="fp16",
                wire_bytes=50,
                compression_ratio=0.5,
            ),
            BucketStat(
                index=1,
                size_bytes=100,
                parameters=25,
                duration_s=0.01,
                codec="fp16",
                wire_bytes=50,
                compression_ratio=0.25,
            ),
        ],
        ddp=DdpStats(
            bucket_cap_bytes=25 * 2**20,
            bucket_sizes_bytes=[100, 100],
            num_buckets_reduced=2,
            avg_forward_compute_s=0.05,
            avg_backward_compute_s=0.1,
            avg_backward_comm_s=0.04,
            avg_backward_compute_comm_overlap_s=0.02,
        ),
    )
    second = _step(
        2,
        0.5,
        0.4,
        samples_per_s=128.0,
        loss=None,
        loss_nonfinite=True,
        config_version=1,
        collectives=[_allreduce(_hist(b8=1, inf=1), size=500, duration=70.0, busbw=4e8)],
        applied_config=AppliedConfig(
            version=2,
            bucket_cap_bytes=50 * 2**20,
            first_bucket_cap_bytes=2**20,
            codec="none",
            codec_params={},
            effective_step=3,
        ),
    )
    metrics.observe_batch(_batch(1, [first], dropped=2))
    metrics.observe_batch(
        _batch(
            2,
            [second],
            dropped=5,
            urgent=True,
            inflight=[
                InflightOp(
                    pg="default", seq=9, op="all_reduce", size_bytes=8, start_unix_ns=0, age_s=1.5
                ),
                InflightOp(
                    pg="pp", seq=4, op="send", size_bytes=8, start_unix_ns=0, age_s=0.5, peer=1
                ),
            ],
        )
    )
    metrics.observe_batch(_batch(1, [_step(1, 0.1, 0.0)], rank=1))
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


def _value(family: Any, sample_name: str, **labels: str) -> float:
    matches = [s.value for s in family.samples if s.name == sample_name and s.labels == labels]
    assert len(matches) == 1, (sample_name, labels, family.samples)
    return float(matches[0])


async def test_metrics_served_over_http(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    content_type, text = await _scrape(await serve(registry))
    assert content_type.startswith("text/plain")
    families = _parse(text)

    for name in CONTRACT:
        assert name in families, name
        assert families[name].samples, name

    types = {name: family.type for name, family in families.items()}
    assert types["torshmon_step_duration_seconds"] == "histogram"
    assert types["torshmon_collective_duration_seconds"] == "histogram"
    for counter in (
        "torshmon_steps",
        "torshmon_collective_bytes",
        "torshmon_network_receive_bytes",
        "torshmon_network_transmit_bytes",
        "torshmon_disk_read_bytes",
        "torshmon_disk_written_bytes",
        "torshmon_probe_dropped_records",
        "torshmon_agent_frames_rejected",
        "torshmon_agent_spool_dropped_records",
        "torshmon_agent_forward_failures",
    ):
        assert types[counter] == "counter", counter
    for gauge in CONTRACT:
        if gauge.endswith(("_ratio", "_per_second", "_bytes")):
            assert types[gauge] == "gauge", gauge

    # No unbounded labels anywhere.
    allowed = {"job", "rank", "node", "op", "pg", "codec", "gpu", "bucket", "le"}
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample


async def test_node_metrics(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    families = _parse((await _scrape(await serve(registry)))[1])

    node = {"node": "n1"}
    assert (
        _value(families["torshmon_cpu_utilization_ratio"], "torshmon_cpu_utilization_ratio", **node)
        == 0.25
    )
    assert (
        _value(
            families["torshmon_memory_utilization_ratio"],
            "torshmon_memory_utilization_ratio",
            **node,
        )
        == 0.5
    )
    assert (
        _value(families["torshmon_io_wait_time_ratio"], "torshmon_io_wait_time_ratio", **node)
        == 0.01
    )
    assert (
        _value(
            families["torshmon_network_receive_bytes"],
            "torshmon_network_receive_bytes_total",
            **node,
        )
        == 1000
    )
    assert (
        _value(families["torshmon_disk_written_bytes"], "torshmon_disk_written_bytes_total", **node)
        == 4000
    )
    gpu = {"node": "n1", "gpu": "0"}
    assert (
        _value(families["torshmon_gpu_utilization_ratio"], "torshmon_gpu_utilization_ratio", **gpu)
        == 0.9
    )
    assert (
        _value(families["torshmon_gpu_memory_used_bytes"], "torshmon_gpu_memory_used_bytes", **gpu)
        == 5
    )
    assert (
        _value(
            families["torshmon_process_resident_memory_bytes"],
            "torshmon_process_resident_memory_bytes",
            job="train",
            rank="0",
            node="n1",
        )
        == 123456
    )

    later = _node_sample()
    metrics.observe_node(
        NodeSample(**{**_struct_fields(later), "net_rx_bytes_total": 5000, "gpus": []})
    )
    families = _parse((await _scrape(await serve(registry)))[1])
    assert (
        _value(
            families["torshmon_network_receive_bytes"],
            "torshmon_network_receive_bytes_total",
            **node,
        )
        == 5000
    )
    assert families["torshmon_gpu_utilization_ratio"].samples == []


def _struct_fields(struct: Any) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


async def test_rank_metrics(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    families = _parse((await _scrape(await serve(registry)))[1])
    r0 = {"job": "train", "rank": "0"}

    steps = families["torshmon_step_duration_seconds"]
    buckets = [
        (s.labels["le"], s.value)
        for s in steps.samples
        if s.name.endswith("_bucket") and s.labels["rank"] == "0"
    ]
    assert len(buckets) == len(STEP_DURATION_BUCKETS_S) + 1
    assert buckets[-1] == ("+Inf", 2)
    assert dict(buckets)["0.1"] == 0 and dict(buckets)["0.25"] == 1 and dict(buckets)["0.5"] == 2
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert _value(steps, "torshmon_step_duration_seconds_count", **r0) == 2
    assert math.isclose(_value(steps, "torshmon_step_duration_seconds_sum", **r0), 0.7)

    assert _value(families["torshmon_steps"], "torshmon_steps_total", **r0) == 2
    assert _value(families["torshmon_steps"], "torshmon_steps_total", job="train", rank="1") == 1
    urgent = families["torshmon_probe_urgent_steps"]
    assert _value(urgent, "torshmon_probe_urgent_steps_total", **r0) == 1
    assert _value(urgent, "torshmon_probe_urgent_steps_total", job="train", rank="1") == 0
    gauge = {
        name: _value(families[name], name, **r0)
        for name in (
            "torshmon_communication_time_ratio",
            "torshmon_training_efficiency_ratio",
            "torshmon_throughput_samples_per_second",
            "torshmon_loss",
            "torshmon_config_version",
            "torshmon_ddp_bucket_cap_bytes",
            "torshmon_inflight_oldest_age_seconds",
        )
    }
    assert math.isclose(gauge["torshmon_communication_time_ratio"], 0.8)
    assert math.isclose(gauge["torshmon_training_efficiency_ratio"], 0.2)
    assert gauge["torshmon_throughput_samples_per_second"] == 128.0
    assert gauge["torshmon_loss"] == 2.5  # the NaN loss of step 2 is not reported
    assert gauge["torshmon_config_version"] == 1
    assert gauge["torshmon_ddp_bucket_cap_bytes"] == 50 * 2**20  # applied config wins
    assert gauge["torshmon_inflight_oldest_age_seconds"] == 1.5
    assert (
        _value(
            families["torshmon_inflight_oldest_age_seconds"],
            "torshmon_inflight_oldest_age_seconds",
            job="train",
            rank="1",
        )
        == 0
    )
    # Rank 1 sent neither loss nor throughput: those series are absent, not zero.
    assert {s.labels["rank"] for s in families["torshmon_loss"].samples} == {"0"}
    assert (
        _value(
            families["torshmon_compression_ratio"], "torshmon_compression_ratio", codec="fp16", **r0
        )
        == 0.375
    )
    assert (
        _value(
            families["torshmon_probe_dropped_records"], "torshmon_probe_dropped_records_total", **r0
        )
        == 5
    )


async def test_collective_metrics(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    families = _parse((await _scrape(await serve(registry)))[1])
    labels = {"job": "train", "rank": "0", "op": "all_reduce", "pg": "default"}

    durations = families["torshmon_collective_duration_seconds"]
    buckets = {
        s.labels["le"]: s.value
        for s in durations.samples
        if s.name.endswith("_bucket") and s.labels["rank"] == "0"
    }
    assert len(buckets) == len(DURATION_BUCKETS_S) + 1
    # Both dtypes and both batches merged: b4 (<=1ms)=1, b5=3, b7=1, b8=1, overflow=1.
    assert buckets["0.0005"] == 0
    assert buckets["0.001"] == 1
    assert buckets["0.005"] == 4
    assert buckets["0.01"] == 4
    assert buckets["0.05"] == 5
    assert buckets["0.1"] == 6
    assert buckets["60.0"] == 6
    assert buckets["+Inf"] == 7
    assert _value(durations, "torshmon_collective_duration_seconds_count", **labels) == 7
    assert math.isclose(
        _value(durations, "torshmon_collective_duration_seconds_sum", **labels), 70.031
    )
    assert (
        _value(families["torshmon_collective_bytes"], "torshmon_collective_bytes_total", **labels)
        == 1524
    )
    # The latest step's bus bandwidth.
    assert (
        _value(
            families["torshmon_collective_busbw_bytes_per_second"],
            "torshmon_collective_busbw_bytes_per_second",
            **labels,
        )
        == 4e8
    )


def test_bus_bandwidth_combines_dtypes_by_time() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    step = _step(
        1,
        0.1,
        0.05,
        collectives=[
            _allreduce(_hist(b5=1), size=3000, duration=0.03, busbw=1e9),
            _allreduce(_hist(b4=1), size=1000, duration=0.01, busbw=5e8, dtype="f16"),
        ],
    )
    metrics.observe_batch(_batch(1, [step]))
    value = registry.get_sample_value(
        "torshmon_collective_busbw_bytes_per_second",
        {"job": "train", "rank": "0", "op": "all_reduce", "pg": "default"},
    )
    assert value is not None and math.isclose(value, (1e9 * 0.03 + 5e8 * 0.01) / 0.04)


def test_bus_bandwidth_is_the_latest_step_that_timed_the_collective() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    broadcast = CollectiveStat(
        op="broadcast",
        pg="default",
        dtype="f32",
        count=1,
        size_bytes=8,
        duration_s=0.001,
        max_duration_s=0.001,
        algbw_bytes_per_s=1.0,
        busbw_bytes_per_s=7e6,
        duration_hist=_hist(b4=1),
    )

    def all_reduce(busbw: float, duration: float = 0.01) -> CollectiveStat:
        return _allreduce(_hist(b5=1), size=1, duration=duration, busbw=busbw)

    steps = [
        _step(1, 0.1, 0.01, collectives=[all_reduce(1e9)]),
        _step(2, 0.1, 0.01, collectives=[all_reduce(2e9)]),
        # The latest all_reduce took no time: it says nothing about bandwidth.
        _step(3, 0.1, 0.01, collectives=[all_reduce(0.0, duration=0.0)]),
        _step(4, 0.1, 0.01, collectives=[broadcast]),
        _step(5, 0.1, 0.01),
    ]
    metrics.observe_batch(_batch(1, steps))
    labels = {"job": "train", "rank": "0", "pg": "default"}
    name = "torshmon_collective_busbw_bytes_per_second"
    assert registry.get_sample_value(name, {**labels, "op": "all_reduce"}) == 2e9
    assert registry.get_sample_value(name, {**labels, "op": "broadcast"}) == 7e6


def test_many_steps_fold_into_the_same_histogram_counts() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    coll = {"job": "train", "rank": "0", "op": "all_reduce", "pg": "default"}
    name = "torshmon_collective_duration_seconds"
    batches = 7
    for seq in range(1, batches + 1):
        steps = [
            _step(
                seq * 100 + i,
                0.1,
                0.01,
                collectives=[_allreduce(_hist(b3=1, b6=i % 3), size=1, duration=0.5, busbw=1.0)],
            )
            for i in range(30)
        ]
        metrics.observe_batch(_batch(seq, steps))
        if seq == 3:  # a scrape between batches must not lose or double anything
            assert registry.get_sample_value(f"{name}_count", coll) == 3 * 60
    steps_total = batches * 30
    b6_total = batches * sum(i % 3 for i in range(30))
    assert registry.get_sample_value(f"{name}_count", coll) == steps_total + b6_total
    assert registry.get_sample_value(f"{name}_bucket", {**coll, "le": "0.0005"}) == steps_total
    assert registry.get_sample_value(f"{name}_bucket", {**coll, "le": "0.005"}) == steps_total
    assert registry.get_sample_value(f"{name}_bucket", {**coll, "le": "0.01"}) == (
        steps_total + b6_total
    )
    assert registry.get_sample_value(f"{name}_sum", coll) == pytest.approx(steps_total * 0.5)


async def test_agent_state_metrics(serve: Callable[[CollectorRegistry], Any]) -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    url = await serve(registry)
    families = _parse((await _scrape(url))[1])
    node = {"node": "n1"}
    # Before the daemon reports anything: zeros, and the forward is not up.
    assert _value(families["torshmon_agent_forward_up"], "torshmon_agent_forward_up", **node) == 0

    _feed(metrics)
    metrics.add_gauge_function("torshmon_agent_uptime_seconds", "Agent uptime.", lambda: 12.5)
    families = _parse((await _scrape(url))[1])
    expected = {
        "torshmon_agent_frames_rejected_total": 3,
        "torshmon_agent_probe_connections": 2,
        "torshmon_agent_spool_records": 7,
        "torshmon_agent_spool_bytes": 4096,
        "torshmon_agent_spool_dropped_records_total": 1,
        "torshmon_agent_forward_failures_total": 4,
        "torshmon_agent_forward_up": 1,
        "torshmon_agent_uptime_seconds": 12.5,
    }
    for name, value in expected.items():
        assert registry.get_sample_value(name, node) == value, name
    assert families["torshmon_agent_frames_rejected"].type == "counter"
    assert families["torshmon_agent_spool_bytes"].type == "gauge"


def test_add_gauge_function_validates_and_survives_failures() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    with pytest.raises(ValueError, match="must match"):
        metrics.add_gauge_function("uptime", "no prefix", lambda: 1.0)
    metrics.add_gauge_function("torshmon_agent_broken", "raises", lambda: 1 / 0)
    with pytest.raises(ValueError, match="already added"):
        metrics.add_gauge_function("torshmon_agent_broken", "again", lambda: 1.0)
    metrics.observe_batch(_batch(1, [_step(1, 0.1, 0.0)]))
    assert registry.get_sample_value("torshmon_agent_broken", {"node": "n1"}) is None
    assert registry.get_sample_value("torshmon_steps_total", {"job": "train", "rank": "0"}) == 1


def test_counters_add_across_batches_and_sessions() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    rank = {"job": "train", "rank": "0"}
    coll = {**rank, "op": "all_reduce", "pg": "default"}
    for seq in range(1, 4):
        step = _step(
            seq,
            0.1,
            0.01,
            collectives=[_allreduce(_hist(b5=2), size=10, duration=0.004, busbw=1.0)],
        )
        metrics.observe_batch(_batch(seq, [step], dropped=seq))
    assert registry.get_sample_value("torshmon_steps_total", rank) == 3
    assert registry.get_sample_value("torshmon_collective_bytes_total", coll) == 30
    assert registry.get_sample_value("torshmon_collective_duration_seconds_count", coll) == 6
    assert registry.get_sample_value("torshmon_probe_dropped_records_total", rank) == 3

    # A resent older batch cannot lower the probe's cumulative drop count...
    metrics.observe_batch(_batch(1, [], dropped=1))
    assert registry.get_sample_value("torshmon_probe_dropped_records_total", rank) == 3
    # ...but a new session (restarted probe) starts from its own count.
    restarted = Batch(
        v=SCHEMA_VERSION,
        session="s-2",
        seq=1,
        job="train",
        rank=0,
        sent_unix_ns=0,
        dropped_records_total=0,
    )
    metrics.observe_batch(restarted)
    assert registry.get_sample_value("torshmon_probe_dropped_records_total", rank) == 0


def test_malformed_collective_histogram_is_skipped() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    bad = _allreduce([1, 2], size=10, duration=0.1, busbw=1.0)
    metrics.observe_batch(_batch(1, [_step(1, 0.2, 0.1, collectives=[bad])]))
    coll = {"job": "train", "rank": "0", "op": "all_reduce", "pg": "default"}
    assert registry.get_sample_value("torshmon_collective_duration_seconds_count", coll) == 0
    assert registry.get_sample_value("torshmon_collective_bytes_total", coll) == 10


def test_forget_rank_and_close() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    _feed(metrics)
    r0 = {"job": "train", "rank": "0"}
    assert registry.get_sample_value("torshmon_steps_total", r0) == 2
    metrics.forget_rank("train", 0)
    metrics.forget_rank("train", 0)
    assert registry.get_sample_value("torshmon_steps_total", r0) is None
    assert (
        registry.get_sample_value(
            "torshmon_collective_bytes_total", {**r0, "op": "all_reduce", "pg": "default"}
        )
        is None
    )
    assert registry.get_sample_value("torshmon_steps_total", {"job": "train", "rank": "1"}) == 1
    metrics.close()
    metrics.close()
    assert registry.get_sample_value("torshmon_steps_total", {"job": "train", "rank": "1"}) is None


def test_registries_are_independent() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    AgentMetrics(first, node="a").observe_batch(_batch(1, [_step(1, 0.1, 0.0)]))
    AgentMetrics(second, node="b")
    rank = {"job": "train", "rank": "0"}
    assert first.get_sample_value("torshmon_steps_total", rank) == 1
    assert second.get_sample_value("torshmon_steps_total", rank) is None


async def test_promtool_accepts_exposition(
    serve: Callable[[CollectorRegistry], Any], tmp_path: Any
) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (CI installs it; apt-get install prometheus)")
    registry = CollectorRegistry()
    _feed(AgentMetrics(registry, node="n1"))
    _, text = await _scrape(await serve(registry))
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stderr


def test_a_batch_naming_2000_ops_and_groups_keeps_metrics_bounded() -> None:
    """Past the cap, op, pg and codec values fold into 'other', counted per label."""
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1")
    hello = wf.hello("train", 0, 1)
    metrics.observe_batch(wf.batch(hello, 1, [wf.step_naming(1, 2000)]))
    metrics.observe_batch(wf.batch(hello, 2, [wf.step_naming(2, 2000)]))
    families = {f.name: f for f in registry.collect()}
    collectives = families["torshmon_collective_bytes"].samples
    assert len(collectives) == MAX_LABEL_VALUES + 1  # op-i/pg-i for i < 64, then other/other
    other = {"job": "train", "rank": "0", "op": OTHER, "pg": OTHER}
    assert registry.get_sample_value("torshmon_collective_bytes_total", other) == 2 * 1936 * 1000
    busbw = registry.get_sample_value("torshmon_collective_busbw_bytes_per_second", other)
    assert busbw == pytest.approx(1e6)
    assert len(families["torshmon_compression_ratio"].samples) == MAX_LABEL_VALUES + 1
    for label in ("op", "pg", "codec"):
        folded = {"job": "train", "label": label}
        assert registry.get_sample_value("torshmon_label_values_folded_total", folded) == 2 * 1936
    assert len(generate_latest(registry)) < 256 * 1024  # 65 collective histograms; 4.4 MiB before


def test_a_jobs_folded_values_are_forgotten_with_its_last_rank() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, node="n1", label_cap=LabelCap(max_values=1))
    hello = wf.hello("train", 0, 1)
    metrics.observe_batch(wf.batch(hello, 1, [wf.step_naming(1, 3)]))
    folded = {"job": "train", "label": "op"}
    assert registry.get_sample_value("torshmon_label_values_folded_total", folded) == 2
    metrics.forget_rank("train", 0)
    assert registry.get_sample_value("torshmon_label_values_folded_total", folded) is None
