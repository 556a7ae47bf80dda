"""Scoring of the detection benchmark: which alerts of a run were right, which excused,
which false, per injected fault (an *episode*); pure, so tests feed it made-up timelines.

An episode is one fault injected at one magnitude, on one rank (or job-wide). It is
**acting** from its onset, less one step period of its job (``Episode.step_period_s``:
the onset is read on the faulted rank's clock, the alert on the aggregator's), to its
end plus a short grace of its kind (``grace_s``; ``GRACE``: 5 step periods for a
straggler or a regression, 2 s for a loss jump, 5 s for a hang or a slow link, 15 s for
a memory leak, whose rule needs a 10 s rate and 5 s of it). An on/off straggler acts
from its first slow period to its last, the normal steps between included.

Each alert that fired is, in this order:

- **right**: a rule of the kind's ``EXPECTED`` rules fired while an episode acted *on
  the rank it names* (any rank, or none, for a job-wide fault). It is right for that
  episode only: never for another episode of another rank, nor for an episode of its
  rank that stopped acting (past its grace);
- **symptom**: a ``SYMPTOMS`` rule (job-wide rules: the job did get slower) inside an
  episode's symptom window (acting, or up to ``SYMPTOM_GRACE_S`` after), or a
  ``RANK_SYMPTOMS`` rule naming the rank of an episode acting on it: excused, counted
  apart;
- **false**: anything else. A Straggler alert naming a rank no episode acts on is
  false wherever other episodes are; inside an acting episode's window it is that
  episode's **wrong rank** alert (a false alert, and the episode is not named right).

An episode is **detected** when a right alert fired for it; its latency is the first
one's, never clamped: in seconds from the onset (at least minus one step period) and in
steps counted on the job's own clock (the alert's ``first_step`` - onset + 1: 0 for an
alert within the step before the onset). Its **coverage** is the share of the time the
fault was acting (its on periods) during which an alert right for it, or for an earlier
fault of its rank and still firing, was firing (the summary counts an episode never
detected as 0), and its **coverage after the alert** the same share from its first
right alert on.

**precision_runs** counts units, not alerts: each episode is a unit (true if detected
with no false alert in its window, false if any false alert fired in its window), and so
is each stretch without a fault: a clean job, a tuning session, and the healthy steps
around a fault job's episodes (false if any alert fired there). precision_runs = true /
(true + false).

The magnitude an episode is scored at is ``Episode.measured`` where the job's steps
gave one (a straggler: the median over its slow steps of the slow rank's compute over
its peers' median, ``measured_ratio``), the knob's value otherwise.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

#: The rules that must catch each kind.
EXPECTED: dict[str, tuple[str, ...]] = {
    "straggler": ("Straggler",),
    "regression": ("Step Time Anomaly",),
    "hang": ("Hung Collective",),
    "memory-leak": ("Memory Leak",),
    "loss-spike": ("Loss Spike", "Non-finite Loss"),
    "slow-link": ("Slow Link",),
}
#: Job-wide rules a fault of the kind legitimately fires as well: the job did get slower.
SYMPTOMS: dict[str, tuple[str, ...]] = {
    "straggler": ("Step Time Anomaly", "High Communication Overhead"),
    "regression": ("High Communication Overhead",),
    "hang": ("Step Time Anomaly", "High Communication Overhead"),
    "memory-leak": ("Step Time Anomaly",),
    "loss-spike": (),
    "slow-link": ("Step Time Anomaly", "High Communication Overhead"),
}
#: Rules a fault of the kind legitimately fires while it acts, when they name the faulted
#: rank. A leak of a few MB a step makes the leaking rank compute slower in the
#: benchmark's small model (page faults on fresh memory): it is a straggler.
RANK_SYMPTOMS: dict[str, tuple[str, ...]] = {"memory-leak": ("Straggler",)}

#: Grace after a fault ends, per kind: (step periods, seconds); the larger holds. A
#: straggler's or regression's detector judges steps, so its alert comes within a few
#: steps of the data or is late; a hang is recorded when the hung step completes (the
#: hang timeout is at most 5 s); a slow link is confirmed by a second check 3 s after
#: the first; Memory Leak needs a 10 s rate and 5 s of it; Non-finite Loss and Loss
#: Spike fire on an evaluation (every 0.5 s) of a few steps.
GRACE: Final[dict[str, tuple[int, float]]] = {
    "straggler": (5, 0.0),
    "regression": (5, 0.0),
    "loss-spike": (5, 2.0),
    "hang": (0, 5.0),
    "slow-link": (0, 5.0),
    "memory-leak": (0, 15.0),
}
#: Seconds after a fault ends in which its job-wide symptoms (``SYMPTOMS``) are still
#: excused: Step Time Anomaly judges a second of steps and clears after in-band ones.
#: They name no rank; an alert naming one never gets this grace.
SYMPTOM_GRACE_S: Final = 10.0
#: Onset slack in step periods: the onset is read on the faulted rank's clock and the
#: alert on the aggregator's; an alert fired earlier than this before it is false.
ONSET_SLACK_STEPS: Final = 1


def straggler_in_scope(ratio: float, world_size: int) -> bool:
    """Whether a straggler this many times slower is one the targets promise to name:
    from 1.2x at 3 ranks and more, from 1.3x at 2 (issue 19)."""
    return ratio >= (1.2 if world_size >= 3 else 1.3)


def grace_s(kind: str, step_period_s: float) -> float:
    """Seconds after the end of a fault of ``kind`` in which it still acts (``GRACE``)."""
    steps, seconds = GRACE[kind]
    return max(steps * step_period_s, seconds)


@dataclass(frozen=True, slots=True)
class Episode:
    """One fault at one magnitude; times in Unix seconds.

    ``on_periods`` are the spans the fault was acting (several for an on/off straggler);
    ``rank`` is None for a job-wide fault; ``in_scope``: the magnitude is one the
    targets promise to catch (out-of-scope episodes are reported, not counted in recall);
    ``step_period_s``: the job's median step period (onset slack, grace in steps);
    ``measured``: the fault as the job's steps show it (None: not measured).
    """

    kind: str
    label: str
    magnitude: float
    rank: int | None
    onset_step: int
    on_periods: tuple[tuple[float, float], ...]
    in_scope: bool = True
    step_period_s: float = 0.0
    measured: float | None = None

    @property
    def start_unix_s(self) -> float:
        return min(start for start, _ in self.on_periods)

    @property
    def end_unix_s(self) -> float:
        return max(end for _, end in self.on_periods)

    @property
    def slack_s(self) -> float:
        return ONSET_SLACK_STEPS * self.step_period_s

    @property
    def scored_magnitude(self) -> float:
        """The magnitude scored: the measured one where there is one."""
        return self.measured if self.measured is not None else self.magnitude

    def acting(self, t_unix_s: float) -> bool:
        """Whether the fault acts at ``t``: onset - slack .. end + its kind's grace."""
        end = self.end_unix_s + grace_s(self.kind, self.step_period_s)
        return self.start_unix_s - self.slack_s <= t_unix_s <= end

    def in_symptom_window(self, t_unix_s: float) -> bool:
        """Acting, or within ``SYMPTOM_GRACE_S`` after (job-wide symptoms only)."""
        end = self.end_unix_s + max(SYMPTOM_GRACE_S, grace_s(self.kind, self.step_period_s))
        return self.start_unix_s - self.slack_s <= t_unix_s <= end


