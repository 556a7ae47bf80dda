"""Evidence benchmark: what an evidence capture costs the job while it runs.

Runs ``torshmon demo``'s whole system (aggregator, agent, a real multi-process gloo DDP
job) and, once the job has run ``--at`` steps, asks for an evidence capture as the
``capture_evidence`` action does (every rank dumps its Flight Recorder on a thread of
its own; ranks 1 and 0 record ``profile_steps`` steps under torch.profiler). From the
history it then compares the step times of each rank:

- **before**: steps that ended in the ``--window-s`` seconds before the capture;
- **during**: steps that ended from the capture's request until the last file was
  taken (the dump, the profiled steps and the trace export on the profiled ranks).

The same run is repeated with the Flight Recorder off (``TORCH_FR_BUFFER_SIZE=0``;
torch 2.13 records gloo and NCCL collectives by default) to show what the buffer
itself costs. Prints a table, then one JSON object (the last line).

Usage::

    python benchmarks/evidence.py --steps 300 --at 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select

from torshmon.aggregator.service import Aggregator
from torshmon.demo import DemoConfig, run_system
from torshmon.history.models import Base
from torshmon.history.store import evidence_of

_T = Base.metadata.tables


def _run(args: argparse.Namespace, db: Path, env: dict[str, str], capture: bool) -> Any:
    asked: dict[str, Any] = {}

    def on_tick(aggregator: Aggregator, _shaper: object) -> None:
        summary = aggregator.live.job_summary("demo")
        if not capture or asked or summary is None or summary["last_step"] < args.at:
            return
        asked["task"] = asyncio.ensure_future(
            aggregator.evidence.capture("demo", profile_ranks=[1, 0])
        )
        asked["unix_s"] = time.time()

    config = DemoConfig(
        world_size=args.world_size,
        steps=args.steps,
        db=db,
        env=env,
        linger_s=3.0,
        quiet=True,
    )
    asyncio.run(run_system(config, on_tick=on_tick, tick_s=0.1))
    return asked


def _steps(db: Path) -> list[dict[str, Any]]:
    engine = create_engine(f"sqlite:///{db}")
    steps = _T["steps"]
    with engine.connect() as conn:
        rows = conn.execute(select(steps.c.rank, steps.c.end_unix_ns, steps.c.duration_s))
        out = [dict(r._mapping) for r in rows]
    engine.dispose()
    return out


def _median_ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 2) if values else None


def _capture_table(args: argparse.Namespace, db: Path) -> dict[str, Any]:
    """Step times before and during the capture, per rank, printed and returned."""
    [capture] = evidence_of(f"sqlite:///{db}", job="demo")
    taken = [f["taken_unix_s"] for f in capture["files"]]
    start, end = capture["created_unix_s"], max(taken)
    steps = _steps(db)
    result: dict[str, Any] = {
        "capture_s": round(end - start, 2),
        "files": {
            f"rank{f['rank']}/{f['name']}": f["size_bytes"] or f["error"] for f in capture["files"]
        },
        "ranks": {},
    }
    print(f"capture took {end - start:.2f} s from request to the last file taken")
    print(f"{'rank':>4} {'before ms':>10} {'during ms':>10} {'ratio':>6} {'n during':>8}")
    for rank in range(args.world_size):
        mine = [s for s in steps if s["rank"] == rank]
        before = [
            s["duration_s"] for s in mine if start - args.window_s <= s["end_unix_ns"] / 1e9 < start
        ]
        during = [s["duration_s"] for s in mine if start <= s["end_unix_ns"] / 1e9 <= end]
        b, d = _median_ms(before), _median_ms(during)
        ratio = round(d / b, 3) if b and d else None
        result["ranks"][rank] = {"before_ms": b, "during_ms": d, "ratio": ratio, "n": len(during)}
        print(f"{rank:>4} {b!s:>10} {d!s:>10} {ratio!s:>6} {len(during):>8}")
    result["fr_on_ms"] = _median_ms(
        [s["duration_s"] for s in steps if s["end_unix_ns"] / 1e9 < start]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=int, default=120, help="step at which to capture")
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument(
        "--no-fr-off", action="store_true", help="skip the run with the Flight Recorder off"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torshmon-evidence-bench-") as tmp:
        db = Path(tmp) / "on.db"
        asked = _run(args, db, {}, capture=True)
        if "unix_s" not in asked:
            raise SystemExit("the job ended before the capture step: raise --steps")
        result = _capture_table(args, db)
        if not args.no_fr_off:
            off_db = Path(tmp) / "off.db"
            _run(args, off_db, {"TORCH_FR_BUFFER_SIZE": "0"}, capture=False)
            result["fr_off_ms"] = _median_ms([s["duration_s"] for s in _steps(off_db)])
            print(
                f"median step before the capture, Flight Recorder on: {result['fr_on_ms']} ms; "
                f"in a run with it off: {result['fr_off_ms']} ms"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
