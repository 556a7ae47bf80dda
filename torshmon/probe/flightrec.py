"""The collectives torch's Flight Recorder keeps in its ring buffer, read back as records.

The Flight Recorder (``TORCH_FR_BUFFER_SIZE``, or ``TORCH_NCCL_TRACE_BUFFER_SIZE``, set
to a number of entries before the process group starts) records every collective a
process group runs, in C++, DDP's bucket all-reduces included: no Python runs on the
training thread for it. ``read`` dumps the buffer (``_dump_fr_trace_json``, a fraction
of a millisecond for a few hundred entries: meant for the shipper's thread, never the
training thread's) and returns the entries after a given record id.

What it holds on gloo (torch 2.13, measured): op (``gloo:all_reduce``), process group,
dtypes and sizes (so bytes), the wall-clock time each was enqueued, and whether it has
retired; no start or end time (``time_discovered_*`` stay 0, no ``duration_ms``), so
no duration or bus bandwidth per bucket. NCCL fills ``duration_ms`` where
``TORCH_NCCL_ENABLE_TIMING=1``.

Cost (measured on this project's 2-core test box, one gloo rank, 16-float all-reduces):
recording adds about 0.4-0.6 us of the calling thread's CPU per collective (7.0 -> 7.4-8.0
us); a dump is 0.25 ms for 14 entries but 23 ms for a full 2000-entry buffer (whether
it holds the GIL throughout, stalling the training thread, is not measured yet): size
the buffer to what one read needs, and read often.

Not yet wired into the shipper: see docs/zero-code.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: the variables that size the ring buffer (entries); either one > 0 turns it on
BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")

_DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "Long": 8,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
}


@dataclass(frozen=True, slots=True)
class FrCollective:
    """One collective as the Flight Recorder kept it."""

    record_id: int
    pg_name: str
    op: str  # "all_reduce", without the backend's prefix
    backend: str  # "gloo", "nccl"
    bytes: int | None  # the input tensors' bytes; None for a dtype not known here
    created_ns: int  # wall clock (time.time_ns) when it was enqueued
    retired: bool
    duration_s: float | None  # NCCL with timing on only


def enabled(env: Mapping[str, str]) -> bool:
    """Whether the environment turns the Flight Recorder on."""
    for name in BUFFER_ENVS:
        try:
            if int(env.get(name, "0")) > 0:
                return True
        except ValueError:
            continue
    return False


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
        out.append(
            FrCollective(
                record_id=record_id,
                pg_name=str(group[1] if len(group) > 1 else group[0]),
                op=op or backend,
                backend=backend if op else "",
                bytes=_bytes(entry.get("input_sizes") or (), entry.get("input_dtypes") or ()),
                created_ns=int(entry.get("time_created_ns", 0)),
                retired=bool(entry.get("retired")),
                duration_s=float(duration) / 1000 if duration is not None else None,
            )
        )
    out.sort(key=lambda c: c.record_id)
    return out


def read(after_record_id: int = -1) -> list[FrCollective]:
    """Dump this process's ring buffer and parse it (``parse``); [] where this torch
    has no Flight Recorder."""
    try:
        from torch._C import _distributed_c10d
    except ImportError:
        return []
    dump = getattr(_distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return []
    return parse(json.loads(dump(True, True)), after_record_id)


def _bytes(sizes: Any, dtypes: Any) -> int | None:
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        width = _DTYPE_BYTES.get(str(dtype))
        if width is None:
            return None
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * width
    return total


__all__ = ["BUFFER_ENVS", "FrCollective", "enabled", "parse", "read"]
