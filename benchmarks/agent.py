"""CPU and memory of the per-node agent (``torshmon agent``) serving many local ranks.

For each rank count (8 and 64 by default) a fresh agent process with a fresh spool
serves that many simulated ranks, all driven from this one process over the real
Unix-socket wire protocol: per rank one connection, one ``hello``, then every
``--flush-interval-s`` a ``batch`` of the steps since the previous one (10 steps/s,
realistic step records), waiting for the agent's ``ack`` before the next, as the
probe does. The agent forwards to a counting stand-in for the aggregator's ingest
API running on this process's event loop.

The agent's CPU is its own ``cpu_times()`` (user + system, all its threads) over a
window after a warm-up, divided by the window's wall time: a fraction of one core.
RSS is the largest of samples taken through the window. After the window the ranks
stop, the agent drains, and every step record sent must have reached the stand-in.
``/metrics`` is scraped every ``--scrape-interval-s`` (15 s, as Prometheus would;
0: never) from the start, so a window of W seconds holds about W / 15 scrapes.

Prints one row per run, then (the last line of stdout) one JSON object.

Usage::

    python benchmarks/agent.py --quick          # under a minute
    python benchmarks/agent.py                  # a few minutes
    python benchmarks/agent.py --profile DIR    # also cProfile the agent (slower)
    python benchmarks/agent.py --urgent --flush-interval-s 0.05 --steps-per-s 20  # lanes open
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _table  # benchmarks/ is the script's own folder, first on sys.path
import aiohttp
import psutil
from aiohttp import web

from torshmon.launch import free_port
from torshmon.wire import (
    DURATION_BUCKETS_S,
    FRAME_HEADER,
    SCHEMA_VERSION,
    Batch,
    CollectiveStat,
    DdpStats,
    Hello,
    IngestBatch,
    IngestReply,
    StepRecord,
    decode_ack,
    decode_json,
    encode_frame,
    encode_json,
    frame_length,
)

TOKEN = "bench-token"
JOB = "bench"
#: Targets at 64 ranks.
TARGET_CPU_CORE_FRACTION = 0.05
TARGET_RSS_MB = 100.0
DDP_STATS_EVERY = 50
RSS_SAMPLE_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class Plan:
    """What one benchmark invocation runs."""

    quick: bool
    ranks: tuple[int, ...]
    repeats: int
    warmup_s: float
    window_s: float
    steps_per_s: float
    flush_interval_s: float
    drain_timeout_s: float
    scrape_interval_s: float
    pin: bool
    profile_dir: Path | None
    #: Every batch marked urgent: every rank's fast lane open, the agent's worst case
    #: (short read windows, gathered and paced POSTs).
    urgent: bool = False


QUICK = {"repeats": 1, "warmup_s": 3.0, "window_s": 8.0}
FULL = {"repeats": 2, "warmup_s": 5.0, "window_s": 30.0}


# -- the aggregator stand-in ----------------------------------------------------------
class IngestCounter:
    """``POST /api/v1/ingest`` on the running event loop: counts what the agent delivers.

    Records are counted once per seq (a resent record is a duplicate, not a new one);
    the reply acknowledges the highest seq seen. ``start()`` / ``aclose()``.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._seqs: set[int] = set()
        self._runner: web.AppRunner | None = None
        self.posts = 0
        self.records = 0
        self.duplicates = 0
        self.batches = 0
        self.step_records = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/api/v1/ingest", self._ingest)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _ingest(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self._token}":
            return web.json_response({"error": "bad token"}, status=401)
        body = await request.read()  # aiohttp has already undone the gzip encoding
        self.posts += 1
        for item in decode_json(body, IngestBatch).records:
            if item.seq in self._seqs:
                self.duplicates += 1
                continue
            self._seqs.add(item.seq)
            self.records += 1
            for message in item.record.messages:
                if isinstance(message, Batch):
                    self.batches += 1
                    self.step_records += len(message.steps)
        reply = IngestReply(v=SCHEMA_VERSION, acked_seq=max(self._seqs, default=0))
        return web.Response(body=encode_json(reply), content_type="application/json")


