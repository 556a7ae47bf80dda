"""The forwarder against a real aiohttp aggregator stand-in on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import logging
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from torshmon.agent import forwarder
from torshmon.agent.forwarder import Forwarder
from torshmon.agent.spool import Spool
from torshmon.wire import (
    SCHEMA_VERSION,
    Command,
    IngestBatch,
    IngestReply,
    NodeSample,
    SpoolRecord,
    WireError,
    decode_json,
    encode_json,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cr3t-token-value"
QUERY_SECRET = "qs-hidden-value"


class FakeAggregator:
    """Stores records once per seq, checks they arrive in order, and replies like the real one."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.records: dict[int, SpoolRecord] = {}
        self.arrival: list[int] = []
        self.duplicates = 0
        self.errors: list[str] = []
        self.batches: list[IngestBatch] = []
        self.commands: list[Command] = []
        # (status, store first?) answered to the next requests instead of a 200.
        self.failures: list[tuple[int, bool]] = []
        self.failed_requests = 0
        self.max_records_per_request: int | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/v1/ingest", self._ingest)
        # auto_decompress=False: the test gunzips itself, proving the body is gzip.
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1/ingest?token={QUERY_SECRET}"

    async def _ingest(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, text="bad token")
        if request.headers.get("Content-Encoding") != "gzip":
            self.errors.append("body not gzip-encoded")
            return web.Response(status=400, text="want gzip")
        if request.content_type != "application/json":
            self.errors.append(f"content type {request.content_type}")
        try:
            batch = decode_json(gzip.decompress(await request.read()), IngestBatch)
        except (WireError, OSError) as exc:
            self.errors.append(str(exc))
            return web.Response(status=400, text=str(exc))
        if self.max_records_per_request and len(batch.records) > self.max_records_per_request:
            return web.Response(status=413, text="too large")
        self.batches.append(batch)
        store_first = True
        status = 200
        if self.failures:
            status, store_first = self.failures.pop(0)
            self.failed_requests += 1
        if store_first:
            self._store(batch)
        if status != 200:
            return web.Response(status=status, text="aggregator trouble")
        commands, self.commands = self.commands, []
        reply = IngestReply(
            v=SCHEMA_VERSION, acked_seq=max(self.records, default=0), commands=commands
        )
        return web.Response(body=encode_json(reply), content_type="application/json")

    def _store(self, batch: IngestBatch) -> None:
        if batch.agent_id != "agent-1" or batch.node != "node-a":
            self.errors.append(f"wrong identity {batch.agent_id}/{batch.node}")
        for item in batch.records:
            if item.seq in self.records:
                self.duplicates += 1
                continue
            expected = max(self.records, default=0) + 1
            if item.seq != expected:
                self.errors.append(f"seq {item.seq} arrived when {expected} was next")
            self.records[item.seq] = item.record
            self.arrival.append(item.seq)


def record(i: int) -> bytes:
    """Spool record number ``i``: its one node sample carries ``i`` as its time."""
    sample = NodeSample(
        ts_unix_ns=i,
        node="n",
        cpu_utilization_ratio=0.0,
        memory_utilization_ratio=0.0,
        memory_used_bytes=0,
        io_wait_ratio=0.0,
        net_rx_bytes_total=0,
        net_tx_bytes_total=0,
        disk_read_bytes_total=0,
        disk_write_bytes_total=0,
    )
    return encode_json(SpoolRecord(node_samples=[sample]))


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def aggregator() -> AsyncIterator[FakeAggregator]:
    agg = FakeAggregator(TOKEN)
    await agg.start()
    try:
        yield agg
    finally:
        await agg.stop()


@pytest.fixture
def spool(tmp_path: Path) -> Any:
    s = Spool(tmp_path / "spool.db")
    try:
        yield s
    finally:
        s.close()


def make_forwarder(
    spool: Spool, aggregator: FakeAggregator, *, token: str | None = TOKEN, **kwargs: Any
) -> Forwarder:
    options: dict[str, Any] = {
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.2,
        "timeout_s": 2.0,
        "poll_interval_s": 0.2,
        "rng": random.Random(7),
        **kwargs,
    }
    return Forwarder(
        spool, url=aggregator.url, token=token, agent_id="agent-1", node="node-a", **options
    )


def assert_delivered_exactly(aggregator: FakeAggregator, n: int) -> None:
    assert aggregator.errors == []
    assert aggregator.arrival == list(range(1, n + 1))
    for seq, rec in aggregator.records.items():
        assert rec.node_samples[0].ts_unix_ns == seq


