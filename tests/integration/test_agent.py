"""``torshmon agent`` as a real process between a real gloo job and a real HTTP receiver."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.ingest_stub import IngestStub
from tests.integration.multinode import train_until_stopped
from torshmon.agent.daemon import Agent, AgentSettings
from torshmon.catalogue import metrics as catalogue
from torshmon.launch import free_port, run_ranks
from torshmon.wire import (
    FRAME_HEADER,
    SCHEMA_VERSION,
    Batch,
    Command,
    Hello,
    IngestReply,
    SpoolRecord,
    StepRecord,
    decode_ack,
    decode_json,
    encode_frame,
    frame_length,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 240
#: How long the aggregator stays away in the outage test (the issue asks for 30 s).
OUTAGE_S = float(os.environ.get("TORSHMON_TEST_OUTAGE_S", "30"))


class AgentProcess:
    """``torshmon agent`` in a subprocess; restartable on the same socket and spool."""

    def __init__(self, tmp: Path, aggregator: str | None, token: str | None) -> None:
        self.socket = tmp / "agent.sock"
        self.spool = tmp / "spool.db"
        self.metrics_port = free_port()
        self.log = tmp / "agent.log"
        self._args = [
            sys.executable, "-m", "torshmon.cli", "-v", "agent",
            "--socket", str(self.socket),
            "--metrics-port", str(self.metrics_port),
            "--spool", str(self.spool),
            "--sample-interval-s", "0.5",
            "--node", "test-node",
        ]  # fmt: skip
        if aggregator is not None:
            self._args += ["--aggregator", aggregator]
        if token is not None:
            token_file = tmp / "token"
            token_file.write_text(token)
            self._args += ["--token-file", str(token_file)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self._args, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {self.log.read_text()}")
            try:
                self.get("/healthz")
                if self.socket.exists():
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"agent did not come up: {self.log.read_text()}")

    def get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(self.get("/metrics")):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        raise KeyError(name)

    def labels(self, name: str, **match: str) -> list[dict[str, str]]:
        """The label sets of the samples of ``name`` whose labels include ``match``."""
        return [
            sample.labels
            for family in text_string_to_metric_families(self.get("/metrics"))
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in match.items())
        ]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture
def stub() -> Iterator[IngestStub]:
    server = IngestStub(free_port()).start()
    try:
        yield server
    finally:
        server.close()


def _train(rank: int, world: int, sock: str, job: str, steps: int, pause_s: float) -> list[float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon
    from tests.integration.test_probe import _model

    ddp = DistributedDataParallel(_model())
    monitor = torshmon.attach(ddp, job=job, agent_socket=sock, flush_interval_s=0.1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with monitor.step(batch_size=4):
            time.sleep(pause_s)
            optimizer.zero_grad()
            ddp(torch.randn(4, 32)).sum().backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    monitor.close(timeout_s=10)
    return times


def _wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _every_step_by_seq(stub: IngestStub, job: str, ranks: int, steps: int) -> bool:
    """Whether every step 1..``steps`` of each rank of ``job`` arrived, once per
    (session, seq): a batch the dead agent had stored but not acknowledged comes again
    from the probe under the same (session, seq), which the aggregator deduplicates."""
    seen: dict[tuple[str, int], Batch] = {}
    for batch in stub.batches():
        if batch.job == job:
            seen[(batch.session, batch.seq)] = batch
    got: dict[int, list[int]] = {}
    for batch in seen.values():
        got.setdefault(batch.rank, []).extend(s.step for s in batch.steps)
    return all(sorted(got.get(r, [])) == list(range(1, steps + 1)) for r in range(ranks))


def _exactly_once(stub: IngestStub, job: str, ranks: int, steps: int) -> bool:
    got = stub.steps(job)
    return all(got.get(rank) == list(range(1, steps + 1)) for rank in range(ranks))


def test_aggregator_outage_loses_nothing_and_duplicates_nothing(
    tmp_path: Path, stub: IngestStub
) -> None:
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    steps = int((OUTAGE_S + 10) / 0.1)
    try:
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(
                run_ranks, _train, 2, str(agent.socket), "outage", steps, 0.1, timeout_s=TIMEOUT_S
            )
            _wait_for(lambda: stub.steps("outage"), 30, "the first records")
            stub.stop()
            time.sleep(OUTAGE_S)
            spooled = agent.metric("torshmon_agent_spool_records")
            stub.start()
            job.result()
        _wait_for(lambda: _exactly_once(stub, "outage", 2, steps), 60, "every step exactly once")
        assert spooled > 0
        assert agent.stop() == 0
    finally:
        agent.stop()


def test_agent_killed_and_restarted_keeps_training_going_and_the_spool_intact(
    tmp_path: Path, stub: IngestStub
) -> None:
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    steps = 120
    try:
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(
                run_ranks, _train, 2, str(agent.socket), "kill", steps, 0.05, timeout_s=TIMEOUT_S
            )
            _wait_for(lambda: stub.steps("kill"), 30, "the first records")
            agent.kill()
            time.sleep(1.5)
            agent.start()
            times = job.result()

        _wait_for(
            lambda: _every_step_by_seq(stub, "kill", 2, steps), 60, "every step after the restart"
        )
        for rank_times in times:
            # the probe never waits on the agent: no step stalls while it is down
            assert max(rank_times) < 1.0, max(rank_times)
    finally:
        agent.stop()


def test_a_job_ending_right_after_an_agent_restart_loses_nothing(
    tmp_path: Path, stub: IngestStub
) -> None:
    """Steps taken during a 6 s agent outage (~60 flushes at 0.1 s) all arrive although
    the job stops as soon as the agent is back and closes with the probe's default 5 s
    flush: the outage's steps wait in a few full batches, not one per flush."""
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    stop_file = tmp_path / "stop"
    try:
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(
                run_ranks, train_until_stopped, 2, str(stop_file), 0.01, "brief", str(agent.socket),
                timeout_s=TIMEOUT_S,
            )  # fmt: skip
            try:
                _wait_for(lambda: stub.steps("brief"), 30, "the first records")
                agent.kill()
                time.sleep(6.0)  # the outage: training goes on without an agent
                agent.start()
            finally:
                stop_file.touch()
                [last, *others] = job.result()
        assert set(others) <= {last}
        _wait_for(lambda: _every_step_by_seq(stub, "brief", 2, last), 30, "every step")
    finally:
        agent.stop()


