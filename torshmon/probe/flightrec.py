"""The collectives torch's Flight Recorder keeps in its ring buffer, read back as records.

The Flight Recorder records every collective a process group runs, in C++, DDP's bucket
all-reduces included: no Python runs on the training thread for it. torch 2.13 keeps it
on by default (2 000 entries); ``TORCH_FR_BUFFER_SIZE`` (or
``TORCH_NCCL_TRACE_BUFFER_SIZE``) sets its size, read once, when the first process group
starts: set later, it changes nothing. ``read`` dumps the buffer
(``_dump_fr_trace``) and returns the entries after a given record id.

What it holds on gloo (torch 2.13, measured): op (``gloo:all_reduce``), process group,
dtypes and sizes (so bytes), the wall-clock time each was enqueued, and whether it has
retired; no start or end time (``time_discovered_*`` stay 0, no ``duration_ms``; gloo's
``_enable_collectives_timing`` changes nothing, its Work has no duration and takes no
completion hook), so no duration or bus bandwidth per bucket. NCCL fills
``duration_ms`` where ``TORCH_NCCL_ENABLE_TIMING=1``.

Cost (measured on this project's 2-core test box, one gloo rank, 16-float all-reduces):
recording adds about 0.4-0.6 us of the calling thread's CPU per collective (paid by
every job on torch 2.13, where it is on by default). A dump holds the GIL throughout
(a Python loop on another thread stalls for as long) and costs more per entry the more
the buffer holds: 0.3 ms at 50 entries, 1.2 at 200, 6 at 400, 23 at 800, 107 at 1 600
(the pickle form ``read`` uses; JSON about twice that). So the reader
(``probe.ddpcomm``) reads only a small buffer.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the variables that size the ring buffer (entries); either one > 0 turns it on
BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

#: the Flight Recorder's dtype names: (torch's name, as the probe labels it; bytes)
_DTYPES = {
    "Float": ("float32", 4),
    "Double": ("float64", 8),
    "Half": ("float16", 2),
    "BFloat16": ("bfloat16", 2),
    "Int": ("int32", 4),
    "Long": ("int64", 8),
    "Short": ("int16", 2),
    "Char": ("int8", 1),
    "Byte": ("uint8", 1),
    "Bool": ("bool", 1),
}


@dataclass(frozen=True, slots=True)
class FrCollective:
    """One collective as the Flight Recorder kept it."""

    record_id: int
    pg_name: str
    op: str  # "all_reduce", without the backend's prefix
    backend: str  # "gloo", "nccl"
    bytes: int | None  # the input tensors' bytes; None for a dtype not known here
    dtype: str  # the first input's, as torch names it ("float32"); "none" without one
    created_ns: int  # wall clock (time.time_ns) when it was enqueued
    retired: bool
    duration_s: float | None  # NCCL with timing on only


def enabled(env: Mapping[str, str]) -> bool:
    """Whether the environment turns the Flight Recorder on."""
    return (buffer_size(env) or 0) > 0


def buffer_size(env: Mapping[str, str]) -> int | None:
    """The ring buffer's entries as the environment sets them (the first of
    ``BUFFER_ENVS`` that holds a number, as torch reads them); None where none does
    (torch's default: 2 000 on torch 2.13, none before)."""
    for name in BUFFER_ENVS:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def parse(dump: Mapping[str, Any], after_record_id: int = -1) -> list[FrCollective]:
    """The dump's collective entries with a record id above ``after_record_id``, in
    record order (point-to-point entries left out)."""
    out: list[FrCollective] = []
    for entry in dump.get("entries") or ():
        record_id = int(entry.get("record_id", -1))
        if record_id <= after_record_id or entry.get("is_p2p"):
            continue
        backend, _, op = str(entry.get("profiling_name", "")).partition(":")
        group = entry.get("process_group") or ("", "")
        duration = entry.get("duration_ms")
        dtypes = entry.get("input_dtypes") or ()
        out.append(
            FrCollective(
                record_id=record_id,
                pg_name=str(group[0]),  # (name, description): the name, as group_name
                op=op or backend,
                backend=backend if op else "",
                bytes=_bytes(entry.get("input_sizes") or (), dtypes),
                dtype=_DTYPES.get(str(dtypes[0]), (str(dtypes[0]).lower(), 0))[0]
                if dtypes
                else "none",
                created_ns=int(entry.get("time_created_ns", 0)),
                retired=bool(entry.get("retired")),
                duration_s=float(duration) / 1000 if duration is not None else None,
            )
        )
    out.sort(key=lambda c: c.record_id)
    return out


def dumpers(backend: str) -> tuple[str, str]:
    """The names of the pickle and JSON dumps of the recorder ``backend``'s groups
    write to. torch keeps two: NCCL's own (``ProcessGroupNCCL``'s recorder, in CUDA
    builds only) and the generic one gloo and the other backends write to; a dump of
    the generic one holds no NCCL entry."""
    if backend == "nccl":
        return "_dump_nccl_trace", "_dump_nccl_trace_json"
    return "_dump_fr_trace", "_dump_fr_trace_json"


def read(after_record_id: int = -1, backend: str = "gloo") -> list[FrCollective]:
    """Dump the ring buffer ``backend``'s groups record into (``dumpers``) and parse it
    (``parse``); [] where this torch has no such recorder. Holds the GIL for the dump
    (see above)."""
    try:
        from torch._C import _distributed_c10d
    except ImportError:
        return []
    pickled, as_json = dumpers(backend)
    # onlyActive=False: NCCL's completed entries are the timed ones. The pickle form, no
    # stack traces: half the JSON dump's time (1.2 against 2.5 ms at 200 entries).
    dump = getattr(_distributed_c10d, pickled, None)
    if dump is not None:
        return parse(pickle.loads(dump(True, False, False)), after_record_id)
    dump_json = getattr(_distributed_c10d, as_json, None)
    if dump_json is None:
        return []
    return parse(json.loads(dump_json(True, False)), after_record_id)


def _bytes(sizes: Any, dtypes: Any) -> int | None:
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        known = _DTYPES.get(str(dtype))
        if known is None:
            return None
        width = known[1]
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * width
    return total


__all__ = ["BUFFER_ENVS", "FrCollective", "buffer_size", "enabled", "parse", "read"]
