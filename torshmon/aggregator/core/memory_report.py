"""The ``recommend_memory`` action's message: how a rank's memory grew, step by step.

A memory alert (High Memory Usage on a node, Memory Leak on a rank) says that memory
is short or growing; this says where, from the job's own numbers: for each rank the
alert concerns, its resident memory at the start and end of the live window, the
steps those samples fell in, the growth per step and the largest rise between two
samples. The service puts it in the alert's ``description`` before it is stored and
sent. Pure: the live state hands in its records (``memory_of``).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torshmon.aggregator.core.rank_state import JobState, RankState
from torshmon.aggregator.core.series import SeriesStore
from torshmon.wire import NodeSample

#: Below this a rank's memory counts as steady (agent samples jitter by pages).
STEADY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One rank's recent memory samples and step ends, each ``(ts_unix_s, value)``,
    oldest first; ``rss`` in bytes, ``steps`` step numbers."""

    job: str
    rank: int
    node: str
    rss: Sequence[tuple[float, float]]
    steps: Sequence[tuple[float, int]]


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU of the node at its latest sample."""

    node: str
    index: int
    used_bytes: int
    total_bytes: int


def memory_report(ranks: Sequence[RankMemory], gpus: Sequence[GpuMemory] = ()) -> str:
    """One line per rank (largest growth first) and one per GPU, or "" with no data."""
    lines = [line for _, line in sorted((_rank_line(r) for r in ranks), reverse=True) if line]
    for gpu in gpus:
        if gpu.total_bytes > 0:
            lines.append(
                f"GPU {gpu.index} on node {gpu.node}: {_size(gpu.used_bytes)} of "
                f"{_size(gpu.total_bytes)} used ({gpu.used_bytes / gpu.total_bytes:.0%})."
            )
    return "\n".join(lines)


def memory_of(
    labels: Mapping[str, str],
    jobs: Mapping[str, JobState],
    series: SeriesStore,
    nodes: Mapping[str, NodeSample],
) -> tuple[list[RankMemory], list[GpuMemory]]:
    """The memory behind an alert on ``labels``: a rank's (``job`` and ``rank``) or
    every rank's on a ``node``, with the RSS samples the live series hold and the
    step ends to date them; and the GPUs of those ranks' nodes."""
    picked: list[tuple[str, int, RankState]] = []
    job_name, rank, node = labels.get("job"), labels.get("rank"), labels.get("node")
    for name, job in jobs.items():
        for number, r in job.ranks.items():
            if job_name is not None and rank is not None:
                if name == job_name and str(number) == rank:
                    picked.append((name, number, r))
            elif node is not None and r.node == node:
                picked.append((name, number, r))
    ranks = [
        RankMemory(
            job=name,
            rank=number,
            node=r.node,
            rss=series.points(
                "rank_memory_rss_bytes", {"job": name, "node": r.node, "rank": str(number)}, 0.0
            ),
            steps=list(r.step_marks),
        )
        for name, number, r in picked
    ]
    names = sorted({r.node for r in ranks} | ({node} if node else set()))
    gpus = [
        GpuMemory(n, g.index, g.memory_used_bytes, g.memory_total_bytes)
        for n in names
        if n in nodes
        for g in nodes[n].gpus
    ]
    return ranks, gpus


def _rank_line(r: RankMemory) -> tuple[float, str]:
    """(growth in bytes, the rank's line); (0, "") without two samples."""
    if len(r.rss) < 2:
        if r.rss:
            at = _step_at(r.steps, r.rss[-1][0])
            return 0.0, f"{_who(r)}: {_size(r.rss[-1][1])} {at}."
        return 0.0, ""
    (t0, first), (t1, last) = r.rss[0], r.rss[-1]
    growth = last - first
    start, end = _step_number(r.steps, t0), _step_number(r.steps, t1)
    if abs(growth) < STEADY_BYTES:
        return growth, (
            f"{_who(r)}: steady at {_size(last)} over {t1 - t0:.0f} s ({_steps_text(start, end)})."
        )
    text = (
        f"{_who(r)}: {_size(first)} {_step_at(r.steps, t0)} -> {_size(last)} "
        f"{_step_at(r.steps, t1)}: {_signed(growth)} in {t1 - t0:.0f} s "
        f"({_signed(growth / (t1 - t0))}/s"
    )
    if start is not None and end is not None and end > start:
        text += f", {_signed(growth / (end - start))} per step"
    text += ")"
    rise, (a, b) = max(
        (r.rss[i + 1][1] - r.rss[i][1], (r.rss[i][0], r.rss[i + 1][0]))
        for i in range(len(r.rss) - 1)
    )
    # Worth naming only where memory grew in jumps: twice the mean rise or more.
    if rise >= STEADY_BYTES and rise < growth and rise >= 2 * growth / (len(r.rss) - 1):
        text += (
            f"; the largest rise, {_signed(rise)}, came between "
            f"{_steps_text(_step_number(r.steps, a), _step_number(r.steps, b))}"
        )
    return growth, text + "."


def _who(r: RankMemory) -> str:
    return f"Job {r.job} rank {r.rank} (node {r.node})"


def _step_number(steps: Sequence[tuple[float, int]], ts: float) -> int | None:
    """The last step that had ended at ``ts`` (None before the first known one)."""
    i = bisect.bisect_right([t for t, _ in steps], ts)
    return steps[i - 1][1] if i else None


def _step_at(steps: Sequence[tuple[float, int]], ts: float) -> str:
    step = _step_number(steps, ts)
    return "before its first step" if step is None else f"at step {step}"


def _steps_text(start: int | None, end: int | None) -> str:
    if start is None and end is None:
        return "no steps yet"
    if start is None:
        return f"the start and step {end}"
    if start == end:
        return f"step {start} and the next"
    return f"steps {start} and {end}"


def _size(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _signed(value: float) -> str:
    return ("+" if value >= 0 else "-") + _size(abs(value))