def _junk_client(path: Path, stop: threading.Event) -> int:
    sent = 0
    while not stop.is_set():
        for junk in (
            os.urandom(64),
            FRAME_HEADER.pack(20) + b'{"kind":"batch","v":1',  # truncated JSON
            FRAME_HEADER.pack(9) + b"not json!",
            FRAME_HEADER.pack(0xFFFFFFF0),  # absurd length
        ):
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                    s.sendall(junk)
                    sent += 1
            except OSError:
                pass
        time.sleep(0.05)
    return sent


def test_garbage_on_the_socket_is_counted_and_the_job_still_served(
    tmp_path: Path, stub: IngestStub
) -> None:
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    stop = threading.Event()
    steps = 60
    try:
        with ThreadPoolExecutor(2) as pool:
            junk = pool.submit(_junk_client, agent.socket, stop)
            run_ranks(_train, 2, str(agent.socket), "junk", steps, 0.02, timeout_s=TIMEOUT_S)
            stop.set()
            assert junk.result() > 10
        _wait_for(lambda: _exactly_once(stub, "junk", 2, steps), 30, "the real job's steps")
        assert agent.metric("torshmon_agent_frames_rejected_total") > 10
    finally:
        stop.set()
        agent.stop()


def test_wrong_token_keeps_data_spooled_and_says_so(tmp_path: Path, stub: IngestStub) -> None:
    agent = AgentProcess(tmp_path, stub.url, "not-the-token").start()
    try:
        run_ranks(_train, 2, str(agent.socket), "token", 20, 0.01, timeout_s=TIMEOUT_S)
        _wait_for(lambda: stub.rejected_auth > 0, 30, "the aggregator to reject the token")
        assert stub.records == {}
        assert agent.metric("torshmon_agent_spool_records") > 0
        assert agent.metric("torshmon_agent_forward_up") == 0
        _wait_for(lambda: "token" in agent.log.read_text(), 10, "the auth failure in the log")
        assert "not-the-token" not in agent.log.read_text()
    finally:
        agent.stop()


