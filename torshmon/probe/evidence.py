"""Evidence on alert: a Flight Recorder dump and a short torch.profiler trace.

An ``evidence`` command reaches every rank (the agent relays it to all of a job's
probes, since a hung job has no step at which ranks could agree). Each rank dumps
torch.distributed's Flight Recorder (the ring buffer of its recent collectives) at
once, on a thread of its own: a hung rank's training thread is stuck inside the
collective the dump should show. The ranks the command names also record the next
few steps under torch.profiler, started and stopped at step boundaries on the
training thread (the profiler follows the thread that starts it) and exported on
the evidence thread. Bounded: at most ``MAX_PROFILE_STEPS`` steps, a deadline for
the first of them, files gzip-compressed and capped at ``EVIDENCE_FILE_MAX_BYTES``.
A failure becomes an ``EvidenceFile`` with an ``error``, never an exception in
training.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from torshmon.wire import EVIDENCE_FILE_MAX_BYTES, Command, EvidenceFile

log = logging.getLogger(__name__)

FLIGHT_RECORDER_FILE: Final = "flight_recorder.json"
PROFILER_TRACE_FILE: Final = "profiler_trace.json"
DEFAULT_PROFILE_STEPS: Final = 3
MAX_PROFILE_STEPS: Final = 20
#: How long a rank named for the profiler may take to start its next step; a rank
#: stuck in a collective never does, and its trace is reported missing.
PROFILE_START_DEADLINE_S: Final = 30.0
ARGS: Final = frozenset({"profile_ranks", "profile_steps"})


class EvidenceArgsError(ValueError):
    """An evidence command's arguments are not usable; the text names the field."""


@dataclass(frozen=True, slots=True)
class EvidenceRequest:
    """What one ``evidence`` command asks of this rank."""

    id: str
    profile: bool
    profile_steps: int


def parse_request(command: Command, rank: int) -> EvidenceRequest:
    """The request ``command`` makes of ``rank``; EvidenceArgsError for bad arguments."""
    unknown = sorted(set(command.args) - ARGS)
    if unknown:
        raise EvidenceArgsError(
            f"unknown evidence field {unknown[0]!r}; allowed: {', '.join(sorted(ARGS))}"
        )
    ranks = command.args.get("profile_ranks", [])
    if not isinstance(ranks, list) or not all(_is_int(r) for r in ranks):
        raise EvidenceArgsError(f"profile_ranks must be a list of ranks, got {ranks!r}")
    steps = command.args.get("profile_steps", DEFAULT_PROFILE_STEPS)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise EvidenceArgsError(
            f"profile_steps must be an integer from 1 to {MAX_PROFILE_STEPS}, got {steps!r}"
        )
    return EvidenceRequest(id=command.id, profile=rank in ranks, profile_steps=steps)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dump_flight_recorder() -> bytes:
    """This process's Flight Recorder entries as JSON, in torch's own format: NCCL's
    recorder where it holds entries (a CUDA build's NCCL groups write there, not to the
    generic recorder), else the generic one (gloo and the other backends);
    RuntimeError when this torch has no JSON dump."""
    c10d: Any = torch._C._distributed_c10d
    found = None
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        found = bytes(dump(includeCollectives=True, onlyActive=False))
        if json.loads(found).get("entries"):
            return found
    if found is None:
        raise RuntimeError(f"torch {torch.__version__} has no Flight Recorder JSON dump")
    return found


def pack(capture_id: str, name: str, data: bytes) -> EvidenceFile:
    """``data`` as an evidence file, or an error file when compressed it is over the cap."""
    packed = gzip.compress(data, compresslevel=6)
    now_ns = time.time_ns()
    if len(packed) > EVIDENCE_FILE_MAX_BYTES:
        return EvidenceFile(
            id=capture_id,
            name=name,
            error=(
                f"{len(data)} bytes ({len(packed)} compressed) is over the "
                f"{EVIDENCE_FILE_MAX_BYTES} byte cap"
            ),
            created_unix_ns=now_ns,
        )
    return EvidenceFile(
        id=capture_id, name=name, size_bytes=len(data), data_gzip=packed, created_unix_ns=now_ns
    )


def failed(capture_id: str, name: str, reason: str) -> EvidenceFile:
    """An evidence file that could not be taken, and why."""
    return EvidenceFile(
        id=capture_id, name=name, error=reason[:4000], created_unix_ns=time.time_ns()
    )


@dataclass(slots=True)
class _Profiling:
    request: EvidenceRequest
    profiler: Any = None
    steps_left: int = 0


