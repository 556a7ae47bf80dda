"""Whose link is slow, from one pairwise link check's results.

A pair is as fast as the slower of its two links, so each rank's link is at
least as fast as its fastest pair. That estimate (the rank's best pair bandwidth)
is compared with the median estimate over the ranks; a rank below ``slow_ratio``
of it is slow. Taking the best pair means noise (a busy CPU only ever slows an
exchange) flags a rank only if it slows every pair of that rank. At world size 2
there is one pair and a pairwise test cannot say which end is slow: the pair is
compared with the median it reached in this job's earlier checks that found
nothing slow (the reference check after warm-up is the first), a slow reading must
be confirmed by a later check (``linkcheck``), and the finding's ``rank`` label names both
ends, ``"0-1"``. With every link of the job equally slow, nothing stands out and
nothing is named. When a check is sent and when its naming stands: ``linkcheck``.

Ranks that share a host (the probe's ``host`` in each result) are read node by
node (``localize_nodes``): a pair of two hosts' representatives measures both
hosts' NICs, and the same reading applies to nodes instead of ranks (the slowest
node named, at two nodes the node pair). Pairs within a host (loopback, shared
memory, NVLink: another fabric) are kept apart and name nothing.

A busy host slows an exchange as a slow link does: gloo's threads wait for a CPU.
Each rank reports the run-queue delay of its threads during the exchange that counted
(``cpu_wait_s``), and a pair is slow only if it still is with that delay taken off its
time (``pair_link_bounds``: the most bandwidth the link could have had, the larger of
the pair's two waits off the faster side's time). A reading slow only before that is
``contended``: it names nothing, and it is no reference for later checks either. On
two shared cores a background process's CPU bursts made 1 MiB exchanges over loopback
2-4x slower with as much wait as the time lost; over a 100 Mbit/s link (80 ms) the
threads waited 0.1-6 ms.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from torshmon.wire import LinkCheckResult, LinkPeerResult

__all__ = [
    "Localization",
    "NodeReading",
    "Pair",
    "hosts_of",
    "localize",
    "localize_nodes",
    "pair_bandwidths",
    "pair_link_bounds",
]

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
    nodes: NodeReading | None = None
    contended: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeReading:
    """A check read node by node. ``pairs``: bytes/s between two nodes (their
    representatives' pair), keyed by node names in node order (that of their lowest
    rank); ``bandwidth_by_node``: each node's best such pair; ``slow``: the nodes named
    (at two nodes both, if their link is slow); ``ranks``: each node's ranks;
    ``intra``: each node's pairs within it, bytes/s (reported apart, never named);
    ``contended``: the nodes that read slow only while their threads waited for a CPU."""

    pairs: Mapping[tuple[str, str], float]
    bandwidth_by_node: Mapping[str, float]
    reference_bytes_per_s: float | None
    slow: tuple[str, ...]
    ranks: Mapping[str, tuple[int, ...]]
    intra: Mapping[str, Mapping[Pair, float]]
    contended: tuple[str, ...] = ()


def _pair_timings(results: Iterable[LinkCheckResult]) -> Iterator[tuple[Pair, LinkPeerResult]]:
    """Every pair's timing as each side took it (both timed one exchange)."""
    for result in results:
        for peer in result.peers:
            if peer.duration_s > 0 and peer.peer != result.rank:
                yield (min(result.rank, peer.peer), max(result.rank, peer.peer)), peer


def pair_bandwidths(results: Iterable[LinkCheckResult]) -> dict[Pair, float]:
    """Bytes/s of every pair, from whichever side timed it faster."""
    out: dict[Pair, float] = {}
    for pair, peer in _pair_timings(results):
        out[pair] = max(out.get(pair, 0.0), peer.size_bytes / peer.duration_s)
    return out


def pair_link_bounds(results: Iterable[LinkCheckResult]) -> dict[Pair, float]:
    """Bytes/s each pair's link could have had: the faster side's time less the larger
    of the two sides' CPU wait (infinite when the wait covers the whole time). Where
    either side did not report its wait, the pair's measured bandwidth."""
    sides: dict[Pair, list[LinkPeerResult]] = {}
    for pair, peer in _pair_timings(results):
        sides.setdefault(pair, []).append(peer)
    out: dict[Pair, float] = {}
    for pair, timed in sides.items():
        link_s = min(p.duration_s for p in timed)
        waits = [p.cpu_wait_s for p in timed if p.cpu_wait_s is not None]
        if len(waits) == len(timed):
            link_s -= max(waits)
        out[pair] = timed[0].size_bytes / link_s if link_s > 0 else math.inf
    return out


def _best_by_rank(pairs: Mapping[Pair, float]) -> dict[int, float]:
    by_rank: dict[int, float] = {}
    for (a, b), bandwidth in pairs.items():
        for rank in (a, b):
            by_rank[rank] = max(by_rank.get(rank, 0.0), bandwidth)
    return by_rank


