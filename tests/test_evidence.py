"""Evidence capture: the probe's side (dump, bounded trace, caps) and the command book's
fan-out of evidence commands to every agent of a job."""

from __future__ import annotations

import gzip
import json
import queue

import pytest
import torch

from torshmon.aggregator.core.commands import CommandBook, CommandError
from torshmon.probe.evidence import (
    FLIGHT_RECORDER_FILE,
    PROFILER_TRACE_FILE,
    EvidenceArgsError,
    EvidenceCapture,
    pack,
    parse_request,
)
from torshmon.wire import EVIDENCE_FILE_MAX_BYTES, Command, EvidenceFile

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
