"""Ingest throughput of the aggregator: samples per second through ingest, detection,
rules and SQL, for SQLite and PostgreSQL, against a bare bulk insert of the same rows.

A *sample* is one stored measurement: each of ``STEP_SAMPLE_FIELDS`` (the measured
columns of the steps model: step time, communication wait, compute, communication ratio,
busy time, phases, throughput, loss, the time between steps, CPU waits, GPU memory) that
a step record carries (these records carry ten, step time to loss), plus 4 per collective
(count, size, duration, bus bandwidth) and 4 per bucket - the count the aggregator
itself keeps in ``torshmon_ingest_samples_total``. Node samples are ingested too (as
agents send them) but not counted.

Pipeline run: a real aggregator process (fresh database, default rules, evaluation
every 0.5 s, the garbage collector set up as ``torshmon aggregator`` sets it) on a
loopback port. This process plays ``world_size / ranks_per_agent``
agents of one job: each POST is one agent's gzipped ``IngestBatch`` (at the agent's
``GZIP_LEVEL``, as it sends them) of ``records_per_post`` spool records, each holding a
probe batch of ``steps_per_batch`` steps from every rank of the agent, and a node sample (8 GPUs).
Step records look like the probe's default mode: phases, loss, throughput, no
buckets, two collectives every ``collective_every`` steps, DDP statistics every 50
steps. Agents take turns on ``connections`` concurrent connections (64: a real job's
640 agents would keep up to 640 POSTs in flight; with 8 the aggregator waited on round
trips, partly idle), each agent with one POST in flight, its seqs in order. The warm-up
lasts until every agent's first POST (with its ranks' hellos) was answered, then
``warmup_s`` more. Then sending pauses while the bodies of the window (and
``SETTLE_S`` before it) are built, at the warm-up's rate with a margin, and resumes;
the bare insert's rows are built before it is timed too, and real agents encode on the
training nodes, not on the aggregator's cores (``--live-bodies`` builds each body as it
is sent, the window included; ``prebuilt %`` is the share of the window's POSTs sent
from the pool). Throughput counts the samples of the POSTs answered inside the window.
Afterwards SQL must hold every step and sample sent, exactly once ("stored ok").

Columns: ``agg cores`` is the aggregator's CPU (all threads, and its child processes:
the ingest process that stores, unless ``--ingest thread``) over the window,
in cores; ``loop`` its event-loop thread's share; ``gc`` the CPU its garbage
collector took; ``samples/cpu-s`` samples per second of aggregator CPU, the figure
to compare across runs on a shared machine (the others move with the CPU the
aggregator got), beside ``bare samples/cpu-s``, the same for the bare insert (its
process's CPU, the database library's included; time waiting for the disk is not
CPU); ``load`` the 1-minute load average at the end of the window (this run
included); ``client cores`` what the simulated agents cost this process;
``steal %`` and ``bare steal %`` the share of the machine's CPU time the hypervisor gave
to other guests during the window and during the bare insert (on a shared host the bare
insert, one thread with a core to itself, and the pipeline, processes that wait on each
other, suffer it differently: read a ratio measured under steal with that in mind).

Bare run: the rows ingest writes for the same kind of bodies (``insert_rows``:
ingest seqs, steps, collectives, DDP statistics, node, GPU and rank samples) are
built first, then inserted into a fresh database of the same kind with the DBAPI
way ingest writes them (one transaction per POST's rows, as ingest commits): the DBAPI
cursor's ``executemany`` on SQLite, ``COPY ... FROM STDIN`` on PostgreSQL, in a
tight loop. ``ratio_vs_bare`` is pipeline samples/s over bare samples/s.

Prints one row per run, then (the last line of stdout) one JSON object.

Usage::

    python benchmarks/ingest.py --quick          # under two minutes
    python benchmarks/ingest.py                  # under ten minutes
    python benchmarks/ingest.py --backends sqlite --profile DIR   # cProfile the aggregator
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import operator
import os
import pstats
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import psutil
from sqlalchemy import create_engine, text

# The repository root, for tests.pg (the throwaway PostgreSQL databases).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tests.pg import pg_database
from torshmon.agent.forwarder import GZIP_LEVEL
from torshmon.aggregator.ingest import (
    SAMPLES_PER_BUCKET,
    SAMPLES_PER_COLLECTIVE,
    STEP_SAMPLE_FIELDS,
    insert_rows,
)
from torshmon.history.db import make_engine
from torshmon.history.migrate import upgrade
from torshmon.wire import (
    DURATION_BUCKETS_S,
    SCHEMA_VERSION,
    Batch,
    CollectiveStat,
    DdpStats,
    GpuSample,
    Hello,
    IngestBatch,
    IngestReply,
    NodeSample,
    RankProcess,
    SpoolRecord,
    StepRecord,
    decode_json,
    encode_json,
)

TOKEN = "bench-token"
JOB = "bench"
INGEST_PATH = "/api/v1/ingest"
#: The issue's targets, for SQLite: samples/s sustained, and the ratio to the bare insert.
TARGET_SAMPLES_PER_S = 100_000.0
TARGET_RATIO = 0.5
#: Nominal step time of the simulated job; each step varies by up to +-5 % around it.
STEP_S = 0.1
DDP_STATS_EVERY = 50
GPUS_PER_NODE = 8
BACKENDS = ("sqlite", "postgres")
#: The longest the warm-up waits for every agent's first POST to be answered.
ALL_AGENTS_TIMEOUT_S = 180.0
#: Prebuilt bodies: the rate is measured over the warm-up's last seconds, the pool holds
#: this much more than that rate needs, sending settles this long before the window.
RATE_SPAN_S = 3.0
POOL_MARGIN = 1.4
SETTLE_S = 2.0
BUILD_COST_SAMPLE = 20


@dataclass(frozen=True, slots=True)
class Workload:
    """The simulated job and how its agents batch it."""

    world_size: int
    ranks_per_agent: int
    steps_per_batch: int
    records_per_post: int
    collective_every: int

    @property
    def agents(self) -> int:
        return self.world_size // self.ranks_per_agent

    @property
    def steps_per_post(self) -> int:
        return self.ranks_per_agent * self.steps_per_batch * self.records_per_post


@dataclass(frozen=True, slots=True)
class Plan:
    """What one benchmark invocation runs."""

    quick: bool
    backends: tuple[str, ...]
    workload: Workload
    repeats: int
    warmup_s: float
    window_s: float
    bare_s: float
    connections: int
    profile_dir: Path | None
    ingest: str
    #: Build the window's POST bodies before it (``LoadGenerator.prebuild``).
    prebuild: bool


QUICK = {"repeats": 1, "warmup_s": 3.0, "window_s": 10.0, "bare_s": 4.0, "world_size": 1024}
FULL = {"repeats": 2, "warmup_s": 6.0, "window_s": 30.0, "bare_s": 10.0, "world_size": 5120}


# -- the simulated agents --------------------------------------------------------------
_sample_values = operator.attrgetter(*STEP_SAMPLE_FIELDS)


def step_samples(step: StepRecord) -> int:
    """Measurements one step record carries (the unit of ingest throughput)."""
    present = len(STEP_SAMPLE_FIELDS) - _sample_values(step).count(None)
    return (
        present
        + SAMPLES_PER_COLLECTIVE * len(step.collectives)
        + SAMPLES_PER_BUCKET * len(step.buckets)
    )


def _histogram(duration_s: float, count: int) -> list[int]:
    counts = [0] * (len(DURATION_BUCKETS_S) + 1)
    counts[next((i for i, b in enumerate(DURATION_BUCKETS_S) if duration_s <= b), -1)] += count
    return counts


_METRIC_REDUCE_HIST = _histogram(4e-5, 2)
_SYNC_HIST = _histogram(2e-5, 1)


def _collectives(world_size: int) -> list[CollectiveStat]:
    """What a training loop issues itself every few steps: a metric all-reduce, a sync."""
    algbw = 8 / 8e-5
    return [
        CollectiveStat(
            op="all_reduce",
            pg="default",
            dtype="torch.float32",
            count=2,
            size_bytes=8,
            duration_s=8e-5,
            max_duration_s=4.5e-5,
            algbw_bytes_per_s=algbw,
            busbw_bytes_per_s=algbw * 2 * (world_size - 1) / world_size,
            duration_hist=_METRIC_REDUCE_HIST,
        ),
        CollectiveStat(
            op="broadcast",
            pg="default",
            dtype="torch.int64",
            count=1,
            size_bytes=8,
            duration_s=2e-5,
            max_duration_s=2e-5,
            algbw_bytes_per_s=4e5,
            busbw_bytes_per_s=4e5,
            duration_hist=_SYNC_HIST,
        ),
    ]


class SimulatedRank:
    """One rank's probe: its session and the next step records."""

    def __init__(self, rank: int, world_size: int, tag: str, collective_every: int) -> None:
        self.rank = rank
        self.session = f"{tag}-{rank}"
        self.seq = 0
        self.step = 0
        self._world_size = world_size
        self._collective_every = collective_every
        self._rng = random.Random(rank)
        self._collectives = _collectives(world_size)

    def hello(self, node: str) -> Hello:
        return Hello(
            v=SCHEMA_VERSION,
            session=self.session,
            job=JOB,
            rank=self.rank,
            world_size=self._world_size,
            local_rank=self.rank % GPUS_PER_NODE,
            node=node,
            pid=10_000 + self.rank,
            backend="nccl",
            torch_version="2.13.0",
            probe_version="bench",
        )

    def batch(self, ends_ns: Sequence[int], sent_ns: int) -> Batch:
        """A probe batch of one step per end time in ``ends_ns``."""
        self.seq += 1
        return Batch(
            v=SCHEMA_VERSION,
            session=self.session,
            seq=self.seq,
            job=JOB,
            rank=self.rank,
            sent_unix_ns=sent_ns,
            dropped_records_total=0,
            steps=[self._step(end_ns) for end_ns in ends_ns],
        )

    def _step(self, end_ns: int) -> StepRecord:
        self.step += 1
        n = self.step
        # Bounded noise (+-5 %): never a z-score or straggler finding, so the run measures
        # ingest, not alert storage.
        duration_s = STEP_S * (1.0 + self._rng.uniform(-0.05, 0.05))
        comm_wait_s = 0.18 * duration_s
        ddp = None
        if n % DDP_STATS_EVERY == 0:
            ddp = DdpStats(
                bucket_cap_bytes=25 * 1024 * 1024,
                bucket_sizes_bytes=[25 * 1024 * 1024] * 4 + [12_345_678],
                num_buckets_reduced=5,
                avg_forward_compute_s=0.3 * duration_s,
                avg_backward_compute_s=0.5 * duration_s,
                avg_backward_comm_s=0.35 * duration_s,
                avg_backward_compute_comm_overlap_s=0.17 * duration_s,
            )
        return StepRecord(
            step=n,
            end_unix_ns=end_ns,
            duration_s=duration_s,
            comm_wait_s=comm_wait_s,
            compute_s=duration_s - comm_wait_s,
            communication_time_ratio=comm_wait_s / duration_s,
            comm_busy_s=0.35 * duration_s,
            forward_s=0.3 * duration_s,
            backward_s=0.45 * duration_s,
            optimizer_s=0.07 * duration_s,
            batch_size=32,
            samples_per_s=32 / duration_s,
            loss=2.5 / (1.0 + 0.001 * n) + self._rng.uniform(0.0, 0.01),
            collectives=self._collectives if n % self._collective_every == 0 else [],
            ddp=ddp,
        )


