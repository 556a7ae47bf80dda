"""What one evaluation tick costs the aggregator's event loop at a large world size.

``Aggregator.evaluate`` (findings, alert rules, link checks, expiry) runs on the event
loop every ``eval_interval_s``; while it runs, no ingest request moves. This script
starts a real aggregator (SQLite file, default rules, writer thread), POSTs
``--rounds`` rounds of every simulated agent's body to its ingest endpoint over HTTP
(the agents and bodies of ``benchmarks/ingest.py``), then alternates: a fifth of the
agents POST once more, one ``evaluate()`` is timed. The evaluation timer and
evaluation on findings are off, so only the timed calls evaluate.

Prints milliseconds per tick for the whole tick and for its parts (timers wrapped
around the functions listed in ``PARTS``; a part's time includes the parts it calls),
then one JSON object (the last line).

Usage::

    python benchmarks/evaluation.py                    # 5 120 ranks, ~1 min
    python benchmarks/evaluation.py --world-size 1024 --ticks 30
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

# benchmarks/ is the script's own folder, first on sys.path; the repository root next.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from ingest import INGEST_PATH, SimulatedAgent, Workload

from torshmon.aggregator.core import alert_engine as alerting
from torshmon.aggregator.core import hang, linkcheck, live, series, straggler
from torshmon.aggregator.service import Aggregator
from torshmon.aggregator.settings import AggregatorSettings

#: (class, method) pairs timed inside a tick.
PARTS: tuple[tuple[type, str], ...] = (
    (live.LiveState, "findings"),
    (straggler.StragglerDetector, "active"),
    (hang.HangDetector, "evaluate"),
    (alerting.AlertEngine, "evaluate"),
    (alerting.AlertEngine, "_rates"),
    (alerting.AlertEngine, "_aggregate"),
    (live.LiveState, "link_checks_due"),
    (linkcheck.LinkChecker, "_roll_baselines"),
    (linkcheck.LinkChecker, "_comm_rose"),
    (live.LiveState, "expire"),
    (series.SeriesStore, "expire"),
)


@contextmanager
def timed_parts(parts: Sequence[tuple[type, str]]) -> Iterator[dict[str, float]]:
    """Seconds spent in each part while the block runs (the methods are put back after)."""
    spent: dict[str, float] = defaultdict(float)
    originals = [(cls, name, getattr(cls, name)) for cls, name in parts]

    def timer(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started

        return wrapper

    for cls, name, fn in originals:
        setattr(cls, name, timer(f"{cls.__name__}.{name}", fn))
    try:
        yield spent
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


async def post(http: aiohttp.ClientSession, url: str, agent: SimulatedAgent) -> None:
    body = agent.next_post(time.time_ns()).body_gz
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with http.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"ingest answered {response.status}: {await response.text()}")


async def measure(world_size: int, rounds: int, ticks: int) -> dict[str, Any]:
    workload = Workload(world_size, 8, 5, 2, 5)
    agents = [SimulatedAgent(i, workload, "eval") for i in range(workload.agents)]
    share = max(1, len(agents) // 5)
    with tempfile.TemporaryDirectory(prefix="torshmon-bench-eval-") as tmp:
        settings = AggregatorSettings(
            port=0,
            db_url=f"sqlite:///{Path(tmp) / 'history.db'}",
            ingest_process=False,
            eval_interval_s=3600.0,
            eval_on_finding=False,
        )
        async with Aggregator(settings) as agg, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{agg.port}{INGEST_PATH}"
            for _ in range(rounds):
                for agent in agents:
                    await post(http, url, agent)
            durations = []
            next_agent = 0
            with timed_parts(PARTS) as spent:
                for _ in range(ticks):
                    for agent in agents[next_agent : next_agent + share]:
                        await post(http, url, agent)
                    next_agent = (next_agent + share) % len(agents)
                    started = time.perf_counter()
                    await agg.evaluate()
                    durations.append(time.perf_counter() - started)
                parts = {label: seconds / ticks * 1e3 for label, seconds in spent.items()}
    return {
        "world_size": world_size,
        "agents": len(agents),
        "rounds": rounds,
        "ticks": ticks,
        "tick_ms_median": round(statistics.median(durations) * 1e3, 2),
        "tick_ms_max": round(max(durations) * 1e3, 2),
        "parts_ms_per_tick": {k: round(v, 2) for k, v in sorted(parts.items())},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=5120, help="ranks (5120)")
    parser.add_argument("--rounds", type=int, default=4, help="POSTs per agent first (4)")
    parser.add_argument("--ticks", type=int, default=15, help="evaluations timed (15)")
    args = parser.parse_args(argv)
    if args.world_size < 8 or args.rounds < 1 or args.ticks < 1:
        parser.error("--world-size must be >= 8, --rounds and --ticks >= 1")
    result = asyncio.run(measure(args.world_size, args.rounds, args.ticks))
    print(
        f"world size {result['world_size']}: evaluate() median {result['tick_ms_median']} ms,"
        f" max {result['tick_ms_max']} ms over {result['ticks']} ticks; per tick, by part:"
    )
    for label, ms in sorted(result["parts_ms_per_tick"].items(), key=lambda kv: -kv[1]):
        print(f"  {ms:8.2f} ms  {label}")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