def _spec_of(sample_name: str) -> catalogue.MetricSpec | None:
    """The catalogue's spec of a sample (a histogram's _bucket/_sum/_count included)."""
    for suffix in ("", "_bucket", "_sum", "_count", "_created"):
        if suffix and not sample_name.endswith(suffix):
            continue
        spec = catalogue.METRICS.get(sample_name.removesuffix(suffix) if suffix else sample_name)
        if spec is not None:
            return spec
    return None


def test_metrics_are_valid_exposition_with_node_and_rank_series(
    tmp_path: Path, stub: IngestStub
) -> None:
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    stop_file = tmp_path / "stop"
    try:
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(
                run_ranks, train_until_stopped, 2, str(stop_file), 0.01, "metrics",
                str(agent.socket), timeout_s=TIMEOUT_S,
            )  # fmt: skip
            try:
                # The ranks' process facts are there while the ranks run.
                _wait_for(
                    lambda: len(agent.labels("torshmon_rank_memory_rss_bytes", job="metrics")) == 2,
                    60,
                    "both ranks' process samples",
                )
                text = agent.get("/metrics")
            finally:
                stop_file.touch()
                steps = job.result()
        assert len(set(steps)) == 1
        samples = {
            sample.name for f in text_string_to_metric_families(text) for sample in f.samples
        }
        # Node facts and the ranks' process facts; job-level training series come from
        # the aggregator only (one exporter per series).
        for name in (
            "torshmon_memory_utilization_ratio",
            "torshmon_node_cpu_iowait_ratio",
            "torshmon_rank_memory_rss_bytes",
            "torshmon_rank_cpu_seconds_total",
            "torshmon_rank_info",
        ):
            assert name in samples, name
        ours = {name for name in samples if name.startswith(catalogue.PREFIX)}
        not_agents = {
            name for name in ours if (spec := _spec_of(name)) is None or spec.exporter != "agent"
        }
        assert not_agents <= {"torshmon_build_info"}, not_agents
        assert agent.metric("torshmon_memory_utilization_ratio", node="test-node") > 0
        ranks = {
            (sample.labels["rank"], sample.labels["local_rank"])
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "torshmon_rank_info" and sample.labels.get("job") == "metrics"
        }
        assert ranks == {("0", "0"), ("1", "1")}
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.fail("promtool not installed (the prometheus package); CI installs it")
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        agent.stop()


def test_sigterm_flushes_and_exits_cleanly(tmp_path: Path, stub: IngestStub) -> None:
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    run_ranks(_train, 2, str(agent.socket), "term", 10, 0.01, timeout_s=TIMEOUT_S)
    assert agent.stop() == 0
    assert _exactly_once(stub, "term", 2, 10)
    assert not agent.socket.exists()