@dataclass(frozen=True, slots=True)
class Post:
    """One POST body ready to send and what it carries."""

    body_gz: bytes
    last_seq: int
    steps: int
    samples: int


class SimulatedAgent:
    """One node's agent: its ranks, its spool seqs, the next POST body."""

    def __init__(self, index: int, workload: Workload, tag: str) -> None:
        self.agent_id = f"{tag}-agent-{index:04d}"
        self.node = f"node-{index:04d}"
        first = index * workload.ranks_per_agent
        self.ranks = [
            SimulatedRank(r, workload.world_size, tag, workload.collective_every)
            for r in range(first, first + workload.ranks_per_agent)
        ]
        self._workload = workload
        self._seq = 0
        self._last_ns: int | None = None
        self._head = b'{"v":%d,"agent_id":%s,"node":%s,"records":[' % (
            SCHEMA_VERSION,
            json.dumps(self.agent_id).encode(),
            json.dumps(self.node).encode(),
        )

    def next_post(self, now_ns: int) -> Post:
        """The records since the previous POST; their steps end evenly in between."""
        w = self._workload
        per_rank = w.steps_per_batch * w.records_per_post
        previous = (
            self._last_ns if self._last_ns is not None else now_ns - int(per_rank * STEP_S * 1e9)
        )
        self._last_ns = now_ns
        gap = max(1, (now_ns - previous) // per_rank)
        ends = [previous + gap * (i + 1) for i in range(per_rank)]
        records: list[bytes] = []
        steps = samples = 0
        for k in range(w.records_per_post):
            messages: list[Hello | Batch] = []
            if self._seq == 0 and k == 0:
                messages.extend(r.hello(self.node) for r in self.ranks)
            chunk = ends[k * w.steps_per_batch : (k + 1) * w.steps_per_batch]
            for rank in self.ranks:
                batch = rank.batch(chunk, now_ns)
                messages.append(batch)
                steps += len(batch.steps)
                samples += sum(step_samples(s) for s in batch.steps)
            record = SpoolRecord(
                messages=messages, node_samples=[self._node_sample(now_ns)] if k == 0 else []
            )
            self._seq += 1
            records.append(b'{"seq":%d,"record":%s}' % (self._seq, encode_json(record)))
        body = b"".join((self._head, b",".join(records), b"]}"))
        return Post(gzip.compress(body, compresslevel=GZIP_LEVEL), self._seq, steps, samples)

    def _node_sample(self, now_ns: int) -> NodeSample:
        return NodeSample(
            ts_unix_ns=now_ns,
            node=self.node,
            cpu_utilization_ratio=0.35,
            memory_utilization_ratio=0.6,
            memory_used_bytes=600 << 30,
            io_wait_ratio=0.01,
            net_rx_bytes_total=now_ns // 1000,
            net_tx_bytes_total=now_ns // 1000,
            disk_read_bytes_total=1 << 30,
            disk_write_bytes_total=2 << 30,
            gpus=[
                GpuSample(
                    index=i,
                    utilization_ratio=0.92,
                    memory_used_bytes=60 << 30,
                    memory_total_bytes=80 << 30,
                )
                for i in range(GPUS_PER_NODE)
            ],
            ranks=[
                RankProcess(job=JOB, rank=r.rank, pid=10_000 + r.rank, rss_bytes=12 << 30)
                for r in self.ranks
            ],
        )


# -- the aggregator process ------------------------------------------------------------
# Runs a real Aggregator on a free port and prints it; SIGTERM stops it. SIGUSR1 marks
# the window: the CPU seconds its garbage collector has run so far are noted, and printed
# at exit. With a profile path, its event-loop thread and its writer thread are each
# profiled by CPU time (thread_time: idle waits would otherwise dominate).
_AGGREGATOR = """
import asyncio, cProfile, gc, json, signal, sys, time
from prometheus_client import CollectorRegistry
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.writer import tune_gc_for_daemon
from torshmon.aggregator.settings import AggregatorSettings

gc_s = [0.0, 0.0]  # CPU seconds in total, at the start of the running collection

def on_gc(phase, info):
    # A collection runs in the thread that triggered it, start to stop.
    if phase == "start":
        gc_s[1] = time.thread_time()
    else:
        gc_s[0] += time.thread_time() - gc_s[1]

async def main(db_url, token, ingest, profile):
    settings = AggregatorSettings(
        port=0,
        db_url=db_url,
        token=token,
        aggregator_id="bench",
        eval_interval_s=0.5,
        ingest_process=ingest == "process",
    )
    stop = asyncio.Event()
    marks = []
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: marks.append(gc_s[0]))
    gc.callbacks.append(on_gc)
    agg = Aggregator(settings, registry=CollectorRegistry(), targets=[])
    async with agg:
        tune_gc_for_daemon()  # as `torshmon aggregator` (run_aggregator) does once started
        profilers = []
        if profile:
            main_p = cProfile.Profile(time.thread_time)
            writer_p = cProfile.Profile(time.thread_time)
            main_p.enable()
            agg.writer.submit(writer_p.enable).result()
            profilers = [(main_p, profile + ".main"), (writer_p, profile + ".writer")]
        print("PORT", agg.port, flush=True)
        await stop.wait()
        if profilers:
            profilers[0][0].disable()
            agg.writer.submit(profilers[1][0].disable).result()
            for p, path in profilers:
                p.dump_stats(path)
    print("MARKS", json.dumps(marks), flush=True)

asyncio.run(main(*sys.argv[1:4], sys.argv[4] if len(sys.argv) > 4 else ""))
"""


class AggregatorProcess:
    """``async with AggregatorProcess(url, profile)``: a real aggregator on a free port."""

    def __init__(self, db_url: str, ingest: str, profile: Path | None) -> None:
        self._args = [sys.executable, "-c", _AGGREGATOR, db_url, TOKEN, ingest]
        if profile is not None:
            self._args.append(str(profile))
        self._process: asyncio.subprocess.Process | None = None
        self.port = 0
        #: Garbage-collector seconds at each ``mark()``, known once the process stopped.
        self.gc_marks_s: list[float] = []

    async def __aenter__(self) -> AggregatorProcess:
        self._process = await asyncio.create_subprocess_exec(
            *self._args, stdout=asyncio.subprocess.PIPE
        )
        if self._process.stdout is None:
            raise RuntimeError("no stdout pipe to the aggregator")
        line = await asyncio.wait_for(self._process.stdout.readline(), 60)
        if not line.startswith(b"PORT "):
            raise RuntimeError(f"the aggregator did not start (said {line!r})")
        self.port = int(line.split()[1])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            out, _ = await asyncio.wait_for(process.communicate(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise RuntimeError("the aggregator did not stop within 60 s of SIGTERM") from None
        if process.returncode != 0:
            raise RuntimeError(f"the aggregator exited with code {process.returncode}")
        for line in out.splitlines():
            if line.startswith(b"MARKS "):
                self.gc_marks_s = json.loads(line[len(b"MARKS ") :])

    def mark(self) -> None:
        """Note the garbage collector's seconds so far (the window's start or end)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGUSR1)

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the aggregator is not running")
        return self._process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# -- one pipeline run ------------------------------------------------------------------
@dataclass(slots=True)
class Completion:
    """One answered POST."""

    done_s: float
    latency_s: float
    steps: int
    samples: int
    #: Its body was built when it was sent, not before the window (the pool ran dry).
    built_live: bool


@dataclass(slots=True)
class LoadStats:
    completions: list[Completion] = field(default_factory=list)
    steps: int = 0
    samples: int = 0


class LoadGenerator:
    """Every simulated agent in turn on ``connections`` connections, one POST in flight
    per agent; a POST that is not answered 200 with its last seq fails the run.

    Bodies are built as they are sent until ``prebuild`` builds a pool of them ahead.
    """

    def __init__(self, workload: Workload, url: str, connections: int) -> None:
        tag = uuid.uuid4().hex[:8]
        self._workload = workload
        self._idle = deque(SimulatedAgent(i, workload, tag) for i in range(workload.agents))
        #: Each agent's prebuilt bodies, in seq order.
        self._pool: dict[str, deque[Post]] = {}
        #: Cleared while ``prebuild`` waits for the POSTs in flight and builds the pool.
        self._go = asyncio.Event()
        self._go.set()
        self._in_flight = 0
        self._url = url + INGEST_PATH
        # An agent has one POST in flight at a time: no more connections than agents.
        self._connections = min(connections, workload.agents)
        self._first_posts = workload.records_per_post
        self._agents_left = workload.agents
        #: Set once every agent's first POST (with its ranks' hellos) was answered.
        self.all_seen = asyncio.Event()
        self.stats = LoadStats()

    async def run(self, stop: asyncio.Event) -> None:
        workers = [self._worker(stop) for _ in range(self._connections)]
        await asyncio.gather(*workers)

    async def _worker(self, stop: asyncio.Event) -> None:
        async with HttpConnection(self._url) as http:
            while not stop.is_set():
                await self._post_once(http)

    async def prebuild(self, seconds: float) -> int:
        """Build the bodies of the next ``seconds`` of POSTs now, at the rate of the last
        ``RATE_SPAN_S`` seconds (with a margin); the POSTs then send them. Returns how
        many were built.

        The bare insert's rows are built before it is timed; this does the same for the
        pipeline's bodies, so the simulated agents' JSON encoding and gzip (~60 % of
        their CPU, ~0.2 of this machine's 2 cores at full size), work real agents do on
        the training nodes, does not take cores from the aggregator during the window.
        Sending pauses while the pool is built. Each body's steps end at the time it is
        expected to be sent (the measured rate from when building ends), as a live
        agent's do.
        """
        now = time.perf_counter()
        recent = sum(1 for c in self.stats.completions if c.done_s >= now - RATE_SPAN_S)
        rate = max(recent / RATE_SPAN_S, 1.0)
        count = math.ceil(rate * POOL_MARGIN * seconds)
        self._go.clear()
        try:
            while self._in_flight:
                await asyncio.sleep(0.005)
            agents = list(self._idle)  # every agent, in the order they are sent
            start_ns = time.time_ns() + int(count * _build_cost_s(self._workload) * 1e9)
            for i in range(count):
                agent = agents[i % len(agents)]
                post = agent.next_post(start_ns + int(i / rate * 1e9))
                self._pool.setdefault(agent.agent_id, deque()).append(post)
        finally:
            self._go.set()
        return count

    async def _post_once(self, http: HttpConnection) -> None:
        await self._go.wait()
        agent = self._idle.popleft()
        pool = self._pool.get(agent.agent_id)
        built_live = not pool
        post = pool.popleft() if pool else agent.next_post(time.time_ns())
        self._in_flight += 1
        try:
            started = time.perf_counter()
            status, body = await asyncio.wait_for(http.post(post.body_gz), 120)
        finally:
            self._in_flight -= 1
        if status != 200:
            raise RuntimeError(f"ingest answered {status}: {body[:300]!r}")
        reply = decode_json(body, IngestReply)
        if reply.acked_seq != post.last_seq:
            raise RuntimeError(f"{agent.agent_id}: acked {reply.acked_seq}, sent {post.last_seq}")
        done = time.perf_counter()
        self.stats.completions.append(
            Completion(done, done - started, post.steps, post.samples, built_live)
        )
        self.stats.steps += post.steps
        self.stats.samples += post.samples
        self._idle.append(agent)
        if post.last_seq == self._first_posts:
            self._agents_left -= 1
            if self._agents_left == 0:
                self.all_seen.set()


def _build_cost_s(workload: Workload) -> float:
    """Seconds this process takes to build one POST body (agents of their own)."""
    agent = SimulatedAgent(0, workload, "calibration")
    agent.next_post(time.time_ns())  # the first one carries the hellos
    started = time.perf_counter()
    for i in range(BUILD_COST_SAMPLE):
        agent.next_post(time.time_ns() + i)
    return (time.perf_counter() - started) / BUILD_COST_SAMPLE


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs agent bodies, as the agent's
    forwarder sends them (gzip JSON, bearer token). Written out rather than aiohttp's
    client: the simulated agents share this machine's cores with the aggregator, and
    this costs them a fraction of the CPU per POST. The aggregator reads the same
    requests either way."""

    def __init__(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 80
        self._head = (
            f"POST {parsed.path} HTTP/1.1\r\n"
            f"Host: {parsed.netloc}\r\n"
            f"Authorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\n"
            "Content-Encoding: gzip\r\n"
            "Content-Length: %d\r\n\r\n"
        ).encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> HttpConnection:
        self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()

    async def post(self, body: bytes) -> tuple[int, bytes]:
        """The status and body of the answer to one POST of ``body``."""
        if self._reader is None or self._writer is None:
            raise RuntimeError("not connected")
        self._writer.write(self._head % len(body) + body)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        length = None
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
            elif name.strip().lower() == "transfer-encoding":
                raise RuntimeError(f"unexpected Transfer-Encoding {value.strip()!r}")
        if length is None:
            raise RuntimeError(f"answer without Content-Length: {head!r}")
        return status, await self._reader.readexactly(length)


class StealMeter:
    """The share of this machine's CPU time that the hypervisor gave to someone else
    (``steal`` in /proc/stat) between ``__init__`` and ``share()``. On a shared host it
    moves both figures of a ratio differently (the pipeline's processes wait on each
    other, the bare insert does not), so each run reports it; 0.0 where not measured."""

    def __init__(self) -> None:
        self._start = psutil.cpu_times()

    def share(self) -> float:
        end = psutil.cpu_times()
        steal = getattr(end, "steal", 0.0) - getattr(self._start, "steal", 0.0)
        total = sum(end) - sum(self._start)
        return steal / total if total > 0 else 0.0


def _cpu(process: psutil.Process) -> tuple[float, float, float]:
    """CPU seconds so far of the aggregator with its child processes (the ingest process),
    of its event-loop thread, and of this process (the simulated agents)."""
    total = 0.0
    for p in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    main = next((t for t in process.threads() if t.id == process.pid), None)
    main_s = main.user_time + main.system_time if main is not None else float("nan")
    own = psutil.Process().cpu_times()
    return total, float(main_s), float(own.user + own.system)


@dataclass(frozen=True, slots=True)
class PipelineResult:
    backend: str
    repeat: int
    samples_per_s: float
    steps_per_s: float
    posts_per_s: float
    cpu_cores: float
    main_thread_cores: float
    gc_cores: float
    client_cores: float
    load_average: float
    rss_mb: float
    latency_p50_s: float
    latency_p99_s: float
    steps_sent: int
    samples_sent: int
    steps_stored: int
    samples_stored: int
    steal: float
    #: The share of the window's POSTs whose bodies were built before the window.
    prebuilt_share: float

    @property
    def samples_per_cpu_s(self) -> float:
        """Samples per second of aggregator CPU: its efficiency, whatever CPU it got."""
        return self.samples_per_s / self.cpu_cores if self.cpu_cores > 0 else 0.0


async def measure_pipeline(plan: Plan, backend: str, db_url: str, repeat: int) -> PipelineResult:
    """Start an aggregator on ``db_url``, load it through warm-up and window, verify SQL."""
    profile = None
    if plan.profile_dir is not None:
        profile = plan.profile_dir / f"aggregator-{backend}-{repeat}.prof"
    async with AggregatorProcess(db_url, plan.ingest, profile) as agg:
        process = psutil.Process(agg.pid)
        load = LoadGenerator(plan.workload, agg.url, plan.connections)
        stop = asyncio.Event()
        task = asyncio.create_task(load.run(stop))
        try:
            # Warm-up: every agent once (the first POSTs carry hellos and create the
            # sessions, series and detector state), then the steady state settles.
            await _wait_unless_done(task, load.all_seen, ALL_AGENTS_TIMEOUT_S)
            await _sleep_unless_done(task, plan.warmup_s)
            if plan.prebuild:
                await load.prebuild(plan.window_s + SETTLE_S)
                await _sleep_unless_done(task, SETTLE_S)  # the pause's backlog clears
            t0, cpu0, steal = time.perf_counter(), _cpu(process), StealMeter()
            agg.mark()
            await _sleep_unless_done(task, plan.window_s)
            t1, cpu1, steal_share = time.perf_counter(), _cpu(process), steal.share()
            agg.mark()
            load_average = os.getloadavg()[0]
            rss_mb = process.memory_info().rss / (1024 * 1024)
        finally:
            stop.set()
            await task
    gc_marks = agg.gc_marks_s
    gc_s = gc_marks[1] - gc_marks[0] if len(gc_marks) == 2 else float("nan")
    stats = load.stats
    inside = [c for c in stats.completions if t0 <= c.done_s < t1]
    wall_s = t1 - t0
    latencies = sorted(c.latency_s for c in inside)
    steps_stored, samples_stored = _stored(db_url)
    return PipelineResult(
        backend=backend,
        repeat=repeat,
        samples_per_s=sum(c.samples for c in inside) / wall_s,
        steps_per_s=sum(c.steps for c in inside) / wall_s,
        posts_per_s=len(inside) / wall_s,
        cpu_cores=(cpu1[0] - cpu0[0]) / wall_s,
        main_thread_cores=(cpu1[1] - cpu0[1]) / wall_s,
        gc_cores=gc_s / wall_s,
        client_cores=(cpu1[2] - cpu0[2]) / wall_s,
        load_average=load_average,
        rss_mb=rss_mb,
        latency_p50_s=_quantile(latencies, 0.5),
        latency_p99_s=_quantile(latencies, 0.99),
        steps_sent=stats.steps,
        samples_sent=stats.samples,
        steps_stored=steps_stored,
        samples_stored=samples_stored,
        steal=steal_share,
        prebuilt_share=sum(not c.built_live for c in inside) / len(inside) if inside else 0.0,
    )


async def _sleep_unless_done(task: asyncio.Task[None], seconds: float) -> None:
    """Sleep, but surface the load generator's failure at once."""
    done, _ = await asyncio.wait([task], timeout=seconds)
    if done:
        task.result()
        raise RuntimeError("the load generator stopped early")


async def _wait_unless_done(
    task: asyncio.Task[None], event: asyncio.Event, timeout_s: float
) -> None:
    """Wait for ``event``; the load generator's failure, or a timeout, ends the run."""
    waiter = asyncio.create_task(event.wait())
    done, _ = await asyncio.wait(
        [task, waiter], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    waiter.cancel()
    if task in done:
        task.result()
        raise RuntimeError("the load generator stopped early")
    if waiter not in done:
        raise RuntimeError(f"not every agent had a POST answered within {timeout_s} s")


def _stored(db_url: str) -> tuple[int, int]:
    """Steps and samples in the history, counted by SQL (the definition, independently)."""
    counted = " + ".join(f"count({name})" for name in STEP_SAMPLE_FIELDS)
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            steps, step_values = conn.execute(text(f"SELECT count(*), {counted} FROM steps")).one()
            collectives = conn.execute(text("SELECT count(*) FROM collectives")).scalar_one()
            buckets = conn.execute(text("SELECT count(*) FROM buckets")).scalar_one()
    finally:
        engine.dispose()
    samples = step_values + SAMPLES_PER_COLLECTIVE * collectives + SAMPLES_PER_BUCKET * buckets
    return int(steps), int(samples)


# -- the bare insert -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BareResult:
    backend: str
    repeat: int
    samples_per_s: float
    steps_per_s: float
    posts: int
    steal: float
    #: Samples per CPU second of the inserting process (the database library runs in it).
    samples_per_cpu_s: float


PostRows = list[tuple[str, str, list[tuple[Any, ...]]]]  # (table, SQL, rows) per table


def _bare_posts(workload: Workload, dialect: str, posts: int) -> tuple[list[PostRows], int, int]:
    """The rows ingest writes for ``posts`` POSTs, as (table, SQL, tuples) per table:
    an INSERT for ``executemany`` on SQLite, a ``COPY ... FROM STDIN`` on PostgreSQL,
    as ingest writes them.

    Returns them, the samples and the steps per round over all of them.
    """
    tag = uuid.uuid4().hex[:8]
    agents = [SimulatedAgent(i, workload, tag) for i in range(workload.agents)]
    out: list[PostRows] = []
    samples = steps = 0
    now_ns = time.time_ns()
    for i in range(posts):
        post = agents[i % len(agents)].next_post(now_ns + i * 1_000_000)
        samples += post.samples
        steps += post.steps
        batch = decode_json(gzip.decompress(post.body_gz), IngestBatch)
        post_rows: PostRows = []
        for table, (columns, rows) in insert_rows(batch, time.time_ns()).items():
            if dialect == "sqlite":
                statement = "INSERT INTO {} ({}) VALUES ({})".format(
                    table, ", ".join(columns), ", ".join("?" * len(columns))
                )
            else:
                statement = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
            post_rows.append((table, statement, [_plain(row) for row in rows]))
        out.append(post_rows)
    return out, samples, steps


def _plain(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """JSON columns as text: what the driver is handed for them."""
    return tuple(json.dumps(v) if isinstance(v, (list, dict)) else v for v in row)


def measure_bare(plan: Plan, backend: str, db_url: str, repeat: int) -> BareResult:
    """Insert the same kind of rows for ``plan.bare_s`` seconds, straight through the
    DBAPI driver as ingest does (``executemany`` on SQLite, ``COPY`` on PostgreSQL)."""
    upgrade(db_url)
    engine = make_engine(db_url)
    dialect = engine.dialect.name
    count = max(plan.workload.agents, 64)
    posts, samples_per_round, steps_per_round = _bare_posts(plan.workload, dialect, count)
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        inserted = steps = rounds = done = 0
        steal = StealMeter()
        started, cpu_started = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < plan.bare_s:
            for post_rows in posts:
                if dialect == "sqlite":
                    cursor.execute("BEGIN")
                for table, statement, rows in post_rows:
                    if table == "ingest_seqs":
                        # Seqs are the primary key: renumber them for every round.
                        rows = [(a, seq + rounds * 1_000_000, *rest) for a, seq, *rest in rows]
                    if dialect == "sqlite":
                        cursor.executemany(statement, rows)
                    else:
                        with cursor.copy(statement) as copy:
                            for row in rows:
                                copy.write_row(row)
                if dialect == "sqlite":
                    cursor.execute("COMMIT")
                else:
                    raw.commit()
                done += 1
            rounds += 1
            inserted += samples_per_round
            steps += steps_per_round
        elapsed = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started
        steal_share = steal.share()
        cursor.close()
    finally:
        raw.close()
        engine.dispose()
    return BareResult(
        backend, repeat, inserted / elapsed, steps / elapsed, done, steal_share, inserted / cpu_s
    )


# -- runs ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    pipeline: PipelineResult
    bare: BareResult

    @property
    def ratio(self) -> float:
        return self.pipeline.samples_per_s / self.bare.samples_per_s


@contextlib.contextmanager
def fresh_database(backend: str) -> Iterator[str]:
    """The URL of an empty database of ``backend``, removed afterwards."""
    if backend == "postgres":
        with pg_database("torshmon_bench") as url:
            yield url
        return
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-ingest-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'history.db'}"


async def run_plan(plan: Plan) -> list[Run]:
    """Every (repeat, backend): the pipeline, then the bare insert, each on a fresh database."""
    runs = []
    for repeat in range(plan.repeats):
        for backend in plan.backends:
            # Each measurement starts with the disk's write-back of the one before done:
            # the pipeline writes for a minute, and its dirty pages would otherwise be
            # flushed during the bare insert (or the other way round).
            os.sync()
            with fresh_database(backend) as url:
                pipeline = await measure_pipeline(plan, backend, url, repeat)
            os.sync()
            with fresh_database(backend) as url:
                bare = measure_bare(plan, backend, url, repeat)
            runs.append(Run(pipeline, bare))
            print(f"  {backend}, repeat {repeat}: done", file=sys.stderr, flush=True)
    return runs


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# -- the report ------------------------------------------------------------------------
COLUMNS: tuple[tuple[str, Callable[[Run], str]], ...] = (
    ("backend", lambda r: r.pipeline.backend),
    ("repeat", lambda r: str(r.pipeline.repeat)),
    ("samples/s", lambda r: f"{r.pipeline.samples_per_s:,.0f}"),
    ("steps/s", lambda r: f"{r.pipeline.steps_per_s:,.0f}"),
    ("posts/s", lambda r: f"{r.pipeline.posts_per_s:.0f}"),
    ("bare samples/s", lambda r: f"{r.bare.samples_per_s:,.0f}"),
    ("ratio", lambda r: f"{r.ratio:.2f}"),
    ("agg cores", lambda r: f"{r.pipeline.cpu_cores:.2f}"),
    ("loop", lambda r: f"{r.pipeline.main_thread_cores:.2f}"),
    ("gc", lambda r: f"{r.pipeline.gc_cores:.2f}"),
    ("samples/cpu-s", lambda r: f"{r.pipeline.samples_per_cpu_s:,.0f}"),
    ("bare samples/cpu-s", lambda r: f"{r.bare.samples_per_cpu_s:,.0f}"),
    ("client cores", lambda r: f"{r.pipeline.client_cores:.2f}"),
    ("prebuilt %", lambda r: f"{r.pipeline.prebuilt_share * 100:.0f}"),
    ("load", lambda r: f"{r.pipeline.load_average:.1f}"),
    ("agg rss MB", lambda r: f"{r.pipeline.rss_mb:.0f}"),
    ("p50 ms", lambda r: f"{r.pipeline.latency_p50_s * 1e3:.1f}"),
    ("p99 ms", lambda r: f"{r.pipeline.latency_p99_s * 1e3:.1f}"),
    ("steal %", lambda r: f"{r.pipeline.steal * 100:.0f}"),
    ("bare steal %", lambda r: f"{r.bare.steal * 100:.0f}"),
    ("stored ok", lambda r: "yes" if _exactly_once(r.pipeline) else "NO"),
)


def _exactly_once(p: PipelineResult) -> bool:
    return p.steps_stored == p.steps_sent and p.samples_stored == p.samples_sent


def summary_json(plan: Plan, runs: Sequence[Run]) -> dict[str, Any]:
    """Per backend: medians over repeats."""
    out: dict[str, Any] = {}
    for backend in plan.backends:
        mine = [r for r in runs if r.pipeline.backend == backend]
        out[f"samples_per_s_{backend}"] = round(
            statistics.median(r.pipeline.samples_per_s for r in mine)
        )
        out[f"steps_per_s_{backend}"] = round(
            statistics.median(r.pipeline.steps_per_s for r in mine)
        )
        out[f"bare_samples_per_s_{backend}"] = round(
            statistics.median(r.bare.samples_per_s for r in mine)
        )
        out[f"ratio_vs_bare_{backend}"] = round(statistics.median(r.ratio for r in mine), 3)
        out[f"aggregator_cpu_cores_{backend}"] = round(
            statistics.median(r.pipeline.cpu_cores for r in mine), 3
        )
        out[f"samples_per_cpu_s_{backend}"] = round(
            statistics.median(r.pipeline.samples_per_cpu_s for r in mine)
        )
        out[f"bare_samples_per_cpu_s_{backend}"] = round(
            statistics.median(r.bare.samples_per_cpu_s for r in mine)
        )
        out[f"aggregator_gc_cores_{backend}"] = round(
            statistics.median(r.pipeline.gc_cores for r in mine), 3
        )
        out[f"aggregator_rss_mb_{backend}"] = round(max(r.pipeline.rss_mb for r in mine), 1)
        out[f"latency_p99_ms_{backend}"] = round(
            statistics.median(r.pipeline.latency_p99_s for r in mine) * 1e3, 1
        )
        out[f"cpu_steal_share_{backend}"] = round(max(r.pipeline.steal for r in mine), 3)
        out[f"bare_cpu_steal_share_{backend}"] = round(max(r.bare.steal for r in mine), 3)
        out[f"bodies_prebuilt_share_{backend}"] = round(
            min(r.pipeline.prebuilt_share for r in mine), 3
        )
    out["exactly_once"] = all(_exactly_once(r.pipeline) for r in runs)
    return out


def verdict(summary: dict[str, Any]) -> str:
    if "samples_per_s_sqlite" not in summary:
        return "SQLite not measured: no verdict on the target"
    rate, ratio = summary["samples_per_s_sqlite"], summary["ratio_vs_bare_sqlite"]
    ok = rate >= TARGET_SAMPLES_PER_S and ratio >= TARGET_RATIO
    return (
        f"SQLite: {rate:,.0f} samples/s, {ratio:.2f} of the bare insert "
        f"(target >= {TARGET_SAMPLES_PER_S:,.0f}, >= {TARGET_RATIO}): "
        + ("within target" if ok else "BELOW TARGET")
        + f"; stored exactly once: {'yes' if summary['exactly_once'] else 'NO'}"
    )


def print_profiles(plan: Plan, limit: int = 25) -> None:
    """The aggregator's top functions by own CPU time, per thread, first run per backend."""
    if plan.profile_dir is None:
        return
    for backend in plan.backends:
        for thread in ("main", "writer"):
            path = plan.profile_dir / f"aggregator-{backend}-0.prof.{thread}"
            if not path.exists():
                print(f"no profile at {path}")
                continue
            print(f"\naggregator {thread} thread, {backend} ({path}), top {limit} by own time:")
            pstats.Stats(str(path), stream=sys.stdout).sort_stats("tottime").print_stats(limit)


# -- the command line ------------------------------------------------------------------
def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a positive number of ``kind``."""

    def parse(text_value: str) -> int | float:
        try:
            value = kind(text_value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text_value!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
        return value

    return parse


def parse_plan(argv: Sequence[str] | None = None) -> Plan:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (< 2 min)")
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="databases"
    )
    parser.add_argument("--world-size", type=_positive(int), help="ranks of the job")
    parser.add_argument("--ranks-per-agent", type=_positive(int), default=8, help="(8)")
    parser.add_argument("--steps-per-batch", type=_positive(int), default=5, help="(5)")
    parser.add_argument("--records-per-post", type=_positive(int), default=2, help="(2)")
    parser.add_argument(
        "--collective-every", type=_positive(int), default=5, help="steps between collectives (5)"
    )
    parser.add_argument("--connections", type=_positive(int), default=64, help="(64)")
    parser.add_argument("--repeats", type=_positive(int), help="runs per backend")
    parser.add_argument("--warmup-s", type=_positive(float), help="seconds before the window")
    parser.add_argument("--window-s", type=_positive(float), help="measurement window, seconds")
    parser.add_argument("--bare-s", type=_positive(float), help="bare insert run, seconds")
    parser.add_argument("--profile", type=Path, help="cProfile the aggregator into this folder")
    parser.add_argument(
        "--ingest",
        choices=("process", "thread"),
        default="process",
        help="where the aggregator stores ingest (its ingest_process setting): process",
    )
    parser.add_argument(
        "--live-bodies",
        action="store_true",
        help="build each POST body as it is sent, in the window too (by default the "
        "window's bodies are built before it, as the bare insert's rows are)",
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    world_size = args.world_size or int(preset["world_size"])
    if world_size % args.ranks_per_agent:
        parser.error(
            f"--world-size {world_size} must be a multiple of --ranks-per-agent "
            f"{args.ranks_per_agent}"
        )
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    return Plan(
        quick=args.quick,
        backends=tuple(dict.fromkeys(args.backends)),
        workload=Workload(
            world_size=world_size,
            ranks_per_agent=args.ranks_per_agent,
            steps_per_batch=args.steps_per_batch,
            records_per_post=args.records_per_post,
            collective_every=args.collective_every,
        ),
        repeats=args.repeats or int(preset["repeats"]),
        warmup_s=args.warmup_s or preset["warmup_s"],
        window_s=args.window_s or preset["window_s"],
        bare_s=args.bare_s or preset["bare_s"],
        connections=args.connections,
        profile_dir=args.profile,
        ingest=args.ingest,
        prebuild=not args.live_bodies,
    )


def main(argv: Sequence[str] | None = None) -> int:
    plan = parse_plan(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    runs = asyncio.run(run_plan(plan))
    summary = summary_json(plan, runs)
    w = plan.workload
    summary.update(
        quick=plan.quick,
        repeats=plan.repeats,
        warmup_s=plan.warmup_s,
        window_s=plan.window_s,
        bare_s=plan.bare_s,
        world_size=w.world_size,
        agents=w.agents,
        ranks_per_agent=w.ranks_per_agent,
        steps_per_batch=w.steps_per_batch,
        records_per_post=w.records_per_post,
        steps_per_post=w.steps_per_post,
        collective_every=w.collective_every,
        connections=plan.connections,
        sample_definition=(
            "non-null STEP_SAMPLE_FIELDS of a step + 4 per collective + 4 per bucket"
        ),
        profiled=plan.profile_dir is not None,
        ingest=plan.ingest,
        prebuilt_bodies=plan.prebuild,
        cpus=os.cpu_count(),
        load_average_before=round(load_before, 2),
        wall_s=round(time.perf_counter() - started, 1),
    )
    print(_table.format_table(COLUMNS, runs))
    print(verdict(summary))
    print_profiles(plan)
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
