"""One run (launch) of a job as the live state sees it: its records and its detectors.

Two launches of one job name can run at once (a relaunch while the first still
trains, two demos): each is judged, alerted and exported on its own, so each run has
its own detectors, its series carry its ``run`` label and its findings name it.
``LiveState`` keys its runs by (job, run id) and routes each batch by its session.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.hang import HangDetector, HangSettings
from torshmon.aggregator.core.linkcheck import LinkChecker, LinkCheckSettings
from torshmon.aggregator.core.rank_state import JobState, RankState
from torshmon.aggregator.core.step_time import StepTimeDetector
from torshmon.aggregator.core.straggler import StragglerDetector, StragglerSettings
from torshmon.aggregator.core.zscore import ZScoreDetector, ZScoreSettings

#: A run's key in the live state: (job name, run id; "" where the probes sent none).
RunKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """The settings every run's detectors are built with (None: their defaults)."""

    straggler: StragglerSettings | None = None
    zscore: ZScoreSettings | None = None
    hang: HangSettings | None = None
    link_check: LinkCheckSettings | None = None


@dataclass(slots=True)
class RunState:
    """A run's records (``state``), detectors and latest bottleneck report.

    The detectors are keyed by job name inside, as each holds this run only."""

    job: str
    run_id: str
    state: JobState
    step_z: StepTimeDetector
    loss_z: ZScoreDetector
    comm_z: ZScoreDetector
    throughput_z: ZScoreDetector
    straggler: StragglerDetector
    hang: HangDetector
    links: LinkChecker
    #: The run's report as of the last ``LiveState.findings()``.
    report: list[Finding] = field(default_factory=list)
    #: Since when each bottleneck of the report has held (the report is recomputed).
    bottleneck_since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(
        default_factory=dict
    )

    @classmethod
    def new(cls, job: str, run_id: str, settings: DetectorSettings) -> RunState:
        zscore = settings.zscore
        return cls(
            job=job,
            run_id=run_id,
            state=JobState(labels=run_labels(job, run_id), run_id=run_id),
            step_z=StepTimeDetector(zscore),
            loss_z=ZScoreDetector(zscore, metric="loss", direction="up"),
            comm_z=ZScoreDetector(zscore, metric="comm_wait_seconds", direction="up"),
            throughput_z=ZScoreDetector(
                zscore, metric="throughput_samples_per_second", direction="down"
            ),
            straggler=StragglerDetector(settings.straggler),
            hang=HangDetector(settings.hang),
            links=LinkChecker(settings.link_check),
        )

    @property
    def key(self) -> RunKey:
        return (self.job, self.run_id)

    def rank(self, number: int) -> RankState:
        """Rank ``number``'s record, made at its first mention."""
        ranks = self.state.ranks
        state = ranks.get(number)
        if state is None:
            labels = run_labels(self.job, self.run_id, rank=number)
            state = ranks[number] = RankState(labels=labels)
        return state

    def anomalies(self) -> list[Finding]:
        """The active z-score findings, this run's label not yet on them."""
        return (
            self.step_z.active()
            + self.loss_z.active()
            + self.comm_z.active()
            + self.throughput_z.active()
        )

    def forget(self) -> None:
        """Drop every detector's state (the run ended)."""
        detectors = (self.step_z, self.loss_z, self.comm_z, self.throughput_z)
        for detector in (*detectors, self.straggler, self.hang, self.links):
            detector.forget(self.job)

    def stamped(self, findings: list[Finding]) -> list[Finding]:
        """``findings`` labelled ``run`` with this run (where it has an id): its
        episode, alerts and history rows are this run's."""
        return [self.of_run(f) for f in findings]

    def of_run(self, finding: Finding) -> Finding:
        if not self.run_id or finding.labels.get("run") == self.run_id:
            return finding
        return dataclasses.replace(finding, labels={**finding.labels, "run": self.run_id})


def run_labels(job: str, run_id: str, *, rank: int | None = None) -> tuple[tuple[str, str], ...]:
    """The sorted series labels of a run (and of one of its ranks): ``run`` only where
    the probes sent a run id, so a job without one keeps the labels it always had."""
    labels = [("job", job)]
    if rank is not None:
        labels.append(("rank", str(rank)))
    if run_id:
        labels.append(("run", run_id))
    return tuple(labels)