# -- the simulated ranks --------------------------------------------------------------
def _histogram(durations_s: Sequence[float]) -> list[int]:
    """Counts per DURATION_BUCKETS_S bucket, plus the overflow bucket."""
    counts = [0] * (len(DURATION_BUCKETS_S) + 1)
    for d in durations_s:
        counts[next((i for i, b in enumerate(DURATION_BUCKETS_S) if d <= b), -1)] += 1
    return counts


def _collective(op: str, count: int, size_bytes: int, each_s: float) -> CollectiveStat:
    total_s = count * each_s
    algbw = size_bytes / total_s
    return CollectiveStat(
        op=op,
        pg="default",
        dtype="torch.float32",
        count=count,
        size_bytes=size_bytes,
        duration_s=total_s,
        max_duration_s=each_s * 1.3,
        algbw_bytes_per_s=algbw,
        busbw_bytes_per_s=algbw * 2 * 7 / 8,
        duration_hist=_histogram([each_s] * (count - 1) + [each_s * 1.3]),
    )


def step_record(step: int, rank: int, end_unix_ns: int, step_s: float) -> StepRecord:
    """A plausible DDP step of ``step_s`` seconds: 25 bucket all-reduces, a small
    broadcast, phase splits, a loss, and DdpStats every DDP_STATS_EVERY steps."""
    jitter = 1.0 + 0.01 * ((step * 7 + rank * 13) % 11 - 5)
    duration_s = step_s * jitter
    comm_wait_s = 0.18 * duration_s
    ddp = None
    if step % DDP_STATS_EVERY == 0:
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
        step=step,
        end_unix_ns=end_unix_ns,
        duration_s=duration_s,
        comm_wait_s=comm_wait_s,
        compute_s=duration_s - comm_wait_s,
        communication_time_ratio=comm_wait_s / duration_s,
        comm_busy_s=0.35 * duration_s,
        forward_s=0.3 * duration_s,
        backward_s=0.6 * duration_s,
        optimizer_s=0.08 * duration_s,
        batch_size=64,
        samples_per_s=64 / duration_s,
        loss=2.5 / (1.0 + 0.001 * step) + 0.001 * rank,
        collectives=[
            _collective("all_reduce", 25, 117_440_512, 0.0014 * duration_s / step_s),
            _collective("broadcast", 1, 4096, 0.00004),
        ],
        ddp=ddp,
    )


@dataclass(slots=True)
class RankStats:
    """What one simulated rank did; written by its task only."""

    frames: int = 0
    batches: int = 0
    steps: int = 0
    ack_latencies_s: list[float] = field(default_factory=list)


