"""The recommend_memory action: its message from a rank's own numbers, and the message
on a Memory Leak alert the aggregator's rules raise from ingested samples and steps."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.memory_report import GpuMemory, RankMemory, memory_report
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.wire import NodeSample, RankProcess

T0 = 1_700_000_000.0
MB = 1_000_000


def test_the_message_says_where_memory_grew_at_which_steps_and_by_how_much() -> None:
    steps = [(T0 + 0.5 * i, 10 + i) for i in range(21)]  # step 10 at T0 .. step 30 at T0 + 10
    rss = [(T0 + i, 1000.0 * MB + (300 * MB if i >= 6 else 0) + 10 * MB * i) for i in range(11)]
    text = memory_report(
        [
            RankMemory("demo", 1, "n0", rss, steps),
            RankMemory("demo", 0, "n0", [(T0, 900.0 * MB), (T0 + 10, 900.2 * MB)], steps),
        ],
        [GpuMemory("n0", 0, 76_000_000_000, 80_000_000_000)],
    )
    grown, steady, gpu = text.splitlines()
    assert grown == (
        "Job demo rank 1 (node n0): 1.00 GB at step 10 -> 1.40 GB at step 30: +400.00 MB in "
        "10 s (+40.00 MB/s, +20.00 MB per step); the largest rise, +310.00 MB, came between "
        "steps 20 and 22."
    )
    assert steady == "Job demo rank 0 (node n0): steady at 900.20 MB over 10 s (steps 10 and 30)."
    assert gpu == "GPU 0 on node n0: 76.00 GB of 80.00 GB used (95%)."


def test_no_samples_no_message() -> None:
    assert memory_report([RankMemory("demo", 0, "n0", [], [])]) == ""
    (line,) = memory_report([RankMemory("demo", 0, "n0", [(T0, 5.0 * MB)], [])]).splitlines()
    assert line == "Job demo rank 0 (node n0): 5.00 MB before its first step."


def _sample(second: int, rss_bytes: int) -> NodeSample:
    return NodeSample(
        ts_unix_ns=int((T0 + second) * 1e9),
        node="node-a",
        cpu_utilization_ratio=0.5,
        memory_utilization_ratio=0.5,
        memory_used_bytes=8 << 30,
        io_wait_ratio=0.0,
        net_rx_bytes_total=0,
        net_tx_bytes_total=0,
        disk_read_bytes_total=0,
        disk_write_bytes_total=0,
        ranks=[RankProcess(job="leaky", rank=0, pid=100, rss_bytes=rss_bytes)],
    )


def test_a_memory_leak_alert_carries_the_ranks_growth_by_step() -> None:
    asyncio.run(_leak())


async def _leak() -> None:
    now = [T0]
    aggregator = Aggregator(
        AggregatorSettings(db_url="sqlite://", aggregator_id="t"),
        registry=CollectorRegistry(),
        targets=[],
        clock=lambda: now[0],
    )
    try:
        hello = wf.hello("leaky", 0, 1)
        aggregator.live.observe(Stored(acked_seq=0, hellos=[hello]), T0)
        fired = []
        for second in range(25):
            now[0] = T0 + second
            # Ten 0.1 s steps a second, numbered from 1; 50 MB more resident each second.
            steps = [
                wf.step(10 * second + i, end_unix_ns=int((T0 + second + 0.1 * i) * 1e9))
                for i in range(1, 11)
            ]
            aggregator.live.observe(
                Stored(
                    acked_seq=0,
                    batches=[(wf.batch(hello, second + 1, steps), "node-a")],
                    node_samples=[_sample(second, 2_000 * MB + 50 * MB * second)],
                ),
                now[0],
                "node-a",
            )
            transitions = await aggregator.evaluate()
            fired += [a for a in transitions if a.rule == "Memory Leak" and a.state == "firing"]
            if fired:
                break
        (alert,) = fired
        description = alert.annotations["description"]
        assert description.startswith("Job leaky rank 0 (node node-a): ")
        # The live window holds the samples of the last 70 s: all of them here.
        assert "2.00 GB before its first step -> " in description
        # The sample at second s is dated by the last step ended by then: step 10 s.
        growth = f"{50 * second:.2f} MB"
        assert description == (
            f"Job leaky rank 0 (node node-a): 2.00 GB before its first step -> "
            f"{(2000 + 50 * second) / 1000:.2f} GB at step {10 * second}: +{growth} in "
            f"{second} s (+50.00 MB/s)."
        )
    finally:
        await aggregator.aclose()
        aggregator.writer.shutdown()