async def test_delivers_many_records_in_order_exactly_once(
    spool: Spool, aggregator: FakeAggregator
) -> None:
    for i in range(1, 301):
        spool.append(record(i))
    async with make_forwarder(spool, aggregator, batch_max_bytes=27 * len(record(1))) as fwd:
        for i in range(301, 601):
            spool.append(record(i))
            fwd.notify()
            if i % 50 == 0:
                await asyncio.sleep(0)
        await wait_until(lambda: len(aggregator.records) == 600 and spool.records == 0)
    assert_delivered_exactly(aggregator, 600)
    assert aggregator.duplicates == 0
    assert fwd.records_sent == 600
    assert fwd.batches_sent >= 600 * len(record(600)) // (27 * len(record(1)))
    assert fwd.consecutive_failures == 0 and fwd.last_success_unix is not None


async def test_aggregator_down_then_back_on_the_same_port(
    spool: Spool, aggregator: FakeAggregator
) -> None:
    async with make_forwarder(spool, aggregator, batch_max_bytes=7 * len(record(1))) as fwd:
        for i in range(1, 101):
            spool.append(record(i))
        fwd.notify()
        await wait_until(lambda: len(aggregator.records) > 0)
        await aggregator.stop()
        for i in range(101, 201):
            spool.append(record(i))
            fwd.notify()
        await asyncio.sleep(1.5)
        assert fwd.consecutive_failures > 0
        assert fwd.last_error is not None and "cannot reach" in fwd.last_error
        assert spool.records > 0
        await aggregator.start()
        for i in range(201, 301):
            spool.append(record(i))
        fwd.notify()
        await wait_until(lambda: len(aggregator.records) == 300 and spool.records == 0)
        assert fwd.consecutive_failures == 0 and fwd.last_error is None
    assert_delivered_exactly(aggregator, 300)


async def test_server_errors_are_retried_and_replays_deduplicated(
    spool: Spool, aggregator: FakeAggregator
) -> None:
    # The first answer is lost after the records were stored, so they are sent again.
    aggregator.failures = [(500, True), (500, False), (503, False), (502, False)]
    for i in range(1, 51):
        spool.append(record(i))
    async with make_forwarder(spool, aggregator, batch_max_bytes=13 * len(record(1))):
        await wait_until(lambda: spool.records == 0)
    assert aggregator.failed_requests == 4
    assert aggregator.duplicates > 0
    assert_delivered_exactly(aggregator, 50)


async def test_wrong_token_keeps_data_until_the_token_is_accepted(
    spool: Spool, aggregator: FakeAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    aggregator.token = "another-token"
    for i in range(1, 11):
        spool.append(record(i))
    async with make_forwarder(spool, aggregator) as fwd:
        await wait_until(lambda: fwd.auth_failed and fwd.consecutive_failures >= 3)
        assert spool.records == 10
        assert aggregator.records == {}
        assert fwd.last_error is not None and "(401)" in fwd.last_error
        rejected = [r for r in caplog.records if "rejected the agent's token (401)" in r.message]
        assert len(rejected) == 1 and rejected[0].levelno == logging.ERROR
        aggregator.token = TOKEN
        await wait_until(lambda: spool.records == 0)
        assert not fwd.auth_failed
    assert_delivered_exactly(aggregator, 10)
    # The stand-in server's own access log shows the query; the agent's logs must not.
    agent_logs = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("torshmon"))
    assert "rejected the agent's token" in agent_logs
    assert TOKEN not in agent_logs
    assert QUERY_SECRET not in agent_logs


async def test_idle_poll_fetches_commands(spool: Spool, aggregator: FakeAggregator) -> None:
    replies: list[IngestReply] = []
    command = Command(id="c1", job="job-a", kind="config", args={"bucket_cap_bytes": 1 << 20})
    aggregator.commands = [command]
    async with make_forwarder(spool, aggregator, on_reply=replies.append):
        await wait_until(lambda: any(r.commands for r in replies), timeout_s=5.0)
    assert [c for r in replies for c in r.commands] == [command]
    assert aggregator.batches and all(b.records == [] for b in aggregator.batches)


async def test_commands_arrive_with_data_replies(spool: Spool, aggregator: FakeAggregator) -> None:
    replies: list[IngestReply] = []
    aggregator.commands = [Command(id="c2", job="job-a", kind="config")]
    spool.append(record(1))
    async with make_forwarder(spool, aggregator, on_reply=replies.append):
        await wait_until(lambda: spool.records == 0 and bool(replies))
    assert replies[0].acked_seq == 1 and replies[0].commands[0].id == "c2"


