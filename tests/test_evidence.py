"""Evidence capture: the probe's side (dump, bounded trace, caps) and the command book's
fan-out of evidence commands to every agent of a job."""

from __future__ import annotations

import gzip
import json
import os
import queue
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from tests.integration import wire_factory as wf
from torshmon.aggregator.core.commands import CommandBook, CommandError, CommandStatus
from torshmon.aggregator.evidence import EvidenceKeeper, EvidenceSettings
from torshmon.history.models import Base
from torshmon.history.store import HistoryStore
from torshmon.probe.evidence import (
    FLIGHT_RECORDER_FILE,
    PROFILER_TRACE_FILE,
    EvidenceArgsError,
    EvidenceCapture,
    dump_flight_recorder,
    pack,
    parse_request,
)
from torshmon.wire import (
    EVIDENCE_FILE_MAX_BYTES,
    Command,
    EvidenceFile,
    IngestBatch,
    decode_json,
)

WAIT_S = 60.0


def _command(**args: object) -> Command:
    return Command(id="c0ffee", job="j", kind="evidence", args=dict(args))


def _files(sent: queue.Queue[EvidenceFile], count: int) -> dict[str, EvidenceFile]:
    out = {}
    for _ in range(count):
        evidence = sent.get(timeout=WAIT_S)
        out[evidence.name] = evidence
    return out


def test_a_named_rank_sends_its_dump_and_a_trace_of_exactly_the_steps_asked() -> None:
    sent: queue.Queue[EvidenceFile] = queue.Queue()
    capture = EvidenceCapture(rank=1, send=sent.put)
    capture.request(_command(profile_ranks=[1, 0], profile_steps=2))
    x = torch.randn(64, 64)
    for step in range(4):
        capture.step_started()
        torch.mm(x, x) if step < 2 else torch.add(x, x)
        capture.step_ended()
    files = _files(sent, 2)
    dump = json.loads(gzip.decompress(files[FLIGHT_RECORDER_FILE].data_gzip))
    assert "entries" in dump or "version" in dump
    trace_file = files[PROFILER_TRACE_FILE]
    raw = gzip.decompress(trace_file.data_gzip)
    assert len(raw) == trace_file.size_bytes
    names = {e.get("name") for e in json.loads(raw)["traceEvents"]}
    # the two profiled steps multiplied; the steps after them, unprofiled, added
    assert "aten::mm" in names and "aten::add" not in names


def test_an_unnamed_rank_sends_its_dump_only_and_a_repeat_is_ignored() -> None:
    sent: queue.Queue[EvidenceFile] = queue.Queue()
    capture = EvidenceCapture(rank=2, send=sent.put)
    capture.request(_command(profile_ranks=[1, 0]))
    capture.request(_command(profile_ranks=[1, 0]))
    assert list(_files(sent, 1)) == [FLIGHT_RECORDER_FILE]
    capture.step_started()
    capture.step_ended()
    with pytest.raises(queue.Empty):
        sent.get(timeout=0.5)


def test_a_rank_that_starts_no_step_reports_its_trace_missing() -> None:
    sent: queue.Queue[EvidenceFile] = queue.Queue()
    capture = EvidenceCapture(rank=0, send=sent.put, profile_start_deadline_s=0.2)
    capture.request(_command(profile_ranks=[0]))
    files = _files(sent, 2)
    missing = files[PROFILER_TRACE_FILE]
    assert missing.data_gzip == b"" and "no step started within 0.2 s" in missing.error
    # a step after the deadline starts nothing
    capture.step_started()
    capture.step_ended()
    with pytest.raises(queue.Empty):
        sent.get(timeout=0.5)


def test_a_file_over_the_cap_becomes_an_error() -> None:
    noise = torch.randint(0, 256, (EVIDENCE_FILE_MAX_BYTES + 1024,), dtype=torch.uint8)
    evidence = pack("c0ffee", PROFILER_TRACE_FILE, noise.numpy().tobytes())
    assert evidence.data_gzip == b"" and "cap" in evidence.error
    small = pack("c0ffee", PROFILER_TRACE_FILE, b"{}")
    assert gzip.decompress(small.data_gzip) == b"{}" and small.error == ""


@pytest.mark.parametrize(
    "args",
    [{"profile_ranks": "0"}, {"profile_steps": 0}, {"profile_steps": 99}, {"ranks": [0]}],
)
def test_bad_arguments_are_refused_by_probe_and_book(args: dict[str, object]) -> None:
    with pytest.raises(EvidenceArgsError):
        parse_request(_command(**args), 0)
    with pytest.raises(CommandError):
        CommandBook().new("j", "evidence", args)