def localize(
    world_size: int,
    pairs: Mapping[Pair, float],
    *,
    slow_ratio: float = 0.5,
    reference_pair: Mapping[Pair, float] | None = None,
    bounds: Mapping[Pair, float] | None = None,
) -> Localization:
    """Name the slow ranks of one check (see the module docstring).

    ``reference_pair`` (world size 2 only) holds what each pair reached in earlier
    checks of the job that found nothing slow. ``bounds``: what each pair's link could
    have had net of CPU wait (``pair_link_bounds``; None: the measured bandwidths); a
    rank slow by ``pairs`` but not by ``bounds`` is ``contended``, not slow.
    """
    by_rank = _best_by_rank(pairs)
    bound_by_rank = _best_by_rank(bounds) if bounds is not None else by_rank
    if world_size == 2:
        pair = (0, 1)
        reference = (reference_pair or {}).get(pair)
        slow: tuple[int, ...] = ()
        contended: tuple[int, ...] = ()
        if pair in pairs and reference is not None and pairs[pair] < slow_ratio * reference:
            bound = pairs[pair] if bounds is None else bounds.get(pair, pairs[pair])
            if bound < slow_ratio * reference:
                slow = pair
            else:
                contended = pair
        return Localization(dict(pairs), by_rank, reference, slow, contended=contended)
    if len(by_rank) < 3:
        return Localization(dict(pairs), by_rank, None)
    reference = statistics.median(by_rank.values())
    bar = slow_ratio * reference
    below = sorted(r for r, bw in by_rank.items() if bw < bar)
    slow = tuple(r for r in below if bound_by_rank.get(r, by_rank[r]) < bar)
    contended = tuple(r for r in below if r not in slow)
    return Localization(dict(pairs), by_rank, reference, slow, contended=contended)


def hosts_of(results: Iterable[LinkCheckResult]) -> dict[int, str] | None:
    """Each rank's host, when the results say ranks share hosts; None when every rank
    has a host of its own or all share one (no probe host: its own), read by rank."""
    hosts = {r.rank: r.host or f"rank {r.rank}" for r in results}
    distinct = len(set(hosts.values()))
    return hosts if 1 < distinct < len(hosts) else None


def localize_nodes(
    nodes: Mapping[int, str],
    pairs: Mapping[Pair, float],
    *,
    slow_ratio: float = 0.5,
    reference_pair: Mapping[tuple[str, str], float] | None = None,
    bounds: Mapping[Pair, float] | None = None,
) -> Localization:
    """Name the slow nodes of one check, ``nodes`` giving each rank's node name
    (``localize`` applied to nodes; ``reference_pair``: what each node pair reached
    in earlier checks that found nothing slow, read at two nodes; ``bounds`` as for
    ``localize``)."""
    ranks: dict[str, list[int]] = {}
    for rank in sorted(nodes):
        ranks.setdefault(nodes[rank], []).append(rank)
    order = list(ranks)  # by lowest rank
    index = {name: i for i, name in enumerate(order)}
    between: dict[Pair, float] = {}
    between_bounds: dict[Pair, float] = {}
    intra: dict[str, dict[Pair, float]] = {name: {} for name in order}
    for (a, b), bandwidth in pairs.items():
        na, nb = nodes.get(a), nodes.get(b)
        if na is None or nb is None:
            continue
        if na == nb:
            intra[na][(a, b)] = bandwidth
            continue
        key = (min(index[na], index[nb]), max(index[na], index[nb]))
        between[key] = max(between.get(key, 0.0), bandwidth)
        bound = bandwidth if bounds is None else bounds.get((a, b), bandwidth)
        between_bounds[key] = max(between_bounds.get(key, 0.0), bound)
    reference = {
        (index[a], index[b]): bw
        for (a, b), bw in (reference_pair or {}).items()
        if a in index and b in index
    }
    reading = localize(
        len(order),
        between,
        slow_ratio=slow_ratio,
        reference_pair=reference,
        bounds=between_bounds,
    )
    by_node = NodeReading(
        pairs={(order[a], order[b]): bw for (a, b), bw in sorted(between.items())},
        bandwidth_by_node={order[i]: bw for i, bw in sorted(reading.bandwidth_by_rank.items())},
        reference_bytes_per_s=reading.reference_bytes_per_s,
        slow=tuple(order[i] for i in reading.slow),
        ranks={name: tuple(members) for name, members in ranks.items()},
        intra=intra,
        contended=tuple(order[i] for i in reading.contended),
    )
    by_rank: dict[int, float] = {}
    for (a, b), bandwidth in pairs.items():
        if nodes.get(a) != nodes.get(b):
            for rank in (a, b):
                by_rank[rank] = max(by_rank.get(rank, 0.0), bandwidth)
    return Localization(dict(pairs), by_rank, reading.reference_bytes_per_s, (), nodes=by_node)