async def test_an_urgent_record_skips_the_gathering_wait(
    spool: Spool, aggregator: FakeAggregator
) -> None:
    """After a POST the forwarder gathers records for ``min_interval_s``; a record
    marked urgent (a probe's fast lane) goes at once, a plain one waits."""
    loop = asyncio.get_running_loop()
    spool.append(record(1))
    async with make_forwarder(spool, aggregator, min_interval_s=5.0) as fwd:
        await wait_until(lambda: len(aggregator.records) == 1)
        await asyncio.sleep(0.05)  # the forwarder is now in its gathering wait
        spool.append(record(2))
        fwd.notify()
        await asyncio.sleep(0.5)
        assert len(aggregator.records) == 1  # a plain record waits out the interval
        started = loop.time()
        spool.append(record(3))
        fwd.notify(urgent=True)
        await wait_until(lambda: len(aggregator.records) == 3, timeout_s=2.0)
        assert loop.time() - started < 1.0
    assert_delivered_exactly(aggregator, 3)


async def test_records_right_after_an_urgent_one_go_in_its_post(
    spool: Spool, aggregator: FakeAggregator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's ranks finish a step within a few ms: the records that arrive within
    ``URGENT_GATHER_S`` of an urgent one go in the same POST, so the step is complete
    at the aggregator at once rather than a paced POST later (the gather is widened
    here, so a slow machine's timer cannot split the batch)."""
    monkeypatch.setattr(forwarder, "URGENT_GATHER_S", 0.3)
    spool.append(record(1))
    async with make_forwarder(spool, aggregator, min_interval_s=5.0) as fwd:
        await wait_until(lambda: len(aggregator.records) == 1)
        await asyncio.sleep(0.2)  # past URGENT_MIN_INTERVAL_S: only the gather is left
        spool.append(record(2))
        fwd.notify(urgent=True)
        await asyncio.sleep(0.05)
        spool.append(record(3))
        fwd.notify(urgent=True)
        await wait_until(lambda: len(aggregator.records) == 3, timeout_s=2.0)
    assert [[item.seq for item in b.records] for b in aggregator.batches] == [[1], [2, 3]]
    assert_delivered_exactly(aggregator, 3)


async def test_a_complete_step_ends_the_gather(
    spool: Spool, aggregator: FakeAggregator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the node's records of the step are all in (``complete``: a straggler's
    record, the last of its step) the POST goes at once, not a gather later."""
    monkeypatch.setattr(forwarder, "URGENT_GATHER_S", 5.0)
    loop = asyncio.get_running_loop()
    spool.append(record(1))
    async with make_forwarder(spool, aggregator, min_interval_s=5.0) as fwd:
        await wait_until(lambda: len(aggregator.records) == 1)
        await asyncio.sleep(0.2)  # past URGENT_MIN_INTERVAL_S: only the gather is left
        started = loop.time()
        spool.append(record(2))
        fwd.notify(urgent=True, complete=True)
        await wait_until(lambda: len(aggregator.records) == 2, timeout_s=4.0)
        assert loop.time() - started < 2.0
        started = loop.time()
        spool.append(record(3))
        fwd.notify(urgent=True)  # the control: the step is not complete, it gathers
        await asyncio.sleep(1.0)
        assert len(aggregator.records) == 2
        spool.append(record(4))
        fwd.notify(urgent=True, complete=True)
        await wait_until(lambda: len(aggregator.records) == 4, timeout_s=4.0)
        assert loop.time() - started < 4.0
    assert [[item.seq for item in b.records] for b in aggregator.batches] == [[1], [2], [3, 4]]
    assert_delivered_exactly(aggregator, 4)


async def test_413_halves_the_batch_size(spool: Spool, aggregator: FakeAggregator) -> None:
    aggregator.max_records_per_request = 2
    for i in range(1, 21):
        spool.append(record(i))
    async with make_forwarder(spool, aggregator) as fwd:
        await wait_until(lambda: spool.records == 0)
    assert fwd.batch_max_bytes < 3 * len(record(20))
    assert_delivered_exactly(aggregator, 20)


async def test_aclose_flushes_then_gives_up_at_the_timeout(
    spool: Spool, aggregator: FakeAggregator
) -> None:
    for i in range(1, 21):
        spool.append(record(i))
    fwd = make_forwarder(spool, aggregator, poll_interval_s=60.0)
    await fwd.start()
    await fwd.aclose(flush_timeout_s=5.0)
    await fwd.aclose()
    assert spool.records == 0
    assert_delivered_exactly(aggregator, 20)

    await aggregator.stop()
    spool.append(record(21))
    fwd = make_forwarder(spool, aggregator, poll_interval_s=60.0)
    await fwd.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await fwd.aclose(flush_timeout_s=0.5)
    assert 0.4 < loop.time() - started < 3.0
    assert spool.records == 1


def test_invalid_url_fails_fast(spool: Spool) -> None:
    with pytest.raises(ValueError, match="http"):
        Forwarder(spool, url="ftp://example", token=None, agent_id="a", node="n")