def test_the_book_hands_an_evidence_command_once_to_each_agent_while_young() -> None:
    now = [100.0]
    book = CommandBook(timeout_s=60.0, clock=lambda: now[0])
    command = book.new("j", "evidence", {"profile_ranks": [1]})
    book.add(command)
    assert book.reserve(["j"]) == []  # not a rank-0 command
    assert book.fan_out("agent-1", ["j"]) == [command]
    assert book.fan_out("agent-1", ["j"]) == []
    assert book.fan_out("agent-2", ["other", "j"]) == [command]
    book.unfan("agent-2", [command.id])  # its reply failed: offered again
    assert book.fan_out("agent-2", ["j"]) == [command]
    now[0] += 61.0
    assert book.fan_out("agent-3", ["j"]) == []


# -- the aggregator's keeping and retention -------------------------------------------


class _Sink:
    """Takes evidence commands as the command dispatch would, and keeps them."""

    def __init__(self) -> None:
        self.book = CommandBook()

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object], *, command_id: str | None = None
    ) -> CommandStatus:
        return self.book.add(self.book.new(job, kind, args, command_id=command_id))


async def test_retention_deletes_old_captures_then_the_oldest_over_the_size_cap(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    with ThreadPoolExecutor(1) as writer:
        store = HistoryStore(f"sqlite:///{tmp_path / 'h.db'}", aggregator_id="a", writer=writer)
        store.open()
        Base.metadata.create_all(store.engine)
        payload = os.urandom(2048)  # incompressible: ~2 KB stored per file
        keeper = EvidenceKeeper(
            EvidenceSettings(dir=str(tmp_path / "evidence"), max_bytes=3000, retention_s=1500.0),
            store=store,
            commands=_Sink(),
            world_size=lambda _job: 2,
            clock=lambda: now[0],
        )
        ids = []
        h = wf.hello("j", 1, 2)
        for seq, at in enumerate((1000.0, 2000.0, 3000.0), start=1):
            now[0] = at
            capture_id = await keeper.capture("j")
            ids.append(capture_id)
            batch = msgspec.structs.replace(
                wf.batch(h, seq), evidence=[pack(capture_id, FLIGHT_RECORDER_FILE, payload)]
            )
            body = wf.ingest_body("agent", [(seq, wf.record(h, batch))])
            assert await keeper.receive(decode_json(body, IngestBatch)) == 1
            assert await keeper.receive(decode_json(body, IngestBatch)) == 0  # a resend
        folders = {i: tmp_path / "evidence" / i for i in ids}
        assert all((f / "rank1-flight_recorder.json.gz").is_file() for f in folders.values())
        now[0] = 3100.0
        # The first is past retention; of the two left only the newest fits 3000 bytes.
        assert await keeper.prune(now[0]) == 2
        assert [c["id"] for c in await store.evidence(job="j")] == [ids[2]]
        assert [f.exists() for f in folders.values()] == [False, False, True]
        store.close()


def test_an_alert_profiles_its_rank_and_a_healthy_peer() -> None:
    keeper = EvidenceKeeper(
        EvidenceSettings(dir="unused"),
        store=None,  # type: ignore[arg-type]
        commands=_Sink(),
        world_size=lambda job: {"two": 2, "one": 1}.get(job),
        clock=lambda: 0.0,
    )
    assert keeper.profile_ranks("two", "1") == [1, 0]
    assert keeper.profile_ranks("two", "0") == [0, 1]
    assert keeper.profile_ranks("one", "0") == [0]
    assert keeper.profile_ranks("unknown", None) == [0]


class _Recorders:
    """A torch C extension's two JSON dumps; NCCL's holds ``nccl`` entries."""

    def __init__(self, nccl: int) -> None:
        self.nccl = nccl

    def _dump_nccl_trace_json(self, **_kwargs: object) -> bytes:
        return json.dumps({"entries": [{"profiling_name": "nccl:all_reduce"}] * self.nccl}).encode()

    def _dump_fr_trace_json(self, **_kwargs: object) -> bytes:
        return json.dumps({"entries": [{"profiling_name": "gloo:all_reduce"}]}).encode()


@pytest.mark.parametrize(("nccl", "expected"), [(2, "nccl:all_reduce"), (0, "gloo:all_reduce")])
def test_the_dump_is_nccls_where_its_recorder_holds_entries(
    monkeypatch: pytest.MonkeyPatch, nccl: int, expected: str
) -> None:
    """A GPU job's hang is in NCCL's recorder; the generic one holds only gloo's."""
    monkeypatch.setattr(torch._C, "_distributed_c10d", _Recorders(nccl))
    entries = json.loads(dump_flight_recorder())["entries"]
    assert {e["profiling_name"] for e in entries} == {expected}