@dataclass(frozen=True, slots=True)
class FiredAlert:
    """An alert episode that fired: ``first_step`` is the last step the job had finished
    when the alert fired, on the job's own clock (``steps.end_unix_ns``; None if
    unknown): the steps it ran before anyone could be told, transport included."""

    rule: str
    rank: int | None
    fired_at_unix_s: float
    ends_at_unix_s: float | None = None
    first_step: int | None = None

    @property
    def name(self) -> str:
        return self.rule + (f" (rank {self.rank})" if self.rank is not None else "")


@dataclass(slots=True)
class EpisodeScore:
    episode: Episode
    right: list[FiredAlert] = field(default_factory=list)
    wrong_rank: list[FiredAlert] = field(default_factory=list)
    symptoms: list[FiredAlert] = field(default_factory=list)
    false: list[FiredAlert] = field(default_factory=list)
    coverage: float | None = None
    coverage_after_alert: float | None = None

    @property
    def detected(self) -> bool:
        return bool(self.right)

    @property
    def first(self) -> FiredAlert | None:
        return min(self.right, key=lambda a: a.fired_at_unix_s) if self.right else None

    @property
    def latency_s(self) -> float | None:
        first = self.first
        return None if first is None else first.fired_at_unix_s - self.episode.start_unix_s

    @property
    def latency_steps(self) -> int | None:
        """Steps of the fault the job had finished when its first right alert fired,
        counting the onset step (never clamped: 0 is an alert in the step before)."""
        first = self.first
        if first is None or first.first_step is None:
            return None
        return first.first_step - self.episode.onset_step + 1

    @property
    def named(self) -> bool | None:
        """For a fault with a rank that an expected rule answered: only the right rank."""
        if self.episode.rank is None or not (self.right or self.wrong_rank):
            return None
        return bool(self.right) and not self.wrong_rank

    @property
    def precise(self) -> bool:
        return not (self.false or self.wrong_rank)


