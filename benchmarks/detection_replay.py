"""Replays the straggler detector on the jobs ``detection.py --dump DIR`` wrote.

A dump keeps each job's per-rank steps (compute time, the training thread's CPU wait),
so the detector can be run again on the same steps in seconds, with other settings,
instead of re-running the jobs for a quarter of an hour. Each complete step goes in as
the aggregator feeds it: every rank's compute less its CPU wait, in step order.

For each job it prints the stragglers in scope (``_scoring.straggler_in_scope``) that
were not named (a finding that pages, as the Straggler rule fires only then), or named
more than ``--late`` slow steps after their onset, and every rank named outside the
episodes that slowed it (each episode's steps, its last slow
step plus the detector's ``hold_steps`` and ``window_steps`` after it). These are the
detector's own decisions; the benchmark's figures add the pipeline's delays (shipping,
evaluation) on top. The last line of stdout is one JSON object.

Usage::

    python benchmarks/detection.py --seeds 70 --dump /tmp/dump70   # write the dumps
    python benchmarks/detection_replay.py /tmp/dump70              # replay them
    python benchmarks/detection_replay.py /tmp/dump70 --set max_window_noise=0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._scoring import median, straggler_in_scope
from torshmon.aggregator.core.straggler import StragglerDetector, StragglerSettings


def complete_steps(dump: dict[str, Any]) -> list[tuple[int, dict[int, float]]]:
    """Every step all ranks reported, in step order: each rank's compute less its
    training thread's CPU wait (the aggregator's ``_own_compute``)."""
    columns = dump["columns"]
    rank_i, step_i = columns.index("rank"), columns.index("step")
    compute_i, wait_i = columns.index("compute_s"), columns.index("cpu_wait_s")
    by_step: dict[int, dict[int, float]] = defaultdict(dict)
    for row in dump["rows"]:
        compute, wait = row[compute_i], row[wait_i]
        if compute is None:
            continue
        if wait is not None and wait > 0:
            compute -= min(wait, compute)
        by_step[row[step_i]][row[rank_i]] = compute
    world = dump["world_size"]
    return [(step, by_step[step]) for step in sorted(by_step) if len(by_step[step]) == world]


def replay(dump: dict[str, Any], settings: StragglerSettings) -> dict[str, Any]:
    """One job's outcome: per straggler episode the slow steps before it was named
    (None: never), and the ranks named outside their episodes (rank: first step)."""
    detector = StragglerDetector(settings)
    named: dict[int, list[int]] = defaultdict(list)
    for step, compute in complete_steps(dump):
        for finding in detector.observe_step("job", step, compute, float(step)):
            # A finding that does not page (a few slow steps) is shown, never fired.
            if finding.details.get("page", True):
                named[int(finding.labels["rank"])].append(step)
    world = dump["world_size"]
    after = settings.hold_steps + settings.window_steps
    allowed: dict[int, set[int]] = defaultdict(set)
    episodes = []
    for ep in dump.get("plan", []):
        if ep["rank"] is None:
            continue
        onset, end = ep["onset_step"], ep["end_step"]
        allowed[ep["rank"]] |= set(range(onset, end + after))
        if ep["kind"] != "straggler":
            continue
        hits = [s for s in named[ep["rank"]] if onset <= s < end]
        episodes.append(
            {
                "label": ep["label"],
                "magnitude": ep["magnitude"],
                "rank": ep["rank"],
                "in_scope": straggler_in_scope(ep["magnitude"], world),
                "named_after_steps": hits[0] - onset + 1 if hits else None,
            }
        )
    wrong = {
        rank: min(s for s in steps if s not in allowed[rank])
        for rank, steps in named.items()
        if any(s not in allowed[rank] for s in steps)
    }
    return {"world_size": world, "episodes": episodes, "wrongly_named": wrong}


def _override(pairs: Sequence[str]) -> StragglerSettings:
    """``StragglerSettings`` with ``name=value`` pairs (values as JSON); SystemExit with
    one line on a bad pair."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes name=value, got {pair!r}")
        try:
            values[name] = json.loads(value)
        except json.JSONDecodeError:
            raise SystemExit(f"--set {name}: {value!r} is not a number") from None
    try:
        return msgspec.convert(values, StragglerSettings)
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"--set: {exc}") from None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="folders detection.py --dump wrote")
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a detector setting"
    )
    parser.add_argument("--late", type=int, default=10, help="slow steps that count as late")
    args = parser.parse_args(argv)
    settings = _override(args.set)
    paths = sorted(p for d in args.dirs for p in d.glob("*.json"))
    if not paths:
        raise SystemExit(f"no dumps (*.json) in {', '.join(map(str, args.dirs))}")
    firsts: list[int] = []
    missed = late = wrong_jobs = in_scope = 0
    for path in paths:
        outcome = replay(json.loads(path.read_text()), settings)
        notes = []
        for ep in outcome["episodes"]:
            if not ep["in_scope"]:
                continue
            in_scope += 1
            first = ep["named_after_steps"]
            if first is None:
                missed += 1
                notes.append(f"missed {ep['label']} {ep['magnitude']:g}x rank {ep['rank']}")
            else:
                firsts.append(first)
                if first > args.late:
                    late += 1
                    notes.append(f"late ({first} steps) {ep['label']} {ep['magnitude']:g}x")
        if outcome["wrongly_named"]:
            wrong_jobs += 1
            for rank, step in sorted(outcome["wrongly_named"].items()):
                notes.append(f"rank {rank} named at step {step}, outside its episodes")
        print(f"{path.name}: {'; '.join(notes) or 'ok'}")
    summary = {
        "jobs": len(paths),
        "in_scope": in_scope,
        "missed": missed,
        "late": late,
        "median_named_after_steps": median(firsts),
        "worst_named_after_steps": max(firsts, default=None),
        "jobs_with_a_wrong_name": wrong_jobs,
        "settings": msgspec.structs.asdict(settings),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
