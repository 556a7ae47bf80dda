"""What a report costs, stage by stage, on a job as large as a report reads.

A synthetic SQLite history of ``--ranks`` ranks x ``--steps`` steps (default 8 x 25 000:
200 000 step rows, the most a report reads), with node and process samples, is made
once; then each round times, on one thread:

- ``load``: the report's SELECTs (``load_job_history``);
- ``build``: the statistics, series and findings (``build_report``);
- ``text``: the terminal summary (``render_text``);
- ``page``: the plots (matplotlib SVG) and the page (``render_page``).

Prints per stage the median and spread (min..max) of wall seconds over the rounds and
its share of the total, and the page's size; the last line of stdout is one JSON
object with the same figures. The aggregator runs all four off its event loop.

Usage::

    python benchmarks/report.py                 # 5 rounds
    python benchmarks/report.py --ranks 2 --steps 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import format_table
from sqlalchemy import insert

from torshmon.history.db import make_engine
from torshmon.history.models import Base
from torshmon.history.store.report import load_job_history
from torshmon.report.build import build_report
from torshmon.report.page import render_page
from torshmon.report.text import render_text

T0 = 1_700_000_000.0
STAGES = ("load", "build", "text", "page")


def make_history(path: Path, ranks: int, steps: int) -> str:
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    t = Base.metadata.tables
    last = int((T0 + steps * 0.1) * 1e9)
    with engine.begin() as conn:
        conn.execute(
            insert(t["jobs"]),
            [{"job": "big", "world_size": ranks, "backend": "gloo",
              "first_seen_unix_ns": int(T0 * 1e9), "last_seen_unix_ns": last}],
        )  # fmt: skip
        conn.execute(
            insert(t["probe_sessions"]),
            [{"session": f"s{r}", "job": "big", "rank": r, "node": f"n{r // 8}",
              "started_unix_ns": int(T0 * 1e9), "last_seen_unix_ns": last, "last_seq": 0,
              "dropped_records_total": 0} for r in range(ranks)],
        )  # fmt: skip
        for rank in range(ranks):
            rows: list[dict[str, Any]] = []
            for i in range(1, steps + 1):
                duration = 0.1 + 0.01 * ((i * 7 + rank) % 13) / 13
                rows.append(
                    {"job": "big", "rank": rank, "node": f"n{rank // 8}", "step": i,
                     "end_unix_ns": int((T0 + i * 0.1) * 1e9), "duration_s": duration,
                     "comm_wait_s": 0.03, "compute_s": duration - 0.03,
                     "communication_time_ratio": 0.03 / duration, "forward_s": 0.02,
                     "backward_s": 0.05, "optimizer_s": 0.01, "samples_per_s": 640.0,
                     "loss_nonfinite": False, "config_version": 0}
                )  # fmt: skip
            conn.execute(insert(t["steps"]), rows)
            conn.execute(
                insert(t["rank_samples"]),
                [{"node": f"n{rank // 8}", "ts_unix_ns": int((T0 + s) * 1e9), "job": "big",
                  "rank": rank, "pid": rank, "rss_bytes": 2**30}
                 for s in range(0, int(steps * 0.1), 2)],
            )  # fmt: skip
    engine.dispose()
    return url


def one_round(url: str) -> tuple[dict[str, float], int]:
    times: dict[str, float] = {}
    engine = make_engine(url, read_only=True)
    start = time.perf_counter()
    with engine.connect() as conn:
        history = load_job_history(conn, "big")
    assert history is not None
    times["load"] = time.perf_counter() - start
    start = time.perf_counter()
    report = build_report(history, T0 + 1e6)
    times["build"] = time.perf_counter() - start
    start = time.perf_counter()
    render_text(report)
    times["text"] = time.perf_counter() - start
    start = time.perf_counter()
    page = render_page(report)
    times["page"] = time.perf_counter() - start
    engine.dispose()
    return times, len(page.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=25_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = make_history(Path(tmp) / "h.db", args.ranks, args.steps)
        rounds = [one_round(url) for _ in range(args.rounds)]
    per_stage = {s: [r[0][s] for r in rounds] for s in STAGES}
    total = sum(statistics.median(v) for v in per_stage.values())
    rows = [(s, statistics.median(v), min(v), max(v)) for s, v in per_stage.items()]
    print(f"{args.ranks} ranks x {args.steps} steps, {args.rounds} rounds; wall seconds")
    print(
        format_table(
            [
                ("stage", lambda r: r[0]),
                ("median s", lambda r: f"{r[1]:.3f}"),
                ("min..max", lambda r: f"{r[2]:.3f}..{r[3]:.3f}"),
                ("share", lambda r: f"{r[1] / total:.0%}"),
            ],
            rows,
        )
    )
    page_bytes = rounds[-1][1]
    print(f"page: {page_bytes / 1024:.0f} KiB")
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "steps": args.steps,
                "median_s": {s: statistics.median(v) for s, v in per_stage.items()},
                "page_bytes": page_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
