"""Caps on the label values that probes supply (op, process group, codec), per job.

Probes name the ops and process groups of their collectives and the codecs of
their buckets, and every distinct value is a series on ``/metrics`` and state in
memory, on the agent and on the aggregator: a buggy or hostile probe naming
thousands (one batch of 2 000 made the agent's ``/metrics`` 4.4 MiB) must not
make either grow without bound. Each job keeps the first values of each label
it sees; later ones are folded into ``OTHER`` where they enter the state, and
counted (``torshmon_label_values_folded_total{job, label}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: What a value past the cap becomes.
OTHER: Final = "other"
#: Distinct values of each label per job. torch.distributed has about 20 op names
#: and torshmon six codecs; a DeviceMesh job has a group per mesh dimension and
#: slice, a few dozen at most. 64 keeps them all with room, and caps the worst case.
MAX_LABEL_VALUES: Final = 64
#: Distinct (op, pg) pairs per job, each a histogram series per rank: 64 ops times
#: 64 groups would still be 4 096 of them. A real job uses a handful of ops per
#: group; a pair past the cap keeps its op and folds its group (counted as pg).
MAX_COLLECTIVES: Final = 256


@dataclass(slots=True)
class _JobLabels:
    values: dict[str, set[str]] = field(default_factory=dict)
    pairs: set[tuple[str, str]] = field(default_factory=set)
    folded: dict[str, int] = field(default_factory=dict)


class LabelCap:
    """The label values each job may still add, and what was folded into ``OTHER``.

    Not thread-safe: one owner (the aggregator's ``LiveState``, on its event loop)
    calls it.
    """

    def __init__(
        self, *, max_values: int = MAX_LABEL_VALUES, max_collectives: int = MAX_COLLECTIVES
    ) -> None:
        if max_values < 1 or max_collectives < 1:
            raise ValueError(
                f"max_values and max_collectives must be >= 1, got {max_values}, {max_collectives}"
            )
        self.max_values = max_values
        self.max_collectives = max_collectives
        self._jobs: dict[str, _JobLabels] = {}

    def value(self, job: str, label: str, value: str) -> str:
        """``value`` if the job has it or room for it, else ``OTHER`` (counted)."""
        labels = self._job(job)
        seen = labels.values.get(label)
        if seen is None:
            seen = labels.values[label] = set()
        if value in seen:
            return value
        if len(seen) < self.max_values:
            seen.add(value)
            return value
        labels.folded[label] = labels.folded.get(label, 0) + 1
        return OTHER

    def collective(self, job: str, op: str, pg: str) -> tuple[str, str]:
        """The (op, pg) a collective is kept under: each label capped, and the pairs."""
        op, pg = self.value(job, "op", op), self.value(job, "pg", pg)
        if OTHER in (op, pg):
            return op, pg  # at most one per op and one per group: bounded already
        pairs = self._job(job).pairs
        if (op, pg) in pairs:
            return op, pg
        if len(pairs) < self.max_collectives:
            pairs.add((op, pg))
            return op, pg
        folded = self._job(job).folded
        folded["pg"] = folded.get("pg", 0) + 1
        return op, OTHER

    def folded(self) -> list[tuple[str, str, int]]:
        """(job, label, values folded so far) for every job and label that folded any."""
        return [
            (job, label, count)
            for job, labels in sorted(self._jobs.items())
            for label, count in sorted(labels.folded.items())
        ]

    def forget(self, job: str) -> None:
        """Drop a job's values and counts (it ended)."""
        self._jobs.pop(job, None)

    def _job(self, job: str) -> _JobLabels:
        labels = self._jobs.get(job)
        if labels is None:
            labels = self._jobs[job] = _JobLabels()
        return labels
