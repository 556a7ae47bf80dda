"""Whose link is slow, from one pairwise link check's results.

A pair is as fast as the slower of its two links, so each rank's link is at
least as fast as its fastest pair. That estimate (the rank's best pair bandwidth)
is compared with the median estimate over the ranks; a rank below ``slow_ratio``
of it is slow. Taking the best pair means noise (a busy CPU only ever slows an
exchange) flags a rank only if it slows every pair of that rank. At world size 2
there is one pair and a pairwise test cannot say which end is slow: the pair is
compared with the median it reached in this job's earlier checks that found
nothing slow (the reference check after warm-up is the first), a slow reading is
confirmed by a second check at once, and the finding's ``rank`` label names both
ends, ``"0-1"``. With every link of the job equally slow, nothing stands out and
nothing is named. When a check is sent and when its naming stands: ``linkcheck``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torshmon.wire import LinkCheckResult

__all__ = ["Localization", "Pair", "localize", "pair_bandwidths"]

#: Two ranks, the lower first.
Pair = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Localization:
    """What one check says. ``bandwidth_by_rank``: each rank's best pair (bytes/s);
    ``reference_bytes_per_s``: what a rank is compared with; ``slow``: the ranks named
    (empty if none), or at world size 2 the pair, if it is slow. ``duration_s``: the
    longest any rank was held by the check (its cost to the job)."""

    pairs: Mapping[Pair, float]
    bandwidth_by_rank: Mapping[int, float]
    reference_bytes_per_s: float | None
    slow: tuple[int, ...] = ()
    duration_s: float = 0.0


def pair_bandwidths(results: Iterable[LinkCheckResult]) -> dict[Pair, float]:
    """Bytes/s of every pair, from whichever side timed it faster (both timed one exchange)."""
    out: dict[Pair, float] = {}
    for result in results:
        for peer in result.peers:
            if peer.duration_s <= 0 or peer.peer == result.rank:
                continue
            pair = (min(result.rank, peer.peer), max(result.rank, peer.peer))
            bandwidth = peer.size_bytes / peer.duration_s
            out[pair] = max(out.get(pair, 0.0), bandwidth)
    return out


def localize(
    world_size: int,
    pairs: Mapping[Pair, float],
    *,
    slow_ratio: float = 0.5,
    reference_pair: Mapping[Pair, float] | None = None,
) -> Localization:
    """Name the slow ranks of one check (see the module docstring).

    ``reference_pair`` (world size 2 only) holds what each pair reached in earlier
    checks of the job that found nothing slow.
    """
    by_rank: dict[int, float] = {}
    for (a, b), bandwidth in pairs.items():
        for rank in (a, b):
            by_rank[rank] = max(by_rank.get(rank, 0.0), bandwidth)
    if world_size == 2:
        pair = (0, 1)
        reference = (reference_pair or {}).get(pair)
        slow: tuple[int, ...] = ()
        if pair in pairs and reference is not None and pairs[pair] < slow_ratio * reference:
            slow = pair
        return Localization(dict(pairs), by_rank, reference, slow)
    if len(by_rank) < 3:
        return Localization(dict(pairs), by_rank, None)
    reference = statistics.median(by_rank.values())
    slow = tuple(sorted(r for r, bw in by_rank.items() if bw < slow_ratio * reference))
    return Localization(dict(pairs), by_rank, reference, slow)
