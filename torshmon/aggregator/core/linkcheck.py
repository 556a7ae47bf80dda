"""Slow-link localisation: when to run a pairwise link check, and whose link is slow.

A slow link slows every rank's collectives alike while compute stays as it was, so
neither the straggler detector nor per-rank timings can name it; the probe's active
test (``torshmon.probe.linkcheck``: every pair of ranks exchanges a block of bytes,
timed) can. This module is pure: observations and an explicit ``now`` in, decisions and
``Finding`` records out; the service submits the commands.

In: per rank and step, communication wait and compute (``observe_step(s)``); the
world size and each rank's node; the results of checks (``observe_result``) and the
fate of their commands (``command_done``).

Out: ``due`` names the jobs to check now and why (a rise of communication wait with
compute flat, the one reference check after warm-up, or a recheck while a finding is
active); ``check_args`` the command's arguments; after ``evaluate``, ``active`` holds
the ``slow_link`` findings (by rank, or by node when ranks share hosts: ``node``
label), which clear when a recheck finds the link well; ``last`` the latest reading.

Knobs (``LinkCheckSettings``, section ``link_check``): ``comm_rise``,
``min_comm_rise_s`` and ``compute_flat`` say what a rise is; ``min_interval_s``,
``recheck_s`` and ``confirm_after_s`` space the checks (a naming stands once a second
check names the same); ``max_unexplained`` rises left unexplained become the baseline;
``slow_ratio``, ``size_bytes`` and ``repeats`` shape the test.

Why (noise, confirmation, the seeds that set them): docs/detectors/linkcheck.md.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.localization import (
    Localization,
    NodeReading,
    Pair,
    hosts_of,
    localize,
    localize_nodes,
    pair_bandwidths,
    pair_link_bounds,
)
from torshmon.settings import setting
from torshmon.wire import LinkCheckResult

__all__ = ["LinkCheckSettings", "LinkChecker", "node_details", "reading_json"]

RECOMMENDATION = (
    "Check the rank's (or node's) network path: NIC and cable, the switch port and its error "
    "counters, the link speed and duplex negotiated (`ethtool <iface>`, "
    "`ethtool -S <iface>`, `ip -s link`), and traffic shaping or a noisy neighbour "
    "on the host."
)


@dataclass(frozen=True, slots=True)
class LinkCheckSettings:
    """The link checker's settings: when to run pairwise link checks and how to read them."""

    min_interval_s: Annotated[
        float, setting("least time between checks a communication rise asks for", ge=0)
    ] = 15.0
    recheck_s: Annotated[float, setting("time between checks while a slow link is named", ge=0)] = (
        5.0
    )
    timeout_s: Annotated[float, setting("time a check may take", ge=0)] = 15.0
    slow_ratio: Annotated[
        float, setting("a rank below this fraction of the median bandwidth is slow", gt=0, lt=1)
    ] = 0.5
    comm_rise: Annotated[
        float, setting("communication wait over its baseline that asks for a check", gt=1)
    ] = 2.0
    min_comm_rise_s: Annotated[
        float, setting("least rise of the communication wait that counts", ge=0)
    ] = 0.002
    compute_flat: Annotated[
        float, setting("a compute rise beyond this factor explains the wait instead", gt=1)
    ] = 1.3
    recent_steps: Annotated[int, setting("steps the recent wait is taken over", ge=1)] = 5
    baseline_steps: Annotated[int, setting("steps a baseline holds (>= min_baseline_steps)")] = 200
    min_baseline_steps: Annotated[int, setting("steps a baseline needs", ge=1)] = 20
    max_unexplained: Annotated[
        int, setting("checks in a row that find nothing before a rise is the new baseline", ge=1)
    ] = 3
    reference_check: Annotated[bool, setting("run one check per job after warm-up")] = True
    size_bytes: Annotated[
        int | None, setting("bytes each pair exchanges", default_text="the probe's default")
    ] = None
    #: Exchanges per pair (the fastest counts: a busy host or a TCP window reopening
    #: after a congested spell slows one); more at world size 2, where one pair is all.
    repeats: Annotated[int, setting("exchanges per pair (the fastest counts)", ge=1)] = 2
    repeats_two_ranks: Annotated[int, setting("exchanges per pair at world size 2", ge=1)] = 3
    confirm_after_s: Annotated[
        float,
        setting(
            "time from a check that named a rank to the check that must name it again "
            "(longer than a busy host's burst of CPU contention)",
            ge=0,
        ),
    ] = 3.0

    def __post_init__(self) -> None:
        for name in (
            "min_interval_s",
            "recheck_s",
            "timeout_s",
            "min_comm_rise_s",
            "confirm_after_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 < self.slow_ratio < 1:
            raise ValueError(f"slow_ratio must be in (0, 1), got {self.slow_ratio}")
        for name in ("comm_rise", "compute_flat"):
            if not getattr(self, name) > 1:
                raise ValueError(f"{name} must be > 1, got {getattr(self, name)}")
        for name in (
            "recent_steps",
            "min_baseline_steps",
            "max_unexplained",
            "repeats",
            "repeats_two_ranks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.baseline_steps < self.min_baseline_steps:
            raise ValueError(
                f"baseline_steps ({self.baseline_steps}) must be >= min_baseline_steps "
                f"({self.min_baseline_steps})"
            )


class _Baseline:
    """A rank's baseline steps, the newest ``maxlen`` ``(comm_wait_s, compute_s)``, with
    their comm times also kept sorted in an array of doubles: the comm median, read for
    every rank twice a second (``_roll_baselines``, ``_comm_rose``), costs no sort.

    The median is ``statistics.median``'s, bit for bit: equal times keep their arrival
    order in the sorted array (as a stable sort keeps them) and the step that leaves is
    the oldest, the first of its equals. NaN, which orders against nothing, is only
    counted; while one is in the window the median sorts the window. The compute
    median is read only once communication rose, and sorts.
    """

    __slots__ = ("comm", "nan_comm", "steps")

    def __init__(self, maxlen: int) -> None:
        self.steps: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.comm = array("d")
        self.nan_comm = 0

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, new_steps: Iterable[tuple[float, float]]) -> None:
        steps, comm = self.steps, self.comm
        insort, bisect_left, isnan = bisect.insort_right, bisect.bisect_left, math.isnan
        for step in new_steps:
            if len(steps) == steps.maxlen:
                old_comm_s = steps[0][0]
                if isnan(old_comm_s):
                    self.nan_comm -= 1
                else:
                    del comm[bisect_left(comm, old_comm_s)]
            steps.append(step)
            comm_s = step[0]
            if isnan(comm_s):
                self.nan_comm += 1
            else:
                insort(comm, comm_s)

    def clear(self) -> None:
        self.steps.clear()
        del self.comm[:]
        self.nan_comm = 0

    def median_comm(self) -> float:
        if self.nan_comm:
            return _median_comm(self.steps)
        return _median_sorted(self.comm)

    def median_compute(self) -> float:
        return statistics.median(c for _, c in self.steps)


@dataclass(slots=True)
class _RankSteps:
    recent: deque[tuple[float, float]]
    older: deque[tuple[float, float]]
    baseline: _Baseline


@dataclass(slots=True)
class _Check:
    id: str
    sent_s: float
    reason: str
    results: dict[int, LinkCheckResult] = field(default_factory=dict)
    first_result_s: float | None = None


@dataclass(slots=True)
class _Job:
    world_size: int = 0
    ranks: dict[int, _RankSteps] = field(default_factory=dict)
    last_check_s: float = -math.inf
    last_triggered_s: float = -math.inf  # the last check a communication rise asked for
    checks: dict[str, _Check] = field(default_factory=dict)
    findings: dict[str, Finding] = field(default_factory=dict)
    healthy_pairs: dict[Pair, deque[float]] = field(default_factory=dict)
    healthy_node_pairs: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> its agent's node
    suspects: set[str] = field(default_factory=set)  # named once, awaiting confirmation
    last: Localization | None = None
    referenced: bool = False
    unexplained: int = 0
    rejections: int = 0


class LinkChecker:
    """Decides when each job needs a link check and turns results into findings.

    Not thread-safe: the aggregator's live state calls it from its event loop. Feed
    ``observe_step`` (hot path: appends only), ``observe_result``, ``command_done``;
    ask ``due`` for the jobs to check now, tell ``sent`` which command went out, and
    read ``active`` findings after ``evaluate``.
    """

    def __init__(self, settings: LinkCheckSettings | None = None) -> None:
        self.settings = settings or LinkCheckSettings()
        self._jobs: dict[str, _Job] = {}

    # -- feeding --------------------------------------------------------------------------
    def set_world(self, job: str, world_size: int) -> None:
        state = self._job(job)
        if state.world_size != world_size:
            state.world_size = world_size
            state.ranks.clear()

    def set_node(self, job: str, rank: int, node: str) -> None:
        """The node (its agent's ``--node``) that ``rank`` of ``job`` reports from; a
        check whose ranks share hosts names nodes by it."""
        self._job(job).nodes[rank] = node

    def observe_step(self, job: str, rank: int, comm_wait_s: float, compute_s: float) -> None:
        state = self._jobs.get(job)
        if state is None or not 0 <= rank < state.world_size:
            return
        steps = state.ranks.get(rank)
        if steps is None:
            steps = self._new_rank(state, rank)
        recent = steps.recent
        if len(recent) == recent.maxlen:
            steps.older.append(recent[0])
        recent.append((comm_wait_s, compute_s))

    def observe_steps(
        self, job: str, rank: int, comm_wait_s: Sequence[float], compute_s: Sequence[float]
    ) -> None:
        """``observe_step`` of each step of one rank's batch, in one call (ingest's hot path).

        Raises ValueError when the columns differ in length.
        """
        new = list(zip(comm_wait_s, compute_s, strict=True))
        state = self._jobs.get(job)
        if not new or state is None or not 0 <= rank < state.world_size:
            return
        steps = state.ranks.get(rank)
        if steps is None:
            steps = self._new_rank(state, rank)
        recent = steps.recent
        # The steps that the new ones push out of the recent window, oldest first.
        out = len(recent) + len(new) - self.settings.recent_steps
        if out > 0:
            steps.older.extend(itertools.islice(itertools.chain(recent, new), out))
        recent.extend(new)

    def observe_result(self, result: LinkCheckResult, now_s: float) -> None:
        """One rank's result; a check is read once every rank's result is in."""
        state = self._jobs.get(result.job)
        if state is None:
            return
        check = state.checks.get(result.id)
        if check is None:
            # A check someone asked for by hand: read its results all the same.
            check = state.checks[result.id] = _Check(result.id, now_s, "requested")
        check.results[result.rank] = result
        if check.first_result_s is None:
            check.first_result_s = now_s

    def command_done(self, job: str, check_id: str, status: str, now_s: float) -> None:
        """The probe's final answer to a link_check command (applied, rejected, expired).

        A job whose probe refused three checks in a row (no side group, a single
        rank) gets no more. A check that expired unanswered (a busy job, a slow relay) is
        no refusal: the next one waits its turn, but comes; else a slow link named before
        would stay named, its alert firing, long after the link recovered.
        """
        state = self._jobs.get(job)
        if state is None or status == "applied":
            return
        check = state.checks.pop(check_id, None)
        if check is not None and not check.results:
            state.last_check_s = state.last_triggered_s = now_s
            if status == "rejected":
                state.rejections += 1
            if check.reason == "reference":
                state.referenced = False

    # -- decisions ------------------------------------------------------------------------
    def due(self, now_s: float) -> list[tuple[str, str]]:
        """Jobs that need a check now, with the reason; call ``sent`` for each one sent."""
        out = []
        for name, state in self._jobs.items():
            reason = self._reason(state, now_s)
            if reason is not None:
                out.append((name, reason))
        return out

    def sent(self, job: str, check_id: str, reason: str, now_s: float) -> None:
        state = self._job(job)
        state.checks[check_id] = _Check(check_id, now_s, reason)
        state.last_check_s = now_s
        if reason not in ("reference", "recheck", "requested"):
            state.last_triggered_s = now_s
        if reason == "reference":
            state.referenced = True

    def check_args(self, job: str) -> dict[str, object]:
        """Arguments of the link_check command the service sends to ``job``."""
        args: dict[str, object] = {}
        if self.settings.size_bytes is not None:
            args["size_bytes"] = self.settings.size_bytes
        state = self._jobs.get(job)
        # One pair carries the whole reading at two ranks, or two nodes (their representatives).
        two = state is not None and (state.world_size == 2 or len(set(state.nodes.values())) == 2)
        repeats = self.settings.repeats_two_ranks if two else self.settings.repeats
        if repeats > 1:
            args["repeats"] = repeats
        return args

    def evaluate(self, now_s: float) -> None:
        """Read every check whose results are all in, or that waited ``timeout_s``."""
        for name, state in self._jobs.items():
            for check in list(state.checks.values()):
                complete = len(check.results) >= state.world_size > 0
                waited = now_s - (check.first_result_s or check.sent_s)
                if complete or waited > self.settings.timeout_s:
                    del state.checks[check.id]
                    if check.results:
                        self._read(name, state, check, now_s)

    def active(self) -> list[Finding]:
        return [f for state in self._jobs.values() for f in state.findings.values()]

    def last(self, job: str) -> Localization | None:
        """The latest check's reading for ``job``."""
        state = self._jobs.get(job)
        return None if state is None else state.last

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)

    # -- internals ------------------------------------------------------------------------
    def _new_rank(self, state: _Job, rank: int) -> _RankSteps:
        s = self.settings
        steps = state.ranks[rank] = _RankSteps(
            deque(maxlen=s.recent_steps),
            deque(maxlen=s.baseline_steps),
            _Baseline(s.baseline_steps),
        )
        return steps

    def _job(self, name: str) -> _Job:
        state = self._jobs.get(name)
        if state is None:
            state = self._jobs[name] = _Job()
        return state

    def _reason(self, state: _Job, now_s: float) -> str | None:
        s = self.settings
        self._roll_baselines(state)
        if state.world_size < 2 or state.checks or state.rejections >= 3:
            return None
        if state.findings:
            return "recheck" if now_s - state.last_check_s >= s.recheck_s else None
        if state.suspects:
            return "confirm" if now_s - state.last_check_s >= s.confirm_after_s else None
        if s.reference_check and not state.referenced and self._warm(state):
            # Behind the rate limit too: a refused reference check is not retried at once.
            return "reference" if now_s - state.last_check_s >= s.min_interval_s else None
        if now_s - state.last_triggered_s < s.min_interval_s:
            return None
        if self._comm_rose(state):
            return "communication rose while compute did not"
        return None

    def _warm(self, state: _Job) -> bool:
        need = self.settings.min_baseline_steps
        ready = [r for r in state.ranks.values() if len(r.baseline) >= need]
        return len(ready) == state.world_size

    def _roll_baselines(self, state: _Job) -> None:
        """Move steps out of the recent window into the baseline, leaving elevated ones out."""
        s = self.settings
        for steps in state.ranks.values():
            if not steps.older:
                continue
            baseline = steps.baseline
            if len(baseline) < s.min_baseline_steps:
                baseline.extend(steps.older)
            else:
                limit_s = s.comm_rise * baseline.median_comm() + s.min_comm_rise_s
                baseline.extend(step for step in steps.older if step[0] <= limit_s)
            steps.older.clear()

    def _comm_rose(self, state: _Job) -> bool:
        s = self.settings
        ready, rises = [], []
        for steps in state.ranks.values():
            if len(steps.baseline) < s.min_baseline_steps or len(steps.recent) < s.recent_steps:
                continue
            base_comm = steps.baseline.median_comm()
            comm = _median_comm(steps.recent)
            rises.append((comm - base_comm, comm / base_comm if base_comm > 0 else math.inf))
            ready.append(steps)
        if 2 * len(rises) < state.world_size or not rises:
            return False
        delta = statistics.median(d for d, _ in rises)
        ratio = statistics.median(r for _, r in rises)
        if not (ratio >= s.comm_rise and delta >= s.min_comm_rise_s):  # NaN: no rise
            return False
        # Compute is read only now, once communication rose: the rare case.
        # A compute rise explains the wait when it is large in both senses: a factor
        # (a straggler's peers wait for it) and seconds, at least half the wait's rise.
        # A slow link raised every rank's compute 1.2-1.6x as well (3 ranks at 100
        # Mbit/s, a few ms on a 48 ms rise of the wait), and the factor alone kept
        # every check away while the link stayed slow.
        for steps in ready:
            base_compute = steps.baseline.median_compute()
            compute = statistics.median(c for _, c in steps.recent)
            ratio = compute / base_compute if base_compute > 0 else 1.0
            if ratio >= s.compute_flat and compute - base_compute >= delta / 2:
                return False
        return True

    def _read(self, job: str, state: _Job, check: _Check, now_s: float) -> None:
        pairs = pair_bandwidths(check.results.values())
        bounds = pair_link_bounds(check.results.values())
        hosts = hosts_of(check.results.values())
        if hosts is not None:
            reading, named = self._read_nodes(state, hosts, pairs, bounds)
        else:
            reference = {p: statistics.median(v) for p, v in state.healthy_pairs.items() if v}
            reading = localize(
                state.world_size,
                pairs,
                slow_ratio=self.settings.slow_ratio,
                reference_pair=reference,
                bounds=bounds,
            )
            if not reading.slow and not reading.contended:
                for pair, bandwidth in pairs.items():
                    state.healthy_pairs.setdefault(pair, deque(maxlen=5)).append(bandwidth)
            two = state.world_size == 2 and reading.slow
            named = ["0-1"] if two else [str(r) for r in reading.slow]
        state.last = replace(reading, duration_s=max(r.duration_s for r in check.results.values()))
        state.rejections = 0
        step = max((r.step for r in check.results.values()), default=0)
        # A naming stands only when the next check, confirm_after_s later, names the
        # same: a busy host slows every pair of its ranks for a burst, and a timing
        # prompt (communication rose) comes with such bursts as well as with a slow link.
        findings, suspects = {}, set()
        for label in named:
            if label in state.findings or label in state.suspects:
                if label.startswith("node:"):
                    findings[label] = self._node_finding(job, state, reading, label, check, step)
                elif label == "0-1":
                    findings[label] = self._pair_finding(job, state, reading, check, step)
                else:
                    findings[label] = self._rank_finding(
                        job, state, reading, int(label), check, step
                    )
            else:
                suspects.add(label)
        state.findings, state.suspects = findings, suspects
        if findings or suspects or check.reason == "reference":
            state.unexplained = 0
        elif check.reason not in ("recheck", "confirm"):
            state.unexplained += 1
            if state.unexplained >= self.settings.max_unexplained:
                # The rise is no slow link: take it as the job's new normal.
                for steps in state.ranks.values():
                    steps.baseline.clear()
                state.unexplained = 0

    def _read_nodes(
        self,
        state: _Job,
        hosts: dict[int, str],
        pairs: dict[Pair, float],
        bounds: dict[Pair, float],
    ) -> tuple[Localization, list[str]]:
        """A check of ranks sharing hosts, read node by node: the reading and the labels
        it names (``node:<name>``, or ``node:<a>-<b>`` at two nodes)."""
        nodes = _node_names(hosts, state.nodes)
        reference = {p: statistics.median(v) for p, v in state.healthy_node_pairs.items() if v}
        reading = localize_nodes(
            nodes,
            pairs,
            slow_ratio=self.settings.slow_ratio,
            reference_pair=reference,
            bounds=bounds,
        )
        by_node = reading.nodes
        if by_node is None:  # localize_nodes always reads nodes
            raise RuntimeError("localize_nodes returned no node reading")
        if not by_node.slow and not by_node.contended:
            for pair, bandwidth in by_node.pairs.items():
                state.healthy_node_pairs.setdefault(pair, deque(maxlen=5)).append(bandwidth)
        if len(by_node.ranks) == 2 and by_node.slow:
            named = ["node:" + "-".join(by_node.slow)]
        else:
            named = [f"node:{name}" for name in by_node.slow]
        return reading, named

    def _node_finding(
        self,
        job: str,
        state: _Job,
        reading: Localization,
        label: str,
        check: _Check,
        step: int,
    ) -> Finding:
        by_node = reading.nodes
        if by_node is None:
            raise RuntimeError(f"a node finding from a reading without nodes: {label}")
        name = label.removeprefix("node:")
        previous = state.findings.get(label)
        reference = by_node.reference_bytes_per_s or 0.0
        others = ", ".join(
            f"{n} {_rate(bw)}" for n, bw in by_node.bandwidth_by_node.items() if n != name
        )
        if name in by_node.bandwidth_by_node:
            bandwidth = by_node.bandwidth_by_node[name]
            where = f"at node {name}"
            measured = (
                f"its link to the other nodes reaches {_rate(bandwidth)}, "
                f"{bandwidth / reference:.2f}x the median node's {_rate(reference)} ({others})"
            )
        else:
            a, b = by_node.slow
            bandwidth = by_node.pairs.get((a, b), 0.0)
            where = f"between node {a} and node {b}"
            measured = (
                f"{_rate(bandwidth)}, {bandwidth / reference:.2f}x the {_rate(reference)} "
                "it reached before; with two nodes a pairwise test cannot tell which end is "
                "at fault"
            )
        return Finding(
            kind="slow_link",
            labels={"job": job, "node": name},
            value=bandwidth,
            score=bandwidth / reference if reference > 0 else 0.0,
            summary=(
                f"Slow network link {where} of job {job}: {measured} "
                f"(link check {check.id} at step {step})"
            ),
            since_unix_s=previous.since_unix_s if previous is not None else check.sent_s,
            recommendation=RECOMMENDATION,
            severity="high",
            details=self._details(reading, check, step),
        )

    def _details(self, reading: Localization, check: _Check, step: int) -> dict[str, object]:
        if reading.nodes is not None:
            return {
                "check_id": check.id,
                "step": step,
                "reason": check.reason,
                **node_details(reading.nodes),
            }
        return {
            "check_id": check.id,
            "step": step,
            "reason": check.reason,
            "reference_bytes_per_s": reading.reference_bytes_per_s,
            "bandwidth_by_rank": {
                str(r): bw for r, bw in sorted(reading.bandwidth_by_rank.items())
            },
            "pairs": {f"{a}-{b}": bw for (a, b), bw in sorted(reading.pairs.items())},
        }

    def _rank_finding(
        self,
        job: str,
        state: _Job,
        reading: Localization,
        rank: int,
        check: _Check,
        step: int,
    ) -> Finding:
        bandwidth = reading.bandwidth_by_rank[rank]
        reference = reading.reference_bytes_per_s or 0.0
        previous = state.findings.get(str(rank))
        return Finding(
            kind="slow_link",
            labels={"job": job, "rank": str(rank)},
            value=bandwidth,
            score=bandwidth / reference if reference > 0 else 0.0,
            summary=(
                f"Slow network link at rank {rank} of job {job}: its pairs reach "
                f"{_rate(bandwidth)}, {bandwidth / reference:.2f}x the median rank's "
                f"{_rate(reference)} (link check {check.id} at step {step})"
            ),
            since_unix_s=previous.since_unix_s if previous is not None else check.sent_s,
            recommendation=RECOMMENDATION,
            severity="high",
            details=self._details(reading, check, step),
        )

    def _pair_finding(
        self, job: str, state: _Job, reading: Localization, check: _Check, step: int
    ) -> Finding:
        bandwidth = reading.pairs[(0, 1)]
        reference = reading.reference_bytes_per_s or 0.0
        previous = state.findings.get("0-1")
        return Finding(
            kind="slow_link",
            labels={"job": job, "rank": "0-1"},
            value=bandwidth,
            score=bandwidth / reference if reference > 0 else 0.0,
            summary=(
                f"Slow network link between rank 0 and rank 1 of job {job}: "
                f"{_rate(bandwidth)}, {bandwidth / reference:.2f}x the {_rate(reference)} "
                f"it reached before (link check {check.id} at step {step}); with two ranks "
                "a pairwise test cannot tell which end is at fault"
            ),
            since_unix_s=previous.since_unix_s if previous is not None else check.sent_s,
            recommendation=RECOMMENDATION,
            severity="high",
            details=self._details(reading, check, step),
        )