@dataclass(slots=True)
class RunScore:
    """A job's episodes and the false alerts outside every window (its healthy steps)."""

    episodes: list[EpisodeScore]
    outside: list[FiredAlert] = field(default_factory=list)


def score_run(
    episodes: Sequence[Episode], alerts: Iterable[FiredAlert], *, run_end_unix_s: float
) -> RunScore:
    """Sort each fired alert into an episode's right, wrong-rank, symptom or false ones,
    or the run's false ones outside every window; then each episode's coverage."""
    scores = [EpisodeScore(e) for e in episodes]
    run = RunScore(scores)
    alerts = sorted(alerts, key=lambda a: a.fired_at_unix_s)
    for alert in alerts:
        _place(alert, scores, run)
    placed = [a for s in scores for a in s.right]
    for score in scores:
        # An alert right for an episode covers any episode of its rule and rank while it
        # fires: one right for an earlier fault of the rank, still firing, covers this
        # one. A false one (fired before any fault) covers nothing.
        ep = score.episode
        right = [a for a in placed if a.rule in EXPECTED[ep.kind] and ep.rank in (None, a.rank)]
        score.coverage = coverage(ep.on_periods, right, run_end_unix_s)
        first = score.first
        if first is not None and score.coverage is not None:
            t0 = first.fired_at_unix_s
            after = [(max(start, t0), end) for start, end in ep.on_periods if end > t0]
            score.coverage_after_alert = coverage(after, right, run_end_unix_s)
    return run


def _right_for(alert: FiredAlert, ep: Episode) -> bool:
    return (
        alert.rule in EXPECTED[ep.kind]
        and (ep.rank is None or alert.rank == ep.rank)
        and ep.acting(alert.fired_at_unix_s)
    )


def _latest(scores: Iterable[EpisodeScore]) -> EpisodeScore | None:
    return max(scores, key=lambda s: s.episode.start_unix_s, default=None)


def _place(alert: FiredAlert, scores: list[EpisodeScore], run: RunScore) -> None:
    """Right for the episode acting on the alert's rank (the latest-started if two
    windows meet), else a symptom, else false (module docstring)."""
    t = alert.fired_at_unix_s
    right = _latest(s for s in scores if _right_for(alert, s.episode))
    if right is not None:
        right.right.append(alert)
        return
    symptom = _latest(
        s
        for s in scores
        if (alert.rule in SYMPTOMS[s.episode.kind] and s.episode.in_symptom_window(t))
        or (
            alert.rule in RANK_SYMPTOMS.get(s.episode.kind, ())
            and alert.rank == s.episode.rank
            and s.episode.acting(t)
        )
    )
    if symptom is not None:
        symptom.symptoms.append(alert)
        return
    # False. Filed with the episode acting then, a wrong naming of it if its rule; else
    # with the latest whose symptom window holds it; else the job's healthy steps.
    acting = _latest(s for s in scores if s.episode.acting(t))
    if acting is not None and alert.rule in EXPECTED[acting.episode.kind]:
        acting.wrong_rank.append(alert)
        return
    near = acting or _latest(s for s in scores if s.episode.in_symptom_window(t))
    if near is not None:
        near.false.append(alert)
    else:
        run.outside.append(alert)


def coverage(
    on_periods: Sequence[tuple[float, float]],
    alerts: Sequence[FiredAlert],
    run_end_unix_s: float,
) -> float | None:
    """The share of the fault's acting time during which one of ``alerts`` was firing
    (an alert never resolved fires to ``run_end_unix_s``)."""
    total = sum(max(0.0, end - start) for start, end in on_periods)
    if total <= 0:
        return None
    firing = _union(
        (a.fired_at_unix_s, a.ends_at_unix_s if a.ends_at_unix_s is not None else run_end_unix_s)
        for a in alerts
    )
    covered = 0.0
    for start, end in on_periods:
        for f_start, f_end in firing:
            covered += max(0.0, min(end, f_end) - max(start, f_start))
    return covered / total


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def measured_ratio(rows: Iterable[Sequence[Any]], rank: int, steps: Iterable[int]) -> float | None:
    """A straggler as the job's steps show it: over ``steps``, the median of the slow
    rank's compute over the median of its peers' compute in the same step. ``rows``
    are (rank, step, compute_s) first; None where no step has both."""
    wanted = set(steps)
    by_step: dict[int, dict[int, float]] = {}
    for row in rows:
        r, step, compute = row[0], row[1], row[2]
        if step in wanted and compute is not None and compute > 0:
            by_step.setdefault(int(step), {})[int(r)] = float(compute)
    ratios = []
    for by_rank in by_step.values():
        peers = [v for r, v in by_rank.items() if r != rank]
        if rank in by_rank and peers:
            ratios.append(by_rank[rank] / statistics.median(peers))
    return float(statistics.median(ratios)) if ratios else None