def test_bad_flags_and_unreachable_aggregator(tmp_path: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "torshmon.cli", "agent", "--metrics-port", "99999"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--metrics-port" in bad.stderr
    url = subprocess.run(
        [sys.executable, "-m", "torshmon.cli", "agent", "--aggregator", "ftp://x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert url.returncode == 2 and "aggregator url" in url.stderr
    # nothing listens there: the agent starts anyway, spools, and says why
    agent = AgentProcess(tmp_path, f"http://127.0.0.1:{free_port()}", "secret").start()
    try:
        run_ranks(_train, 2, str(agent.socket), "unreachable", 10, 0.01, timeout_s=TIMEOUT_S)
        _wait_for(lambda: agent.metric("torshmon_agent_spool_records") > 0, 10, "spooling")
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        assert agent.stop() == 0


def test_commands_reach_rank_0_and_their_acks_come_back(tmp_path: Path, stub: IngestStub) -> None:
    stub.commands = [
        Command(id="first", job="relay", kind="config", args={"codec": "bf16"}),
        Command(id="bad", job="relay", kind="config", args={"codec": "zstd"}),
        Command(id="odd", job="relay", kind="config", args={"bucket_mb": 4}),
        # Queued before "first" was applied: it replaces it, and "first" is told so.
        Command(id="good", job="relay", kind="config", args={"codec": "fp16"}),
    ]
    agent = AgentProcess(tmp_path, stub.url, "secret").start()
    try:
        run_ranks(_train, 2, str(agent.socket), "relay", 40, 0.05, timeout_s=TIMEOUT_S)
        acks = {a.id: a for b in stub.batches() for a in b.command_acks if a.status != "accepted"}
        assert acks["good"].status == "applied" and acks["good"].effective_step is not None
        assert acks["bad"].status == "rejected" and "zstd" in acks["bad"].reason
        assert acks["odd"].status == "rejected" and "bucket_mb" in acks["odd"].reason
        assert acks["first"].status == "rejected" and "superseded" in acks["first"].reason
        effective = acks["good"].effective_step
        for rank in range(2):
            records = [s for b in stub.batches() if b.rank == rank for s in b.steps]
            applied = [s.applied_config for s in records if s.applied_config is not None]
            assert [a.codec for a in applied] == ["fp16"]
            assert applied[0].effective_step == effective
    finally:
        agent.stop()


def _in_process_settings(tmp_path: Path) -> AgentSettings:
    """An agent run in the test's own event loop, forwarding nowhere, not sampling."""
    return AgentSettings(
        socket_path=str(tmp_path / "agent.sock"),
        metrics_port=0,
        spool_path=str(tmp_path / "spool.db"),
        node="n1",
        sample_interval_s=3600.0,
    )


async def test_acks_wait_for_the_durable_write_and_one_window_shares_one_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _in_process_settings(tmp_path)
    async with Agent(settings) as agent:
        appended: list[bytes] = []
        append = agent.spool.append

        def slow_append(payload: bytes) -> int:
            time.sleep(0.2)  # a slow disk: no probe may hear "stored" before this returns
            seq = append(payload)
            appended.append(payload)
            return seq

        monkeypatch.setattr(agent.spool, "append", slow_append)
        clients = [await asyncio.open_unix_connection(settings.socket_path) for _ in range(8)]
        sessions = [f"window-{rank}-{uuid.uuid4().hex}" for rank in range(8)]
        started = time.monotonic()
        for rank, (_, writer) in enumerate(clients):
            writer.write(encode_frame(_hello(sessions[rank], rank)))
            writer.write(encode_frame(_probe_batch(sessions[rank], rank)))
        for rank, (reader, writer) in enumerate(clients):
            header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER.size), 10)
            ack = decode_ack(await reader.readexactly(frame_length(header)))
            assert ack.seq == 1
            assert time.monotonic() - started >= 0.2
            assert any(sessions[rank].encode() in record for record in appended)
            writer.close()
        records = [decode_json(r, SpoolRecord) for r in appended]
        records = [r for r in records if r.messages]
        # 16 frames sent at once are read in one pass (two at most, should the
        # window close in between) and committed as one record each.
        assert 1 <= len(records) <= 2
        assert sorted(m.session for r in records for m in r.messages if isinstance(m, Batch)) == (
            sorted(sessions)
        )


def _hello(session: str, rank: int) -> Hello:
    return Hello(
        v=SCHEMA_VERSION,
        session=session,
        job="window",
        rank=rank,
        world_size=8,
        local_rank=rank,
        node="n1",
        pid=os.getpid(),
        backend="gloo",
        torch_version="test",
        probe_version="test",
    )


def _probe_batch(session: str, rank: int) -> Batch:
    step = StepRecord(
        step=1,
        end_unix_ns=time.time_ns(),
        duration_s=0.1,
        comm_wait_s=0.01,
        compute_s=0.09,
        communication_time_ratio=0.1,
        comm_busy_s=0.01,
    )
    return Batch(
        v=SCHEMA_VERSION,
        session=session,
        seq=1,
        job="window",
        rank=rank,
        sent_unix_ns=time.time_ns(),
        dropped_records_total=0,
        steps=[step],
    )


async def test_an_urgent_step_is_complete_once_every_rank_here_brought_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent tells its forwarder a step is complete (stop gathering, POST) once
    every connected probe of the job has brought the job's newest step: a straggler's
    record, the last of its step, goes out at once."""
    settings = _in_process_settings(tmp_path)
    async with Agent(settings) as agent:
        said: list[tuple[bool, bool]] = []
        append = agent._append_raw

        def noted(record: bytes, *, urgent: bool = False, complete: bool = False) -> None:
            if b'"steps"' in record:
                said.append((urgent, complete))
            append(record, urgent=urgent, complete=complete)

        monkeypatch.setattr(agent, "_append_raw", noted)
        sessions = [f"lane-{rank}-{uuid.uuid4().hex}" for rank in range(2)]
        clients = [await asyncio.open_unix_connection(settings.socket_path) for _ in range(2)]
        seqs = [0, 0]

        async def send(rank: int, step: int) -> None:
            reader, writer = clients[rank]
            seqs[rank] += 1
            batch = msgspec.structs.replace(
                _probe_batch(sessions[rank], rank), seq=seqs[rank], urgent=True
            )
            batch = msgspec.structs.replace(
                batch, steps=[msgspec.structs.replace(batch.steps[0], step=step)]
            )
            writer.write(encode_frame(batch))
            header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER.size), 10)
            assert decode_ack(await reader.readexactly(frame_length(header))).seq == seqs[rank]

        for rank, (_, writer) in enumerate(clients):
            writer.write(encode_frame(_hello(sessions[rank], rank)))
        # Another job's probe that has brought no step: not a rank of this job's steps.
        _, other = await asyncio.open_unix_connection(settings.socket_path)
        other.write(encode_frame(msgspec.structs.replace(_hello("other", 0), job="other")))
        await asyncio.sleep(0.5)  # the hellos read (a window is 0.1 s)
        await send(0, 5)  # rank 1 has not brought step 5: gather
        await send(1, 5)  # the step is complete here
        await send(1, 6)  # the straggler is rank 0 now
        await send(0, 6)
        assert said == [(True, False), (True, True), (True, False), (True, True)]
        for _, writer in [*clients, (None, other)]:
            writer.close()


def test_a_command_for_one_run_waits_for_that_runs_rank_0(tmp_path: Path) -> None:
    """Two launches of job "window" run beside each other: a command made for the latest
    run is not handed to the older run's rank 0, which takes only its own (and those
    for any run); the latest run's rank 0 then takes it."""
    agent = Agent(_in_process_settings(tmp_path))
    try:
        old = msgspec.structs.replace(_hello("old-0", 0), run_id="r1")
        new = msgspec.structs.replace(_hello("new-0", 0), run_id="r2")
        commands = [
            Command(id="for-r2", job="window", kind="config", run_id="r2"),
            Command(id="for-any", job="window", kind="config"),
            Command(id="for-r1", job="window", kind="config", run_id="r1"),
        ]
        agent._on_reply(IngestReply(v=SCHEMA_VERSION, acked_seq=1, commands=commands))
        assert [c.id for c in agent._commands_for(old)] == ["for-any", "for-r1"]
        assert [c.id for c in agent._commands_for(old)] == []
        assert [c.id for c in agent._commands_for(new)] == ["for-r2"]
    finally:
        agent.spool.close()