def reading_json(reading: Localization) -> dict[str, object]:
    """A check's reading as JSON (bandwidths in bytes/s), for the API's report."""
    out: dict[str, object] = {
        "duration_s": reading.duration_s,
        "reference_bytes_per_s": reading.reference_bytes_per_s,
        "slow_ranks": list(reading.slow),
        "contended_ranks": list(reading.contended),
        "bandwidth_by_rank": {str(r): bw for r, bw in sorted(reading.bandwidth_by_rank.items())},
        "pairs": {f"{a}-{b}": bw for (a, b), bw in sorted(reading.pairs.items())},
    }
    if reading.nodes is not None:
        out["nodes"] = node_details(reading.nodes)
    return out


def node_details(reading: NodeReading) -> dict[str, object]:
    """A node reading as JSON: bandwidth (bytes/s) per node and node pair, the pairs
    within each node apart, each node's ranks."""
    return {
        "reference_bytes_per_s": reading.reference_bytes_per_s,
        "slow_nodes": list(reading.slow),
        "contended_nodes": list(reading.contended),
        "bandwidth_by_node": dict(reading.bandwidth_by_node),
        "node_pairs": {f"{a}-{b}": bw for (a, b), bw in reading.pairs.items()},
        "intra_node_pairs": {
            node: {f"{a}-{b}": bw for (a, b), bw in sorted(pairs.items())}
            for node, pairs in reading.intra.items()
        },
        "ranks_by_node": {node: list(ranks) for node, ranks in reading.ranks.items()},
    }


def _node_names(hosts: dict[int, str], agent_nodes: dict[int, str]) -> dict[int, str]:
    """Each rank's node name: its agent's node when the hosts' lowest ranks name
    distinct ones (the usual case: one agent per host), else its host key."""
    lowest: dict[str, int] = {}
    for rank in sorted(hosts):
        lowest.setdefault(hosts[rank], rank)
    names = {host: agent_nodes.get(rank, "") for host, rank in lowest.items()}
    if "" in names.values() or len(set(names.values())) < len(names):
        names = {host: host for host in lowest}
    return {rank: names[host] for rank, host in hosts.items()}


def _median_comm(steps: Iterable[tuple[float, float]]) -> float:
    return statistics.median(c for c, _ in steps)


def _median_sorted(values: array[float]) -> float:
    """``statistics.median`` of values already sorted."""
    n = len(values)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    if n % 2 == 1:
        return values[n // 2]
    i = n // 2
    return (values[i - 1] + values[i]) / 2


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:.0f} Mbit/s"
