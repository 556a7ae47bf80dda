"""A small history with known numbers, for the report's tests: two ranks, a straggler
alert with a finding, a flapping rule, a tuning session with a kept and a rolled-back
trial. Every figure the tests expect is worked out here by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from sqlalchemy import insert

from torshmon.history.db import make_engine
from torshmon.history.models import Base

#: A job name with markup in it: the page must show it as text.
JOB: Final = "bert<script>alert(1)</script>"
T0: Final = 1_700_000_000.0
STEPS: Final = 20
#: Rank 0's step i (1..20) takes 10*i ms: median 105 ms, p95 190.5 ms (linear, 0.95*19
#: = 18.05 between 190 and 200). Rank 1's steps all take 50 ms, of which 45 ms compute.
RANK0_MEDIAN_MS: Final = 105.0
RANK0_P95_MS: Final = 190.5
STRAGGLER_START: Final = T0 + 8.0
SUMMARY: Final = "rank 1 of job bert computes 3x slower than its peers <b>now</b>"


def _step(rank: int, i: int) -> dict[str, Any]:
    duration = 0.010 * i if rank == 0 else 0.050
    comm = duration * 0.25 if rank == 0 else 0.005
    return {
        "job": JOB,
        "rank": rank,
        "node": f"node{rank}",
        "step": i,
        "end_unix_ns": int((T0 + i) * 1e9),
        "duration_s": duration,
        "comm_wait_s": comm,
        "compute_s": duration - comm,
        "communication_time_ratio": comm / duration,
        "comm_busy_s": comm,
        "forward_s": duration * 0.2,
        "backward_s": duration * 0.5,
        "optimizer_s": duration * 0.1,
        "batch_size": 32,
        "samples_per_s": 32 / duration,
        "loss": 1.0,
        "loss_nonfinite": False,
        "config_version": 0,
        # Rank 1 waits 5 ms for its input before each step; rank 0's is not measured.
        "input_wait_s": 0.005 if rank == 1 else None,
    }


def _alert(
    id_: int, rule: str, rank: int | None, start: float, fired: float | None, end: float
) -> dict[str, Any]:
    return {
        "id": id_,
        "fingerprint": f"{id_:016x}",
        "rule": rule,
        "severity": "high",
        "state": "resolved",
        "job": JOB,
        "rank": rank,
        "labels": {"job": JOB},
        "annotations": {"summary": SUMMARY if rule == "Straggler" else f"{rule} on the job"},
        "value": 3.0,
        "starts_at_unix_s": start,
        "fired_at_unix_s": fired,
        "ends_at_unix_s": end,
        "updated_unix_s": end,
        "aggregator_id": "a1",
    }


def make_history(path: Path) -> str:
    """The history at ``path`` (SQLite); returns its URL."""
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    t = Base.metadata.tables
    with engine.begin() as conn:
        conn.execute(
            insert(t["jobs"]),
            [
                {
                    "job": JOB,
                    "world_size": 2,
                    "backend": "gloo",
                    "first_seen_unix_ns": int(T0 * 1e9),
                    "last_seen_unix_ns": int((T0 + STEPS) * 1e9),
                    "aggregator_id": "a1",
                }
            ],
        )
        conn.execute(
            insert(t["probe_sessions"]),
            [
                {
                    "session": f"s{rank}",
                    "job": JOB,
                    "rank": rank,
                    "local_rank": 0,
                    "world_size": 2,
                    "node": f"node{rank}",
                    "pid": 100 + rank,
                    "backend": "gloo",
                    "torch_version": "2.13.0",
                    "probe_version": "0.1.0",
                    "started_unix_ns": int(T0 * 1e9),
                    "last_seen_unix_ns": int((T0 + STEPS) * 1e9),
                    "last_seq": 1,
                    "dropped_records_total": 0,
                }
                for rank in (0, 1)
            ],
        )
        conn.execute(insert(t["steps"]), [_step(r, i) for r in (0, 1) for i in range(1, STEPS + 1)])
        conn.execute(
            insert(t["rank_samples"]),
            [
                {
                    "node": f"node{rank}",
                    "ts_unix_ns": int((T0 + i) * 1e9),
                    "job": JOB,
                    "rank": rank,
                    "pid": 100 + rank,
                    "rss_bytes": (500 + 10 * i) * 2**20,
                }
                for rank in (0, 1)
                for i in range(STEPS)
            ],
        )
        conn.execute(
            insert(t["alerts"]),
            [
                _alert(1, "Straggler", 1, STRAGGLER_START, STRAGGLER_START + 2, T0 + 14),
                # A flapping rule: three episodes that never fired.
                *(_alert(2 + k, "High Comm", None, T0 + k, None, T0 + k + 0.5) for k in range(3)),
            ],
        )
        conn.execute(
            insert(t["findings"]),
            [
                {
                    "kind": "straggler",
                    "job": JOB,
                    "rank": 1,
                    "metric": None,
                    "value": 0.045,
                    "score": 6.0,
                    "summary": SUMMARY if episode else "rank 1 was slow",
                    "recommendation": "Check rank 1's node.",
                    "severity": "high",
                    "category": "straggler",
                    "priority": 1,
                    "expected_gain_ratio": 0.3,
                    "difficulty": "medium",
                    "since_unix_s": T0 + 2 + 6 * episode,
                    "detected_unix_s": T0 + 3 + 6 * episode,
                    "updated_unix_s": T0 + 5 + 9 * episode,
                    "ended_unix_s": T0 + 5 + 9 * episode,
                    "aggregator_id": "a1",
                    "details": {},
                }
                for episode in (0, 1)
            ],
        )
        conn.execute(
            insert(t["tuning_sessions"]),
            [
                {
                    "id": "sess1",
                    "job": JOB,
                    "state": "finished",
                    "trigger": "api",
                    "started_unix_s": T0 + 2,
                    "ended_unix_s": T0 + 18,
                    "baseline_config": {"codec": "none", "bucket_cap_mb": 25},
                    "best_config": {"codec": "fp16", "bucket_cap_mb": 25},
                    "baseline_score": 600.0,
                    "best_score": 700.0,
                    "reason": "",
                    "aggregator_id": "a1",
                    "state_blob": {"summary": "fp16 is 17% faster", "unit": "samples/s"},
                }
            ],
        )
        conn.execute(
            insert(t["tuning_trials"]),
            [
                {
                    "session_id": "sess1",
                    "job": JOB,
                    "trial_index": i,
                    "config": {"codec": codec, "bucket_cap_mb": 25},
                    "command_id": None,
                    "state": "done",
                    "windows": [score],
                    "score": score,
                    "decision": decision,
                    "reason": "",
                    "started_unix_s": T0 + 2 + 5 * i,
                    "ended_unix_s": T0 + 6 + 5 * i,
                }
                for i, (codec, score, decision) in enumerate(
                    (("fp16", 700.0, "kept"), ("int8", 450.0, "worse"))
                )
            ],
        )
    engine.dispose()
    return url