class EvidenceCapture:
    """Takes the evidence commands of one rank and hands the files to ``send``.

    ``request`` runs on the shipper thread; ``step_started`` and ``step_ended`` on the
    training thread, where they cost one attribute read unless a trace is wanted.
    ``send`` is called from the evidence threads (an ``Outbox.put``).
    """

    def __init__(
        self,
        rank: int,
        send: Callable[[EvidenceFile], None],
        *,
        profile_start_deadline_s: float = PROFILE_START_DEADLINE_S,
    ) -> None:
        self.rank = rank
        self._send = send
        self._deadline_s = profile_start_deadline_s
        self._lock = threading.Lock()
        self._profiling: _Profiling | None = None
        self._seen: set[str] = set()

    def request(self, command: Command) -> EvidenceRequest:
        """Start capture ``command``: the dump now (its own thread), the trace from the
        next step if this rank is named. EvidenceArgsError for bad arguments; a
        capture id seen before is ignored (the agent may hand it twice)."""
        request = parse_request(command, self.rank)
        if request.id in self._seen:
            return request
        self._seen.add(request.id)
        self._spawn(self._dump, request.id)
        if request.profile:
            with self._lock:
                busy = self._profiling is not None
                if not busy:
                    self._profiling = _Profiling(request)
            if busy:
                self._send(failed(request.id, PROFILER_TRACE_FILE, "another trace is running"))
            else:
                self._spawn(self._start_deadline, request.id)
        return request

    def step_started(self) -> None:
        """Training thread, at the start of a step: start a wanted trace."""
        if self._profiling is None:
            return
        with self._lock:
            profiling = self._profiling
            if profiling is None or profiling.profiler is not None:
                return
            try:
                profiler = torch.profiler.profile(activities=_activities())
                profiler.start()
            except Exception as exc:
                self._profiling = None
                self._send(failed(profiling.request.id, PROFILER_TRACE_FILE, f"profiler: {exc}"))
                return
            profiling.profiler = profiler
            profiling.steps_left = profiling.request.profile_steps

    def step_ended(self) -> None:
        """Training thread, at the end of a step: stop a trace after its last step."""
        profiling = self._profiling
        if profiling is None or profiling.profiler is None:
            return
        profiling.steps_left -= 1
        if profiling.steps_left > 0:
            return
        with self._lock:
            self._profiling = None
        try:
            profiling.profiler.stop()
        except Exception as exc:
            self._send(failed(profiling.request.id, PROFILER_TRACE_FILE, f"profiler: {exc}"))
            return
        self._spawn(self._export, profiling.request.id, profiling.profiler)

    def close(self) -> None:
        """Stop a trace still running (the job ended within it) and report it missing."""
        with self._lock:
            profiling, self._profiling = self._profiling, None
        if profiling is None:
            return
        if profiling.profiler is not None:
            try:
                profiling.profiler.stop()
            except Exception:
                log.debug("torshmon: stopping the profiler at close failed", exc_info=True)
        reason = "the job ended before the trace's last step"
        self._send(failed(profiling.request.id, PROFILER_TRACE_FILE, reason))

    # -- the evidence threads ----------------------------------------------------------
    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        threading.Thread(target=target, args=args, name="torshmon-evidence", daemon=True).start()

    def _start_deadline(self, capture_id: str) -> None:
        """A rank stuck in a collective never starts a step: give up on its trace."""
        time.sleep(self._deadline_s)  # a timer, not synchronisation
        with self._lock:
            profiling = self._profiling
            if profiling is None or profiling.request.id != capture_id:
                return
            if profiling.profiler is not None:
                return
            self._profiling = None
        reason = f"no step started within {self._deadline_s:g} s (is the rank stuck?)"
        self._send(failed(capture_id, PROFILER_TRACE_FILE, reason))

    def _dump(self, capture_id: str) -> None:
        try:
            evidence = pack(capture_id, FLIGHT_RECORDER_FILE, dump_flight_recorder())
        except Exception as exc:
            evidence = failed(capture_id, FLIGHT_RECORDER_FILE, f"Flight Recorder: {exc}")
        self._send(evidence)

    def _export(self, capture_id: str, profiler: Any) -> None:
        fd, path = tempfile.mkstemp(prefix="torshmon-trace-", suffix=".json")
        os.close(fd)
        try:
            profiler.export_chrome_trace(path)
            with open(path, "rb") as file:
                evidence = pack(capture_id, PROFILER_TRACE_FILE, file.read())
        except Exception as exc:
            evidence = failed(capture_id, PROFILER_TRACE_FILE, f"profiler export: {exc}")
        finally:
            os.unlink(path)
        self._send(evidence)


def _activities() -> list[Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities
