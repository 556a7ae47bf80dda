"""Evidence on alert, for real: a demo job (3 gloo ranks, agent, aggregator) with an
injected hang or straggler; the alert's capture_evidence action gets a Flight Recorder
dump from every rank and a profiler trace from the named rank and a healthy peer, and
the aggregator keeps them where its API serves them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from torshmon.demo import DemoConfig, DemoResult, run_system
from torshmon.faults import parse_fault
from torshmon.history.store import evidence_of

pytestmark = pytest.mark.integration


async def _run(tmp_path: Path, steps: int, spec: str) -> DemoResult:
    config = DemoConfig(
        world_size=3,
        steps=steps,
        hidden=256,
        layers=3,
        db=tmp_path / "history.db",
        step_sleep_s=0.1,
        faults=(parse_fault(spec),),
        linger_s=2.0,
        quiet=True,
    )
    return await run_system(config)


def _evidence(result: DemoResult) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The captures and their files, as the report reads them from the history."""
    captures = evidence_of(result.db_url, job="demo")
    return captures, [f for c in captures for f in c["files"]]


def _load(tmp_path: Path, row: dict[str, Any]) -> Any:
    assert row["error"] == "" and row["path"], row
    data = (tmp_path / "history.db.evidence" / row["path"]).read_bytes()
    assert len(data) == row["stored_bytes"]
    text = gzip.decompress(data)
    assert len(text) == row["size_bytes"]
    return json.loads(text)


def _by(files: list[dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    return {f["rank"]: f for f in files if f["name"] == name}


def _check_trace(trace: Any, rank: int) -> None:
    """Chrome trace JSON (what Perfetto and HTA load) with the step's CPU ops in it, and
    the rank it came from (HTA reads ``distributedInfo``)."""
    events = trace["traceEvents"]
    names = {e.get("name", "") for e in events if e.get("ph") == "X"}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    assert trace["distributedInfo"]["rank"] == rank


async def test_a_hang_captures_flight_recorder_dumps_of_every_rank_and_traces(
    tmp_path: Path,
) -> None:
    result = await _run(tmp_path, 110, "hang:rank=1,from=40,seconds=8")
    alert = next(a for a in result.alerts if a["rule"] == "Hung Collective")
    captures, files = _evidence(result)
    assert len(captures) == 1, captures
    capture = captures[0]
    assert capture["rule"] == "Hung Collective" and capture["alert_id"] == alert["id"]
    assert capture["profile_ranks"] == [1, 0]
    dumps = _by(files, "flight_recorder.json")
    assert sorted(dumps) == [0, 1, 2], files
    entries = {rank: _load(tmp_path, row)["entries"] for rank, row in dumps.items()}
    # Taken while rank 1 slept: its peers are in a collective it never entered, and
    # their dumps hold it (a higher sequence number on the same group).
    last = {r: max(e["collective_seq_id"] for e in entries[r] if e["pg_id"] == 0) for r in entries}
    assert last[0] == last[2] == last[1] + 1, last
    hung = [e for e in entries[0] if e["pg_id"] == 0 and e["collective_seq_id"] == last[0]]
    assert hung and "all_reduce" in hung[0]["profiling_name"], hung
    traces = _by(files, "profiler_trace.json")
    assert sorted(traces) == [0, 1], files
    for rank, row in traces.items():
        _check_trace(_load(tmp_path, row), rank)


async def test_a_straggler_captures_evidence_naming_the_slow_rank(tmp_path: Path) -> None:
    # Paged 16-21 slow steps after the onset (test_straggler_onoff.py), captured over the
    # next few (evidence.profile_steps, 3): 70 slow steps leave the capture ~50 to spare.
    result = await _run(tmp_path, 110, "straggler:rank=2,slowdown=4,from=30,to=100")
    alert = next(a for a in result.alerts if a["rule"] == "Straggler" and a["rank"] == 2)
    captures, files = _evidence(result)
    # (On 2 loaded cores another rank may be flagged for a moment too: its own capture.)
    [capture] = [c for c in captures if c["alert_id"] == alert["id"]]
    assert capture["profile_ranks"] == [2, 0]
    files = [f for f in files if f["capture_id"] == capture["id"]]
    dumps = _by(files, "flight_recorder.json")
    assert sorted(dumps) == [0, 1, 2], files
    for row in dumps.values():
        assert _load(tmp_path, row)["entries"]
    traces = _by(files, "profiler_trace.json")
    assert sorted(traces) == [0, 2], files
    for rank, row in traces.items():
        _check_trace(_load(tmp_path, row), rank)