@dataclass(frozen=True, slots=True)
class KindLatency:
    """Latency of the detected in-scope episodes of one kind."""

    episodes: int
    detected: int
    median_steps: float | None
    worst_steps: int | None
    median_s: float | None
    worst_s: float | None

    def as_json(self) -> dict[str, float | int | None]:
        return {
            "episodes": self.episodes,
            "detected": self.detected,
            "median_latency_steps": self.median_steps,
            "worst_latency_steps": self.worst_steps,
            "median_latency_s": self.median_s,
            "worst_latency_s": self.worst_s,
        }


@dataclass(frozen=True, slots=True)
class Summary:
    """The figures over all scored runs; ``clean_jobs`` and ``tuning_jobs`` are the alerts
    of each fault-free job (every alert there is false)."""

    recall: float | None
    recall_all: float | None
    attribution: float | None
    precision_runs: float | None
    median_latency_steps: float | None
    median_latency_s: float | None
    worst_latency_s: float | None
    coverage_median: float | None
    coverage_median_all: float | None
    coverage_after_alert_median: float | None
    true_units: int
    false_units: int
    latency_by_kind: dict[str, KindLatency] = field(default_factory=dict)


def kind_latency(scores: Sequence[EpisodeScore]) -> KindLatency:
    detected = [s for s in scores if s.detected]
    steps = [s.latency_steps for s in detected if s.latency_steps is not None]
    secs = [s.latency_s for s in detected if s.latency_s is not None]
    return KindLatency(
        episodes=len(scores),
        detected=len(detected),
        median_steps=median(steps),
        worst_steps=max(steps) if steps else None,
        median_s=median(secs),
        worst_s=max(secs) if secs else None,
    )


def summarize(
    runs: Sequence[RunScore],
    clean_jobs: Sequence[Sequence[FiredAlert]],
    tuning_jobs: Sequence[Sequence[FiredAlert]],
    *,
    coverage_kinds: tuple[str, ...] = ("straggler",),
) -> Summary:
    """Recall, attribution and latency over in-scope episodes (``recall_all``: every
    episode; latency pooled and per kind); precision over units (module docstring);
    ``coverage_median`` over the in-scope episodes of ``coverage_kinds``, a missed one
    counting 0."""
    episodes = [s for r in runs for s in r.episodes]
    scoped = [s for s in episodes if s.episode.in_scope]
    detected = [s for s in scoped if s.detected]
    answered = [s for s in scoped if s.named is not None]
    latencies_s = [s.latency_s for s in detected if s.latency_s is not None]
    true_units = sum(1 for s in episodes if s.detected and s.precise)
    false_units = (
        sum(1 for s in episodes if not s.precise)
        + sum(1 for r in runs if r.outside)
        + sum(1 for job in (*clean_jobs, *tuning_jobs) if job)
    )

    def covered(score: EpisodeScore) -> float | None:
        if score.coverage is None:
            return None
        return score.coverage if score.detected else 0.0

    after = [
        s.coverage_after_alert
        for s in detected
        if s.coverage_after_alert is not None and s.episode.kind in coverage_kinds
    ]
    kinds = sorted({s.episode.kind for s in scoped})
    return Summary(
        recall=_share(len(detected), len(scoped)),
        recall_all=_share(sum(s.detected for s in episodes), len(episodes)),
        attribution=_share(sum(s.named is True for s in answered), len(answered)),
        precision_runs=_share(true_units, true_units + false_units),
        median_latency_steps=median([s.latency_steps for s in detected]),
        median_latency_s=median(latencies_s),
        worst_latency_s=max(latencies_s) if latencies_s else None,
        coverage_median=median([covered(s) for s in scoped if s.episode.kind in coverage_kinds]),
        coverage_median_all=median([covered(s) for s in scoped]),
        coverage_after_alert_median=median(after),
        true_units=true_units,
        false_units=false_units,
        latency_by_kind={
            k: kind_latency([s for s in scoped if s.episode.kind == k]) for k in kinds
        },
    )


def min_magnitude_detected(scores: Sequence[EpisodeScore]) -> float | None:
    """The smallest scored magnitude (measured where measured) from which on every
    episode (every seed, every mode) was detected and named the right rank; None if not
    even the largest was."""
    best: float | None = None
    for magnitude in sorted({s.episode.scored_magnitude for s in scores}, reverse=True):
        at = [s for s in scores if s.episode.scored_magnitude == magnitude]
        if not all(s.detected and s.named is not False for s in at):
            break
        best = magnitude
    return best


def median(values: Iterable[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None
