"""The Flight Recorder reader: which step each DDP collective is filed under, what it
leaves out (before attach, other groups, the wrappers' own calls, hooked steps), when
it reads, and the rows the steps then ship."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from torshmon.probe import ddpcomm, flightrec
from torshmon.probe.ddpcomm import DdpCollectives
from torshmon.probe.events import BucketEvent, CollectiveEvent, RawStep, StepEvents
from torshmon.probe.summary import summarize_step

ROOT = Path(__file__).resolve().parents[1]
OFFSET = 1_000_000_000_000  # wall clock minus perf_counter, in these tests
SINCE = OFFSET + 1_000


def _entry(
    record_id: int, created_ns: int, *, pg: str = "0", size: int = 400
) -> flightrec.FrCollective:
    return flightrec.FrCollective(
        record_id=record_id,
        pg_name=pg,
        op="all_reduce",
        backend="gloo",
        bytes=size,
        dtype="float32",
        created_ns=created_ns,
        retired=True,
        duration_s=None,
    )


def _step(n: int, end_unix_ns: int, events: StepEvents | None = None) -> RawStep:
    end = end_unix_ns - OFFSET
    return RawStep(n, end - 100, end, end_unix_ns, 4, None, events or StepEvents(), None)


class _Clocks:
    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0


def _reader(
    entries: list[flightrec.FrCollective], clocks: _Clocks, *, cost_s: float = 0.001
) -> DdpCollectives:
    def read(after: int) -> list[flightrec.FrCollective]:
        clocks.cpu += cost_s
        return [e for e in entries if e.record_id > after]

    return DdpCollectives(
        pg_name="0",
        pg_label="default",
        group_size=2,
        since_unix_ns=SINCE,
        capacity=8,
        read=read,
        clock=lambda: clocks.now,
        cpu_clock=lambda: clocks.cpu,
        wall_ns=lambda: OFFSET + 5,
        perf_ns=lambda: 5,
    )


def test_each_entry_goes_to_the_step_whose_window_holds_it() -> None:
    t = SINCE
    entries = [
        _entry(0, t - 10),  # before attach: DDP's own start-up broadcast
        _entry(1, t + 100),
        _entry(2, t + 200, size=600),
        _entry(3, t + 300, pg="1"),  # the probe's side group
        _entry(4, t + 1_100),
        _entry(5, t + 2_100),  # after the last step ended: the next step's
    ]
    reader = _reader(entries, _Clocks())
    steps = reader.file([_step(1, t + 1_000), _step(2, t + 2_000)])
    rows = [[(c.op, c.pg, c.size_bytes, c.timed) for c in s.events.collectives] for s in steps]
    assert rows == [
        [("all_reduce", "default", 400, False), ("all_reduce", "default", 600, False)],
        [("all_reduce", "default", 400, False)],
    ]
    # Untimed: enqueued at the recorder's time, on the perf_counter clock.
    assert steps[0].events.collectives[0].start_ns == t + 100 - OFFSET
    # Step 3 takes the entry that waited, once.
    (third,) = reader.file([_step(3, t + 3_000)], final=True)
    assert [c.size_bytes for c in third.events.collectives] == [400]
    assert reader.lost_total == 0 and reader.reads == 2


def test_a_call_the_wrappers_traced_is_not_counted_twice() -> None:
    t, ms = SINCE, 1_000_000  # a millisecond: well past the clocks' slack
    traced = CollectiveEvent("all_reduce", "default", 2, "float32", 4, t + 5 * ms - OFFSET,
                             t + 6 * ms - OFFSET, True)  # fmt: skip
    other_group = CollectiveEvent("all_reduce", "side", 2, "float32", 4, t + ms - OFFSET,
                                  t + 2 * ms - OFFSET, True)  # fmt: skip
    events = StepEvents(collectives=[traced, other_group])
    entries = [_entry(1, t + ms + 10), _entry(2, t + 5 * ms + 10, size=4), _entry(3, t + 8 * ms)]
    (step,) = _reader(entries, _Clocks()).file([_step(1, t + 10 * ms, events)])
    assert [(c.size_bytes, c.blocking) for c in step.events.collectives] == [
        (4, True),
        (4, True),
        (400, False),  # enqueued in the side group's call, not this group's
        (400, False),
    ]


def test_a_step_whose_buckets_the_hook_reduced_takes_none() -> None:
    bucket = BucketEvent(0, 400, 2, 0, 10, "none", 400)
    (step,) = _reader([_entry(1, SINCE + 10)], _Clocks()).file(
        [_step(1, SINCE + 100, StepEvents(buckets=[bucket]))]
    )
    assert step.events.collectives == []


def test_reads_are_spaced_to_the_budget_and_steps_wait_for_one() -> None:
    clocks = _Clocks()
    reader = _reader([_entry(1, SINCE + 10)], clocks, cost_s=0.004)
    assert len(reader.file([_step(1, SINCE + 100)])) == 1
    # A read took 4 ms of CPU: the next may come 4 / READ_BUDGET ms later, past the
    # longest spacing the job's collectives would have asked for.
    wait_s = 0.004 / ddpcomm.READ_BUDGET
    assert wait_s > ddpcomm.MAX_SPACING_S
    clocks.now += wait_s * 0.9
    assert reader.file([_step(2, SINCE + 200)]) == []
    clocks.now += wait_s * 0.2
    assert [s.step for s in reader.file([_step(3, SINCE + 300)])] == [2, 3]
    assert reader.reads == 2 and abs(reader.read_cpu_s - 0.008) < 1e-9


def test_a_busy_job_is_read_before_half_the_buffer_fills() -> None:
    clocks = _Clocks()
    entries = [_entry(1, SINCE + 10)]
    reader = _reader(entries, clocks, cost_s=0.0001)
    reader.file([_step(1, SINCE + 100)])
    clocks.now = ddpcomm.MAX_SPACING_S  # a quiet job: read at the longest spacing
    entries += [_entry(i, SINCE + 100 + i) for i in range(2, 10)]
    assert len(reader.file([_step(2, SINCE + 200)])) == 1
    # 8 entries in 0.5 s: half the buffer (4) fills in 0.25 s.
    clocks.now += 0.24
    assert reader.file([_step(3, SINCE + 300)]) == []
    clocks.now += 0.02
    assert [s.step for s in reader.file([])] == [3]
    assert reader.lost_total == 0


def test_entries_the_buffer_lost_are_counted() -> None:
    entries = [_entry(1, SINCE + 10)]
    clocks = _Clocks()
    reader = _reader(entries, clocks)
    reader.file([_step(1, SINCE + 100)], final=True)
    entries[:] = [_entry(5, SINCE + 110), _entry(6, SINCE + 120)]  # 2, 3, 4 overwritten
    (step,) = reader.file([_step(2, SINCE + 200)], final=True)
    assert reader.lost_total == 3 and len(step.events.collectives) == 2


def test_a_failing_read_lets_the_steps_go_without_rows() -> None:
    def read(after: int) -> list[flightrec.FrCollective]:
        raise RuntimeError("no recorder")

    reader = DdpCollectives(pg_name="0", pg_label="default", group_size=2, since_unix_ns=0,
                            read=read)  # fmt: skip
    assert [s.step for s in reader.file([_step(1, 10)])] == [1]
    assert [s.step for s in reader.file([_step(2, 20)])] == [2]  # no second try


def test_untimed_calls_ship_as_a_row_of_their_own() -> None:
    t, ms = SINCE, 1_000_000
    traced = CollectiveEvent("all_reduce", "default", 2, "float32", 4, t + 5 * ms - OFFSET,
                             t + 6 * ms - OFFSET, True)  # fmt: skip
    entries = [_entry(1, t + ms), _entry(2, t + 2 * ms, size=600), _entry(3, t + 5 * ms, size=4)]
    (step,) = _reader(entries, _Clocks()).file([_step(1, t + 10 * ms, StepEvents([traced]))])
    timed, untimed = summarize_step(step).collectives
    assert (timed.count, timed.size_bytes, timed.duration_s) == (1, 4, 1e-3)
    assert timed.busbw_bytes_per_s is not None and timed.busbw_bytes_per_s > 0
    assert (untimed.count, untimed.size_bytes) == (2, 1000)
    assert untimed.duration_s is untimed.max_duration_s is untimed.busbw_bytes_per_s is None
    assert sum(untimed.duration_hist) == 0


def test_the_reader_needs_a_small_buffer() -> None:
    class Group:
        group_name = "0"

        def size(self) -> int:
            return 2

    class Module:
        process_group = Group()

    module = Module()
    on = ddpcomm.for_module(module, "default", hooked=False, env={"TORCH_FR_BUFFER_SIZE": "256"})
    assert on is not None
    for env in ({}, {"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}):
        assert ddpcomm.for_module(module, "default", hooked=False, env=env) is None, env
    assert (
        ddpcomm.for_module(module, "default", hooked=True, env={"TORCH_FR_BUFFER_SIZE": "256"})
        is None
    )
    assert (
        ddpcomm.for_module(None, "default", hooked=False, env={"TORCH_FR_BUFFER_SIZE": "9"}) is None
    )


def test_the_bootstrap_sizes_the_recorder_as_the_reader_expects() -> None:
    source = (ROOT / "torshmon/probe/_bootstrap/sitecustomize.py").read_text()
    entries = re.search(r'_FR_ENTRIES = "(\d+)"', source)
    names = re.search(r"_FR_ENVS = \(([^)]*)\)", source)
    assert entries is not None and int(entries.group(1)) == ddpcomm.DEFAULT_BUFFER_ENTRIES
    assert names is not None
    assert tuple(n.strip().strip('"') for n in names.group(1).split(",")) == flightrec.BUFFER_ENVS


class _C10d:
    """A torch C extension with both recorders, each holding one all-reduce of its own."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def _entry(self, backend: str) -> dict[str, object]:
        return {
            "record_id": 0,
            "profiling_name": f"{backend}:all_reduce",
            "process_group": ("0", "default_pg"),
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "time_created_ns": 1,
            "retired": True,
        }

    def _dump_fr_trace(self, *_args: object) -> bytes:
        self.read.append("generic")
        return pickle.dumps({"entries": [self._entry("gloo")]})

    def _dump_nccl_trace(self, *_args: object) -> bytes:
        self.read.append("nccl")
        return pickle.dumps({"entries": [self._entry("nccl")]})


def test_an_nccl_group_is_read_from_nccls_own_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build's NCCL groups write to NCCL's recorder; the generic one (gloo's)
    holds none of their entries, so reading it would leave DDP's all-reduces unseen."""
    fake = _C10d()
    monkeypatch.setattr(torch._C, "_distributed_c10d", fake)
    assert [c.backend for c in flightrec.read(-1, "nccl")] == ["nccl"]
    assert [c.backend for c in flightrec.read(-1, "gloo")] == ["gloo"]
    assert fake.read == ["nccl", "generic"]
