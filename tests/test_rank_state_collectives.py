"""The aggregator's fold of a step's collective rows: rows nothing timed (gloo's DDP
all-reduces) add their bytes and nothing to the duration histogram or bandwidth."""

from __future__ import annotations

from torshmon.aggregator.core.rank_state import RankState, observe_collectives
from torshmon.labels import LabelCap
from torshmon.wire import DURATION_BUCKETS_S, CollectiveStat


def _hist(index: int) -> list[int]:
    counts = [0] * (len(DURATION_BUCKETS_S) + 1)
    counts[index] = 1
    return counts


def test_untimed_rows_add_bytes_and_no_time() -> None:
    timed = CollectiveStat(
        op="all_reduce",
        pg="default",
        dtype="float32",
        count=1,
        size_bytes=4,
        duration_s=2e-5,
        max_duration_s=2e-5,
        algbw_bytes_per_s=2e5,
        busbw_bytes_per_s=2e5,
        duration_hist=_hist(1),
    )
    untimed = CollectiveStat(
        op="all_reduce",
        pg="default",
        dtype="float32",
        count=3,
        size_bytes=9_000,
        duration_hist=[0] * (len(DURATION_BUCKETS_S) + 1),
    )
    r = RankState()
    observe_collectives(r, [untimed], "job", LabelCap())
    key = ("all_reduce", "default")
    assert r.collective_bytes_total[key] == 9_000
    assert (r.collectives[key].count, r.collectives[key].sum) == (0, 0.0)
    assert key not in r.busbw  # no bandwidth is exported for it
    observe_collectives(r, [timed, untimed], "job", LabelCap())
    assert r.collective_bytes_total[key] == 18_004
    hist = r.collectives[key]
    assert (hist.count, hist.sum, hist.counts[1]) == (1, 2e-5, 1)
    assert r.busbw[key] == 2e5
