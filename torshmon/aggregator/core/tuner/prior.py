"""The session's first proposals, from what the job tells: its link, its communication
share, its buckets and how steady its loss is.

The rules (the seeds' starting point): compress only when communication dominates the
step (``compress_above`` of step time, the High Communication Overhead rule's 0.4 by
default); then the measured link bandwidth (the link check's slowest rank or node: a
ring all-reduce runs at the pace of its slowest link) picks the strength of the
compression: below 10 Gbit/s the strongest (top-k 0.001, PowerSGD rank 1), below 25
Gbit/s a middle one (top-k 0.01, PowerSGD rank 4), else a light one (int8, fp16). A
loss that is not steady (its windows spread by more than the loss guard's bound)
takes one class lighter: a codec judged on a noisy loss is judged on noise. Each class
names one codec of each family, strongest first; a choice the space does not offer is
skipped. When communication does not dominate, or nothing is known, no codec is
proposed: the search starts from the job's own codec and moves its buckets.

The bucket count orders the bucket screen: a job that reduces in at most two buckets
overlaps little of its communication with backward, so smaller buckets come first;
otherwise larger (fewer calls, less per-call latency).

Pure: ``Evidence`` in, configs out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from torshmon.aggregator.core.tuner.config import CodecChoice, TrialConfig
from torshmon.aggregator.core.tuner.space import SearchSpace

GBIT: Final = 1e9 / 8  # bytes/s
#: (link below, bytes/s; the codec choices to screen, strongest first). The last class
#: has no bound: a link at or above 25 Gbit/s.
CLASSES: Final[tuple[tuple[float, tuple[CodecChoice, ...]], ...]] = (
    (10 * GBIT, (CodecChoice("topk", {"ratio": 0.001}), CodecChoice("powersgd", {"rank": 1}))),
    (25 * GBIT, (CodecChoice("topk", {"ratio": 0.01}), CodecChoice("powersgd", {"rank": 4}))),
    (float("inf"), (CodecChoice("int8"), CodecChoice("fp16"))),
)
#: The class used when the link was not measured but communication dominates.
UNKNOWN_LINK_CLASS: Final = 1
#: A job reducing in at most this many buckets overlaps little: smaller buckets first.
FEW_BUCKETS: Final = 2


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the job told before its first trial; None where it did not say.

    ``link_bytes_per_s``: the slowest link of the latest link check. ``communication_ratio``:
    rank 0's median share of step time spent waiting for communication while the baseline
    was measured. ``bucket_count``: DDP buckets reduced per step. ``loss_spread``: the
    baseline's loss windows, (max - min) / |median|.
    """

    link_bytes_per_s: float | None = None
    communication_ratio: float | None = None
    bucket_count: int | None = None
    loss_spread: float | None = None

    def describe(self) -> str:
        """``link 0.95 Gbit/s, communication 0.62 of the step, 3 buckets, loss spread 0.04``."""
        parts = []
        if self.link_bytes_per_s is not None:
            parts.append(f"link {self.link_bytes_per_s / GBIT:.3g} Gbit/s")
        if self.communication_ratio is not None:
            parts.append(f"communication {self.communication_ratio:.2f} of the step")
        if self.bucket_count is not None:
            parts.append(f"{self.bucket_count} buckets")
        if self.loss_spread is not None:
            parts.append(f"loss spread {self.loss_spread:.2g}")
        return ", ".join(parts) or "nothing measured"


def codec_class(
    evidence: Evidence, *, compress_above: float, steady_loss_spread: float
) -> int | None:
    """The index into ``CLASSES`` the evidence points to; None: do not compress."""
    ratio = evidence.communication_ratio
    if ratio is None or ratio < compress_above:
        return None
    link = evidence.link_bytes_per_s
    if link is None:
        index = UNKNOWN_LINK_CLASS
    else:
        index = next(i for i, (below, _) in enumerate(CLASSES) if link < below)
    if evidence.loss_spread is not None and evidence.loss_spread > steady_loss_spread:
        index = min(index + 1, len(CLASSES) - 1)
    return index


def first_codecs(
    space: SearchSpace, evidence: Evidence, *, compress_above: float, steady_loss_spread: float
) -> list[CodecChoice]:
    """The codec choices the evidence asks to try first (those the space offers)."""
    if not space.tunes_codec:
        return []
    index = codec_class(
        evidence, compress_above=compress_above, steady_loss_spread=steady_loss_spread
    )
    if index is None:
        return []
    offered = {c.label for c in space.codecs}
    return [c for c in CLASSES[index][1] if c.label in offered]


def first_proposals(
    space: SearchSpace,
    baseline: TrialConfig,
    evidence: Evidence,
    *,
    count: int,
    compress_above: float,
    steady_loss_spread: float,
) -> list[TrialConfig]:
    """Up to ``count`` configs: the evidence's codecs at the job's own bucket cap."""
    cap = space.snap_bucket(baseline.bucket_cap_mb) if space.tunes_bucket else None
    codecs = first_codecs(
        space, evidence, compress_above=compress_above, steady_loss_spread=steady_loss_spread
    )
    return [space.make_config(cap, c, baseline) for c in codecs][:count]


def bucket_factors(factors: Sequence[float], evidence: Evidence) -> list[float]:
    """The bucket screen's factors in the order the bucket count suggests."""
    few = evidence.bucket_count is not None and evidence.bucket_count <= FEW_BUCKETS
    return sorted(factors, reverse=not few)


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / |median| of ``values``; None for fewer than two or a zero median."""
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    if middle == 0:
        return None
    return (max(values) - min(values)) / abs(middle)


def slowest_link(reading: Mapping[str, object] | None) -> float | None:
    """The slowest link (bytes/s) of a link check reading (``LiveState.link_reading``):
    per node when ranks share hosts, else per rank; None without a usable reading."""
    if reading is None:
        return None
    nodes = reading.get("nodes")
    by: object = reading.get("bandwidth_by_rank")
    if isinstance(nodes, Mapping) and nodes.get("bandwidth_by_node"):
        by = nodes["bandwidth_by_node"]
    if not isinstance(by, Mapping):
        return None
    values = [float(v) for v in by.values() if isinstance(v, int | float) and v > 0]
    return min(values) if values else None
