"""What the API says of a live job and its ranks: plain JSON from the live state.

Pure functions of one job's state; ``LiveState`` calls them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from torshmon.aggregator.core.rank_state import JobState
from torshmon.wire import AppliedConfig

__all__ = ["config_summary", "job_summary", "rank_summaries"]


def job_summary(state: JobState) -> dict[str, Any]:
    """World size, ranks reporting, last step, recent step time, communication share,
    throughput and bucket cap of a job; the collectives that raised on its ranks (count
    since each rank attached, with the newest error)."""
    ranks = list(state.ranks.values())
    recent = [x for r in ranks for x in r.recent.rows()]
    return {
        "world_size": state.world_size,
        "ranks_reporting": len(ranks),
        "last_step": max((r.last_step for r in ranks), default=-1),
        "step_duration_s": _mean([d for d, _, _ in recent]),
        "communication_time_ratio": _mean([w / d for d, w, _ in recent if d > 0]),
        "throughput_samples_per_s": _sum_finite([r.samples_per_s for r in ranks]),
        "bucket_cap_bytes": state.bucket_cap_bytes,
        "collective_failures": [
            {
                "rank": rank,
                "op": f.op,
                "pg": f.pg,
                "count": f.count,
                "last_error": f.last_error,
                "last_unix_s": f.last_unix_ns / 1e9,
            }
            for rank, r in sorted(state.ranks.items())
            for f in sorted(r.collective_failures.values(), key=lambda f: (f.op, f.pg))
        ],
    }


def config_summary(config: AppliedConfig) -> dict[str, Any]:
    """The communication config a job runs with."""
    return {
        "version": config.version,
        "bucket_cap_bytes": config.bucket_cap_bytes,
        "first_bucket_cap_bytes": config.first_bucket_cap_bytes,
        "codec": config.codec,
        "codec_params": dict(config.codec_params),
        "effective_step": config.effective_step,
    }


def rank_summaries(state: JobState) -> dict[int, dict[str, Any]]:
    """Each rank's latest step, by rank (None where a value is not measured)."""
    return {
        rank: {
            "node": r.node,
            "last_step": r.last_step,
            "steps_total": r.steps_total,
            "urgent_steps_total": r.urgent_steps_total,
            "step_duration_s": _nan_none(r.duration_s),
            "compute_s": _nan_none(r.compute_s),
            "comm_wait_s": _nan_none(r.comm_wait_s),
            "communication_time_ratio": _nan_none(r.communication_time_ratio),
            "samples_per_s": _nan_none(r.samples_per_s),
            "loss": _nan_none(r.loss),
            "config_version": r.config_version,
        }
        for rank, r in sorted(state.ranks.items())
    }


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def _sum_finite(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else None


def _nan_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