class SimulatedRank:
    """One rank's probe connection: hello, then a batch every interval, ack before the next."""

    def __init__(self, rank: int, world_size: int, plan: Plan, socket_path: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self._plan = plan
        self._socket_path = socket_path
        self._session = f"{JOB}-{rank}-{uuid.uuid4().hex[:12]}"
        self._steps_per_batch = round(plan.steps_per_s * plan.flush_interval_s)
        self._step = 0
        self.stats = RankStats()

    async def run(self, start_at: float, stop: asyncio.Event) -> None:
        """Send batches from ``start_at`` (loop time) until ``stop``, then close."""
        reader, writer = await asyncio.open_unix_connection(self._socket_path)
        try:
            await self._send(writer, self._hello())
            loop = asyncio.get_running_loop()
            deadline = start_at
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, deadline - loop.time()))
                if stop.is_set():
                    break
                await self._round_trip(reader, writer)
                # A slow ack delays the next batch (as in the probe) but does not cause a burst.
                deadline = max(deadline + self._plan.flush_interval_s, loop.time())
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _round_trip(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        batch = self._next_batch()
        sent = time.perf_counter()
        await self._send(writer, batch)
        ack = decode_ack(
            await reader.readexactly(frame_length(await reader.readexactly(FRAME_HEADER.size)))
        )
        if ack.seq != batch.seq:
            raise RuntimeError(f"rank {self.rank}: ack for seq {ack.seq}, expected {batch.seq}")
        self.stats.ack_latencies_s.append(time.perf_counter() - sent)
        self.stats.batches += 1
        self.stats.steps += len(batch.steps)

    async def _send(self, writer: asyncio.StreamWriter, message: Hello | Batch) -> None:
        writer.write(encode_frame(message))
        await writer.drain()
        self.stats.frames += 1

    def _hello(self) -> Hello:
        return Hello(
            v=SCHEMA_VERSION,
            session=self._session,
            job=JOB,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.rank,
            node="bench",
            pid=os.getpid(),
            backend="nccl",
            torch_version="2.4.0",
            probe_version="bench",
        )

    def _next_batch(self) -> Batch:
        now_ns = time.time_ns()
        step_s = 1.0 / self._plan.steps_per_s
        steps = []
        for i in range(self._steps_per_batch):
            self._step += 1
            end_ns = now_ns - int((self._steps_per_batch - 1 - i) * step_s * 1e9)
            steps.append(step_record(self._step, self.rank, end_ns, step_s))
        return Batch(
            v=SCHEMA_VERSION,
            session=self._session,
            seq=self.stats.batches + 1,
            job=JOB,
            rank=self.rank,
            sent_unix_ns=now_ns,
            dropped_records_total=0,
            steps=steps,
            urgent=self._plan.urgent,
        )


# -- one measurement ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunResult:
    """One agent process serving ``ranks`` ranks for one measurement window."""

    ranks: int
    repeat: int
    cpu_core_fraction: float
    main_thread_fraction: float
    rss_mb: float
    frames_sent: int
    batches_sent: int
    steps_sent: int
    steps_received: int
    records_received: int
    duplicates: int
    posts: int
    ack_p50_s: float
    ack_p99_s: float
    drain_s: float
    scrapes: int
    wall_s: float

    @property
    def steps_lost(self) -> int:
        return self.steps_sent - self.steps_received


def _agent_command(
    plan: Plan, tmp: Path, aggregator_url: str, metrics_port: int, tag: str
) -> list[str]:
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    agent = ["-m", "torshmon.cli", "agent", "--socket", str(tmp / "agent.sock")]
    agent += ["--metrics-port", str(metrics_port), "--aggregator", aggregator_url]
    agent += ["--token-file", str(token_file), "--spool", str(tmp / "spool.db")]
    agent += ["--sample-interval-s", "2", "--node", "bench"]
    if plan.profile_dir is None:
        return [sys.executable, *agent]
    profile = plan.profile_dir / f"agent-{tag}.prof"
    return [sys.executable, "-c", _PROFILED_AGENT, str(profile), *agent[2:]]


# The agent's main thread under cProfile timed by CPU (thread_time), not wall time: the
# event loop's idle epoll waits and fsync waits would otherwise dominate. Worker
# threads (asyncio.to_thread) are not profiled; the table's "worker %" shows their share.
_PROFILED_AGENT = """
import cProfile, runpy, sys, time
out = sys.argv.pop(1)
profiler = cProfile.Profile(time.thread_time)
try:
    profiler.runcall(runpy.run_module, "torshmon.cli", run_name="__main__")
except SystemExit:
    pass
finally:
    profiler.dump_stats(out)
"""


async def _wait_for_socket(path: Path, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None:
            raise RuntimeError(f"the agent exited with code {process.returncode} before serving")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agent did not create {path} within {timeout_s} s")
        await asyncio.sleep(0.05)


def _cpu_s(process: psutil.Process) -> tuple[float, float]:
    """CPU seconds (user + system) of the whole process and of its main thread."""
    times = process.cpu_times()
    main = next((t for t in process.threads() if t.id == process.pid), None)
    main_s = main.user_time + main.system_time if main is not None else float("nan")
    return float(times.user + times.system), float(main_s)


@dataclass(frozen=True, slots=True)
class Window:
    """The agent over one measurement window: fractions of one core, largest RSS."""

    cpu_core_fraction: float
    main_thread_fraction: float
    rss_mb: float


async def _window(process: psutil.Process, window_s: float) -> Window:
    rss: list[int] = []
    loop = asyncio.get_running_loop()
    (cpu0, main0), t0 = _cpu_s(process), loop.time()
    while (elapsed := loop.time() - t0) < window_s:
        rss.append(process.memory_info().rss)
        await asyncio.sleep(min(RSS_SAMPLE_INTERVAL_S, window_s - elapsed))
    (cpu1, main1), t1 = _cpu_s(process), loop.time()
    rss.append(process.memory_info().rss)
    wall_s = t1 - t0
    return Window((cpu1 - cpu0) / wall_s, (main1 - main0) / wall_s, max(rss) / (1024 * 1024))


async def _scrape_forever(url: str, interval_s: float, scraped: list[int]) -> None:
    """GET ``url`` every ``interval_s`` (appending each body's size to ``scraped``)."""
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as response:
                    body = await response.read()
                    response.raise_for_status()
                scraped.append(len(body))
            except aiohttp.ClientError as exc:
                print(f"scrape of {url} failed: {exc}", file=sys.stderr)
            await asyncio.sleep(interval_s)


async def _drain(counter: IngestCounter, steps_sent: int, timeout_s: float) -> float:
    """Seconds until the stand-in has every sent step (or the timeout passed)."""
    started = time.monotonic()
    while counter.step_records < steps_sent and time.monotonic() - started < timeout_s:
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def _stop_agent(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _pin(process: psutil.Process, enabled: bool) -> None:
    """The agent gets CPU 0, this process the others, so the ranks do not crowd it."""
    cpus = sorted(psutil.Process().cpu_affinity() or [])
    if enabled and len(cpus) >= 2:
        process.cpu_affinity(cpus[:1])
        psutil.Process().cpu_affinity(cpus[1:])


async def measure(plan: Plan, ranks: int, repeat: int) -> RunResult:
    """Start an agent, run ``ranks`` ranks through warm-up and window, drain, stop."""
    started = time.perf_counter()
    counter = IngestCounter(TOKEN)
    await counter.start()
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        metrics_port = free_port()
        command = _agent_command(plan, tmp, counter.url, metrics_port, f"{ranks}-{repeat}")
        agent = subprocess.Popen(command)
        scraped: list[int] = []
        scraper: asyncio.Task[None] | None = None
        try:
            await _wait_for_socket(tmp / "agent.sock", agent, timeout_s=30)
            process = psutil.Process(agent.pid)
            _pin(process, plan.pin)
            sims = [SimulatedRank(r, ranks, plan, str(tmp / "agent.sock")) for r in range(ranks)]
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            # Ranks spread over one interval, as independent processes would be.
            offsets = [loop.time() + plan.flush_interval_s * r / ranks for r in range(ranks)]
            tasks = [
                asyncio.create_task(s.run(at, stop)) for s, at in zip(sims, offsets, strict=True)
            ]
            if plan.scrape_interval_s > 0:
                url = f"http://127.0.0.1:{metrics_port}/metrics"
                scraper = asyncio.create_task(_scrape_forever(url, plan.scrape_interval_s, scraped))
            await asyncio.sleep(plan.warmup_s)
            window = await _window(process, plan.window_s)
            stop.set()
            await asyncio.gather(*tasks)
            stats = [s.stats for s in sims]
            steps_sent = sum(s.steps for s in stats)
            drain_s = await _drain(counter, steps_sent, plan.drain_timeout_s)
        finally:
            if scraper is not None:
                scraper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scraper
            _stop_agent(agent)
            await counter.aclose()
    latencies = sorted(t for s in stats for t in s.ack_latencies_s)
    return RunResult(
        ranks=ranks,
        repeat=repeat,
        cpu_core_fraction=window.cpu_core_fraction,
        main_thread_fraction=window.main_thread_fraction,
        rss_mb=window.rss_mb,
        frames_sent=sum(s.frames for s in stats),
        batches_sent=sum(s.batches for s in stats),
        steps_sent=steps_sent,
        steps_received=counter.step_records,
        records_received=counter.records,
        duplicates=counter.duplicates,
        posts=counter.posts,
        ack_p50_s=_quantile(latencies, 0.5),
        ack_p99_s=_quantile(latencies, 0.99),
        drain_s=drain_s,
        scrapes=len(scraped),
        wall_s=time.perf_counter() - started,
    )


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0  # no batches (the idle agent); JSON has no NaN
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run_plan(plan: Plan) -> list[RunResult]:
    """Every (ranks, repeat), repeats interleaved so a slow spell of the VM hits all."""
    results = []
    for repeat in range(plan.repeats):
        for ranks in plan.ranks:
            results.append(await measure(plan, ranks, repeat))
            print(f"  {ranks} ranks, repeat {repeat}: done", file=sys.stderr, flush=True)
    return results


# -- the report -----------------------------------------------------------------------
COLUMNS: tuple[tuple[str, Callable[[RunResult], str]], ...] = (
    ("ranks", lambda r: str(r.ranks)),
    ("repeat", lambda r: str(r.repeat)),
    ("cpu % core", lambda r: f"{100 * r.cpu_core_fraction:.2f}"),
    ("worker %", lambda r: f"{100 * (r.cpu_core_fraction - r.main_thread_fraction):.2f}"),
    ("rss MB", lambda r: f"{r.rss_mb:.1f}"),
    ("frames", lambda r: str(r.frames_sent)),
    ("steps sent", lambda r: str(r.steps_sent)),
    ("steps recv", lambda r: str(r.steps_received)),
    ("records", lambda r: str(r.records_received)),
    ("posts", lambda r: str(r.posts)),
    ("ack p50 ms", lambda r: f"{r.ack_p50_s * 1e3:.1f}"),
    ("ack p99 ms", lambda r: f"{r.ack_p99_s * 1e3:.1f}"),
    ("drain s", lambda r: f"{r.drain_s:.2f}"),
    ("scrapes", lambda r: str(r.scrapes)),
)


def summary_json(plan: Plan, results: Sequence[RunResult]) -> dict[str, Any]:
    """Per rank count: medians over repeats of CPU and RSS, sums of what was counted."""
    out: dict[str, Any] = {}
    for ranks in plan.ranks:
        runs = [r for r in results if r.ranks == ranks]
        out[f"cpu_core_fraction_{ranks}"] = statistics.median(r.cpu_core_fraction for r in runs)
        out[f"worker_thread_fraction_{ranks}"] = statistics.median(
            r.cpu_core_fraction - r.main_thread_fraction for r in runs
        )
        out[f"rss_mb_{ranks}"] = statistics.median(r.rss_mb for r in runs)
        out[f"ack_p99_ms_{ranks}"] = statistics.median(r.ack_p99_s * 1e3 for r in runs)
        out[f"frames_sent_{ranks}"] = sum(r.frames_sent for r in runs)
        out[f"batches_sent_{ranks}"] = sum(r.batches_sent for r in runs)
        out[f"steps_sent_{ranks}"] = sum(r.steps_sent for r in runs)
        out[f"steps_received_{ranks}"] = sum(r.steps_received for r in runs)
        out[f"records_received_{ranks}"] = sum(r.records_received for r in runs)
    out["steps_lost"] = sum(r.steps_lost for r in results)
    out["duplicates"] = sum(r.duplicates for r in results)
    return out


def verdict(summary: dict[str, Any], plan: Plan) -> str:
    largest = max(plan.ranks)
    cpu, rss = summary[f"cpu_core_fraction_{largest}"], summary[f"rss_mb_{largest}"]
    ok = cpu < TARGET_CPU_CORE_FRACTION and rss < TARGET_RSS_MB
    return (
        f"{largest} ranks: {100 * cpu:.2f}% of a core, {rss:.1f} MB RSS "
        f"(target < {100 * TARGET_CPU_CORE_FRACTION:.0f}%, < {TARGET_RSS_MB:.0f} MB): "
        + ("within target" if ok else "OVER TARGET")
        + f"; step records lost: {summary['steps_lost']}"
    )


def print_profiles(plan: Plan, limit: int = 15) -> None:
    """The agent's top functions by own time, for the largest rank count's first run."""
    if plan.profile_dir is None:
        return
    path = plan.profile_dir / f"agent-{max(plan.ranks)}-0.prof"
    if not path.exists():
        print(f"no profile at {path}")
        return
    print(f"\nagent profile ({path}), top {limit} by own time:")
    pstats.Stats(str(path), stream=sys.stdout).sort_stats("tottime").print_stats(limit)


# -- the command line -----------------------------------------------------------------
def _number(kind: type[int] | type[float], *, allow_zero: bool = False) -> Callable[[str], Any]:
    """An argparse type: a positive number of ``kind`` (or zero, where allowed)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < 0 or (value == 0 and not allow_zero):
            allowed = "a number >= 0" if allow_zero else "a positive number"
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value}")
        return value

    return parse


def parse_plan(argv: Sequence[str] | None = None) -> Plan:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short run per count (< 1 min)")
    parser.add_argument(
        "--ranks",
        type=_number(int, allow_zero=True),
        nargs="+",
        default=[8, 64],
        help="rank counts (8 64; 0 measures the idle agent)",
    )
    parser.add_argument("--repeats", type=_number(int), help="runs per rank count")
    parser.add_argument("--warmup-s", type=_number(float), help="seconds before the window")
    parser.add_argument("--window-s", type=_number(float), help="measurement window, seconds")
    parser.add_argument("--steps-per-s", type=_number(float), default=10.0, help="per rank (10)")
    parser.add_argument(
        "--flush-interval-s", type=_number(float), default=0.5, help="batch interval (0.5)"
    )
    parser.add_argument("--drain-timeout-s", type=_number(float), default=20.0)
    parser.add_argument(
        "--scrape-interval-s",
        type=_number(float, allow_zero=True),
        default=15.0,
        help="GET /metrics this often, from the start (15; 0: never)",
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin the agent to one CPU"
    )
    parser.add_argument("--profile", type=Path, help="cProfile the agent into this folder")
    parser.add_argument(
        "--urgent",
        action="store_true",
        help="mark every batch urgent (every fast lane open; with --flush-interval-s 0.05: "
        "a batch per 50 ms, the most an open lane sends)",
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    return Plan(
        quick=args.quick,
        ranks=tuple(args.ranks),
        repeats=args.repeats or int(preset["repeats"]),
        warmup_s=args.warmup_s or preset["warmup_s"],
        window_s=args.window_s or preset["window_s"],
        steps_per_s=args.steps_per_s,
        flush_interval_s=args.flush_interval_s,
        drain_timeout_s=args.drain_timeout_s,
        scrape_interval_s=args.scrape_interval_s,
        pin=args.pin,
        profile_dir=args.profile,
        urgent=args.urgent,
    )


def main(argv: Sequence[str] | None = None) -> int:
    plan = parse_plan(argv)
    started = time.perf_counter()
    results = asyncio.run(run_plan(plan))
    summary = summary_json(plan, results)
    summary.update(
        quick=plan.quick,
        repeats=plan.repeats,
        warmup_s=plan.warmup_s,
        window_s=plan.window_s,
        steps_per_s_per_rank=plan.steps_per_s,
        flush_interval_s=plan.flush_interval_s,
        scrape_interval_s=plan.scrape_interval_s,
        pinned=plan.pin,
        profiled=plan.profile_dir is not None,
        urgent=plan.urgent,
        cpus=os.cpu_count(),
        wall_s=round(time.perf_counter() - started, 1),
    )
    print(_table.format_table(COLUMNS, results))
    print(verdict(summary, plan))
    print_profiles(plan)
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
