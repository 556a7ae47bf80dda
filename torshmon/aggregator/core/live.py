"""The aggregator's live view of every job: latest values, detectors, job-level metrics.

``LiveState.observe`` takes what one ingest stored and feeds the series store
(for the rules), the detectors (step-time and loss z-scores, the cross-rank
straggler detector, the hang detector, the link checker) and the per-rank state behind the
job-level ``/metrics``. Each run (launch) of a job has its own state and detectors
(``core.run_state``): two launches of one job name running at once are judged,
alerted and exported apart; the API and commands take a job's latest run.
Everything here runs on the aggregator's event loop, the Prometheus collector too
(``torshmon.aggregator.live_metrics``, called by the loop's ``/metrics`` handler), so
nothing here takes a lock.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

from torshmon.aggregator.core import summaries
from torshmon.aggregator.core.agents import Agents
from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.bottleneck import Thresholds, bottleneck_report, rank_findings
from torshmon.aggregator.core.complete_steps import StepCollector
from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.hang import HangSettings
from torshmon.aggregator.core.job_snapshot import job_snapshot
from torshmon.aggregator.core.linkcheck import LinkCheckSettings, reading_json
from torshmon.aggregator.core.memory_report import GpuMemory, RankMemory, memory_of
from torshmon.aggregator.core.rank_state import (
    JobState,
    RankState,
    copy_rank,
    failure_points,
    observe_collectives,
)
from torshmon.aggregator.core.rules import ANOMALY_METRICS
from torshmon.aggregator.core.run_state import DetectorSettings, RunKey, RunState
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.core.step_columns import (
    StepColumns,
    add_step_series,
    fold_extras,
    fold_latest,
    fold_totals,
)
from torshmon.aggregator.core.step_series import observe_collective_series
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.straggler import RankStep, StragglerSettings
from torshmon.aggregator.core.zscore import ZScoreDetector, ZScoreSettings, observe_from
from torshmon.labels import LabelCap
from torshmon.wire import (
    Batch,
    NodeSample,
)

_first: Callable[[tuple[int, Finding]], int] = operator.itemgetter(0)


class LiveState:
    """Live state of every run of every job, and of every node, this aggregator serves
    (not thread-safe: one event loop)."""

    def __init__(
        self,
        *,
        idle_s: float = 900.0,
        series_retention_s: float = 900.0,
        series_windows_s: Mapping[str, float] | None = None,
        straggler: StragglerSettings | None = None,
        zscore: ZScoreSettings | None = None,
        hang: HangSettings | None = None,
        link_check: LinkCheckSettings | None = None,
        label_cap: LabelCap | None = None,
        bottleneck: Thresholds | None = None,
        anomaly_metrics: Collection[str] | None = None,
        collective_series: bool = False,
        config_settle_steps: int = 10,
    ) -> None:
        """``idle_s``: a run (or node) that sent nothing for this long is dropped, with
        its series and detector state; a hung job still sends heartbeats, so it stays.
        ``series_retention_s``: how far back the rules can look (history is in SQL).
        ``series_windows_s``: the metrics whose points the rules read, with how far back
        (None: all of every metric); the others keep their newest point only.
        ``straggler``, ``zscore`` (step time and loss), ``hang``: the detectors'
        settings (None: their defaults). ``link_check``: when to run pairwise link
        checks and how to read them.
        ``label_cap``: how many op, pg and codec values a job's probes may name; the
        rest fold into ``other`` as they are taken in (``torshmon.labels``).
        ``bottleneck``: the bottleneck report's thresholds (None: ``Thresholds()``'s defaults).
        ``anomaly_metrics``: the z-scores to run beyond step time and loss
        (``comm_wait_seconds``, ``throughput_samples_per_second``; None: both); the
        service passes those its rules name, as each costs ingest time.
        ``collective_series``: keep ``collective_duration_seconds`` per (op, pg) for
        rules (on where a rule names it; a point per collective per step).
        ``config_settle_steps``: after a config switch (an autotuner trial, a
        ``request_config``) the job's step time and straggler detectors skip this many
        steps and then learn the new level afresh, so a switch sets off no alert."""
        self.idle_s = idle_s
        if config_settle_steps < 0:
            raise ValueError(f"config_settle_steps must be >= 0, got {config_settle_steps}")
        self.config_settle_steps = config_settle_steps
        self._labels = label_cap if label_cap is not None else LabelCap()
        self.series = SeriesStore(retention_s=series_retention_s, windows_s=series_windows_s)
        self.detector_settings = DetectorSettings(straggler, zscore, hang, link_check)
        # Every live run by (job, run id), each with its own detectors; per job, its
        # latest run (the one the API shows and commands go to); per (job, session), the
        # run its hello named, by which a batch finds its run.
        self._runs: dict[RunKey, RunState] = {}
        self._latest: dict[str, str] = {}
        self._session_runs: dict[tuple[str, str], str] = {}
        self.nodes: dict[str, NodeSample] = {}
        self._node_seen: dict[str, float] = {}
        self.agents = Agents()
        # Per node, the (job, rank) its agent has listed as running, ever and in its
        # latest sample: one listed before and no longer has ended.
        self._listed: dict[str, set[tuple[str, int]]] = {}
        self._running: dict[str, set[tuple[str, int]]] = {}
        # Seconds since each node's agent last POSTed, as of the last ``findings()``.
        self._silence: dict[str, float] = {}
        wanted = set(ANOMALY_METRICS) if anomaly_metrics is None else set(anomaly_metrics)
        self._comm_z_on = "comm_wait_seconds" in wanted
        self._throughput_z_on = "throughput_samples_per_second" in wanted
        self._collective_series = collective_series
        self.thresholds = bottleneck if bottleneck is not None else Thresholds()
        self._alerts: list[Alert] = []
        self._hangs: list[Finding] = []
        # Findings seen active since the last ``findings()`` call. One ingested batch can
        # hold many steps: a loss spike of 5 steps, or a short straggler, can become
        # active and clear inside it, between two rule evaluations. Latched here, each is
        # evaluated at least once (it fires, then resolves at the next evaluation).
        self._latched: dict[tuple[str, tuple[tuple[str, str], ...]], Finding] = {}
        # What the last ``findings()`` returned, and whether something not among it has
        # appeared since: the service then evaluates at once instead of on its timer.
        #: The findings the last evaluation saw, by key and whether they paged: a finding
        #: that starts paging is news to the rules as much as a new one.
        self._evaluated: set[tuple[tuple[str, tuple[tuple[str, str], ...]], bool]] = set()
        self._fresh = False

    @property
    def jobs(self) -> dict[str, JobState]:
        """Each live job's latest run's state, by job name."""
        return {job: self._runs[(job, run)].state for job, run in self._latest.items()}

    def run_states(self) -> dict[RunKey, JobState]:
        """Every live run's state, by (job, run id)."""
        return {key: run.state for key, run in self._runs.items()}

    def run(self, job: str, run_id: str | None = None) -> RunState:
        """Run ``run_id`` of ``job`` (None: its latest) with its detectors; KeyError if
        it is not live."""
        run = self._latest_run(job, run_id)
        if run is None:
            raise KeyError(f"no live run {run_id!r} of job {job!r}")
        return run

    def _latest_run(self, job: str, run_id: str | None = None) -> RunState | None:
        """Run ``run_id`` of ``job`` (None: its latest), None if not live."""
        run = self._latest.get(job) if run_id is None else run_id
        return None if run is None else self._runs.get((job, run))

    # -- feeding -------------------------------------------------------------------------
    def observe(self, stored: Stored, now_unix_s: float, agent_node: str | None = None) -> None:
        """Take in what one ingest stored, POSTed by the agent of ``agent_node`` (None:
        the nodes the data names)."""
        self._contact(stored, now_unix_s, agent_node)
        for hello in stored.hellos:
            run = self._run_of_hello(hello.job, hello.run_id)
            self._session_runs[(hello.job, hello.session)] = run.run_id
            job = run.state
            job.sessions.add(hello.session)
            if job.world_size != hello.world_size:
                self._set_world(run, hello.world_size)
            run.rank(hello.rank).node = hello.node
            run.links.set_node(hello.job, hello.rank, hello.node)
        for batch, node in stored.batches:
            self._observe_batch(batch, node, now_unix_s)
        for sample in stored.node_samples:
            self._observe_node(sample)
            self._node_seen[sample.node] = now_unix_s

    def _run_of_hello(self, job: str, run_id: str) -> RunState:
        """The run a hello names, made at its first hello; a launch newer than the job's
        latest becomes its latest (the older one stays live, judged on its own, until
        its ranks fall silent). Probes that send no run id are the job's run ""."""
        run = self._runs.get((job, run_id))
        if run is None:
            run = self._runs[(job, run_id)] = RunState.new(job, run_id, self.detector_settings)
            self._latest[job] = run_id
        return run

    def _contact(self, stored: Stored, now_unix_s: float, agent_node: str | None) -> None:
        """Date what the POST carries: every node's stamps, before any batch is read,
        so the freshest record of a replayed spool calibrates the older ones."""
        stamps: dict[str, list[float]] = {} if agent_node is None else {agent_node: []}
        for batch, node in stored.batches:
            stamps.setdefault(node, []).append(batch.sent_unix_ns / 1e9)
        for sample in stored.node_samples:
            stamps.setdefault(sample.node, []).append(sample.ts_unix_ns / 1e9)
        for node, times in stamps.items():
            self.agents.contact(node, now_unix_s, times)

    def restore_job(
        self, name: str, world_size: int, last_seen_unix_s: float, run_id: str = ""
    ) -> None:
        """A job this aggregator served before it restarted. Its probes said hello once,
        to the old process, and will not again: without the world size from SQL the
        straggler, hang and link checks would stay off for the job, and without its
        latest run ``run_id`` its alerts and findings would name none. That run is
        restored (the batches of sessions the new process never heard of are taken as
        its); its ranks count as seen at ``last_seen_unix_s``, so it expires as it would
        have."""
        run = self._latest_run(name) or self._run_of_hello(name, run_id)
        if run.state.world_size is None:
            self._set_world(run, world_size)
        for rank in range(world_size):
            r = run.rank(rank)
            r.last_seen_unix_s = max(r.last_seen_unix_s, last_seen_unix_s)

    def _set_world(self, run: RunState, world_size: int) -> None:
        run.state.world_size = world_size
        run.state.collector = StepCollector(world_size)
        run.hang.set_world(run.job, world_size)
        run.links.set_world(run.job, world_size)

    def _run_of_batch(self, job: str, session: str) -> RunState:
        """The run whose hello named ``session``; else (its hello went to an earlier
        aggregator process) the job's latest run, made if the job has none, which the
        session stays with: a launch that says hello later is not its run."""
        run_id = self._session_runs.get((job, session))
        if run_id is not None:
            run = self._runs.get((job, run_id))
            if run is not None:
                return run
        run = self._latest_run(job) or self._run_of_hello(job, "")
        self._session_runs[(job, session)] = run.run_id
        return run

    def _observe_batch(self, batch: Batch, node: str, now_unix_s: float) -> None:
        run = self._run_of_batch(batch.job, batch.session)
        job = run.state
        r = run.rank(batch.rank)
        if r.node != node:
            r.node = node
            run.links.set_node(batch.job, batch.rank, node)
        r.last_seen_unix_s = now_unix_s
        r.dropped_records_total = batch.dropped_records_total
        r.inflight_oldest_age_s = max((op.age_s for op in batch.inflight), default=0.0)
        if batch.steps:
            self._observe_steps(batch, run, r, now_unix_s)
            if batch.urgent:
                r.urgent_steps_total += len(batch.steps)
        if batch.groups:
            run.hang.observe_groups(batch.job, batch.groups)
        # When the report was current, on the aggregator's clock: a batch replayed from a
        # spool is old news, not "now".
        ts = self.agents.dated(node, batch.sent_unix_ns / 1e9, now_unix_s)
        if batch.collective_failures:
            self._observe_failures(batch, r, ts, now_unix_s)
        closing = batch.closing
        if job.world_size is None or batch.rank < job.world_size:
            run.hang.observe(
                batch.job,
                batch.rank,
                ts,
                batch.inflight,
                node,
                now_unix_s,
                closed=closing is not None,
            )
        if closing is not None and closing.collectives:
            # Those the rank ran after its last step (wire.Closing), counted as a step's.
            observe_collectives(r, closing.collectives, batch.job, self._labels)
            if self._collective_series:
                observe_collective_series(self.series, batch.job, r, [ts], (closing.collectives,))
        for result in batch.link_checks:
            run.links.observe_result(result, now_unix_s)
            self._fresh = True

    def _observe_failures(self, batch: Batch, r: RankState, ts: float, now_unix_s: float) -> None:
        """The probe's counts of failed collectives into ``r`` and the series."""
        for labels, t, count in failure_points(r, batch, ts, now_unix_s):
            self.series.add("collective_failures_total", labels, t, count)
            self._fresh = True

    def _observe_steps(self, batch: Batch, run: RunState, r: RankState, now_unix_s: float) -> None:
        """Every step of ``batch`` into the series, ``run``'s detectors and ``r``, in step
        order."""
        # The ingest hot path. Each consumer takes the batch's steps as columns in one
        # call (series, detectors, collector), as it would step by step; the findings
        # are latched in the per-step order: loss, step time, straggler.
        cols = StepColumns.of(batch.steps)
        fold_totals(r, cols)
        job = run.state
        add_step_series(self.series, r, cols)
        loss_found = self._judge_losses(run, r, cols)
        versions = cols.config_versions
        if versions[-1] > job.config_version:
            self._config_switched(run, cols.numbers, versions)
            job.config_switched_unix_s = now_unix_s
        run.links.observe_steps(batch.job, batch.rank, cols.waits, cols.computes)
        step_found, straggler_found = self._judge_complete_steps(batch, run, cols)
        step_found += self._judge_opt_in(run, r, cols)
        if loss_found or step_found or straggler_found:
            # Sorting is stable: within a step, loss before step time before straggler.
            for _, found in sorted(loss_found + step_found + straggler_found, key=_first):
                self._latch(run.of_run(found))
        fold_extras(
            r,
            job,
            cols,
            job_name=batch.job,
            labels=self._labels,
            series=self.series if self._collective_series else None,
        )
        run.hang.observe_step_duration(batch.job, cols.durations[-1])
        fold_latest(r, cols, batch.steps[-1])

    def _judge_losses(
        self, run: RunState, r: RankState, cols: StepColumns
    ) -> list[tuple[int, Finding]]:
        """The steps' losses into the loss z-score (and, where some are missing or not
        finite, into the loss series: ``add_step_series`` took the others); the
        findings, by step."""
        if cols.every_loss:
            losses = cast(Sequence[float], cols.losses)
            r.loss = losses[-1]
            return run.loss_z.observe_many(r.labels, cols.ts, losses)
        return self._observe_losses(run.loss_z, r, cols.ts, cols.losses, cols.nonfinite)

    def _judge_complete_steps(
        self, batch: Batch, run: RunState, cols: StepColumns
    ) -> tuple[list[tuple[int, Finding]], list[tuple[int, Finding]]]:
        """The steps every rank has now reported into the straggler detector and the
        job's step-time z-score; (step-time findings, straggler findings), by step."""
        step_found: list[tuple[int, Finding]] = []
        straggler_found: list[tuple[int, Finding]] = []
        job = run.state
        collector = job.collector
        if collector is None or batch.rank >= collector.world_size:
            return step_found, straggler_found
        at: list[int] = []
        job_ts: list[float] = []
        job_durations: list[float] = []
        job_waits: list[float] = []
        for i, complete in collector.add_many(
            batch.job,
            batch.rank,
            cols.numbers,
            _rank_steps(cols.computes, cols.cpu_waits, cols.input_waits),
            cols.ts,
            cols.durations,
            cols.process_waits,
        ):
            for found in run.straggler.observe_step(
                complete.job, complete.step, complete.compute_s_by_rank, complete.ts_unix_s
            ):
                straggler_found.append((i, found))
            if complete.step >= job.judged_from():
                at.append(i)
                job_ts.append(complete.ts_unix_s)
                job_durations.append(complete.duration_s)
                job_waits.append(complete.cpu_wait_s)
        if at:
            # The job's step time, one series per job: in synchronous training every
            # rank's step takes as long as the slowest rank's, so a slowdown is one
            # job-level finding, not one per rank. A rise the job's threads spent
            # waiting for a CPU is the node's, not the job's (step_cpu_wait_share).
            found_at = run.step_z.observe_many(job.labels, job_ts, job_durations, job_waits)
            step_found = [(at[j], finding) for j, finding in found_at]
        return step_found, straggler_found

    def _judge_opt_in(
        self, run: RunState, r: RankState, cols: StepColumns
    ) -> list[tuple[int, Finding]]:
        """The opt-in z-scores, per rank, past a config switch's settling (as step time)."""
        found: list[tuple[int, Finding]] = []
        job = run.state
        if self._comm_z_on:
            found += observe_from(
                run.comm_z, r.labels, cols.numbers, cols.ts, cols.waits, job.judged_from()
            )
        if self._throughput_z_on:
            found += observe_from(
                run.throughput_z,
                r.labels,
                cols.numbers,
                cols.ts,
                cols.throughputs,
                job.judged_from(),
            )
        return found

    def _config_switched(
        self, run: RunState, numbers: Sequence[int], versions: Sequence[int]
    ) -> None:
        """A new communication config took effect at the first of ``numbers`` whose
        version is newer than the job's: its steps and the next few take a new bucket
        layout or codec, and the step time settles at a new level. The detectors that
        compare a job with its past start over from there, and the straggler detector
        skips those steps (ranks rebuild buckets unevenly)."""
        job = run.state
        first = next(i for i, v in enumerate(versions) if v > job.config_version)
        job.config_version = versions[-1]
        switch_step = numbers[first]
        run.straggler.pause(run.job, switch_step, switch_step + self.config_settle_steps)
        self._settle(run, switch_step)

    def _settle(self, run: RunState, step: int) -> None:
        """The z-scores judge ``run``'s steps afresh from ``step`` + the settling steps."""
        job = run.state
        job.settled_from_step = max(job.settled_from_step, step + self.config_settle_steps)
        for detector in (run.step_z, run.comm_z, run.throughput_z):
            detector.forget(run.job)

    def _observe_losses(
        self,
        loss_z: ZScoreDetector,
        r: RankState,
        ts: list[float],
        losses: tuple[float | None, ...],
        nonfinite: tuple[bool, ...],
    ) -> list[tuple[int, Finding]]:
        """Steps' losses, some missing or non-finite, into the loss series and its
        z-score; the findings, by step.

        A non-finite loss is stored as NaN and counted; a step without a loss adds none.
        """
        at: list[int] = []  # the steps whose loss the z-score judges
        series_ts: list[float] = []
        series_values: list[float] = []
        for i, (loss, bad) in enumerate(zip(losses, nonfinite, strict=True)):
            if bad:
                self._fresh = True  # the Non-finite Loss rule reads the series
                r.nonfinite_loss_total += 1
                r.loss = math.nan
                series_ts.append(ts[i])
                series_values.append(math.nan)
            elif loss is not None:
                r.loss = loss
                series_ts.append(ts[i])
                series_values.append(loss)
                at.append(i)
        self.series.add_many(r.labels, series_ts, {"loss": series_values})
        found = loss_z.observe_many(
            r.labels, [ts[i] for i in at], [cast(float, losses[i]) for i in at]
        )
        return [(at[j], finding) for j, finding in found]

    def _observe_node(self, sample: NodeSample) -> None:
        self.nodes[sample.node] = sample
        running = {(proc.job, proc.rank) for proc in sample.ranks}
        self._listed.setdefault(sample.node, set()).update(running)
        self._running[sample.node] = running
        ts = sample.ts_unix_ns / 1e9
        node = (("node", sample.node),)
        add = self.series.add
        add("cpu_utilization_ratio", node, ts, sample.cpu_utilization_ratio)
        add("memory_utilization_ratio", node, ts, sample.memory_utilization_ratio)
        add("node_cpu_iowait_ratio", node, ts, sample.io_wait_ratio)
        for gpu in sample.gpus:
            labels = (("gpu", str(gpu.index)), ("node", sample.node))
            add("gpu_utilization_ratio", labels, ts, gpu.utilization_ratio)
            if gpu.memory_total_bytes:
                ratio = gpu.memory_used_bytes / gpu.memory_total_bytes
                add("gpu_memory_utilization_ratio", labels, ts, ratio)
        for proc in sample.ranks:
            run = self._latest_run(proc.job)  # the listing names no run: the latest's
            if run is not None and proc.rank in run.state.ranks:
                run.state.ranks[proc.rank].rss_bytes = proc.rss_bytes
            add(
                "rank_memory_rss_bytes",
                (("job", proc.job), ("node", sample.node), ("rank", str(proc.rank))),
                ts,
                proc.rss_bytes,
            )

    def _latch(self, finding: Finding) -> None:
        key = finding.key()
        self._latched[key] = finding
        if (key, _pages(finding)) not in self._evaluated:
            self._fresh = True

    def take_fresh(self) -> bool:
        """Whether a finding (or a non-finite loss, or a link check result) appeared
        since the last ``findings()`` or ``take_fresh()``; clears the mark."""
        fresh, self._fresh = self._fresh, False
        return fresh

    # -- conclusions ---------------------------------------------------------------------
    def findings(self, now_unix_s: float) -> list[Finding]:
        """Every active finding of every run's detectors, each labelled with its run."""
        self._silence = self.agents.silence_s(now_unix_s)
        for node, silence_s in self._silence.items():
            self.series.add("agent_silence_seconds", (("node", node),), now_unix_s, silence_s)
        gone = {
            pair
            for node, listed in self._listed.items()
            for pair in listed - self._running.get(node, set())
        }
        horizons = self.agents.horizons()
        out: list[Finding] = []
        hangs: list[Finding] = []
        links: list[Finding] = []
        for run in self._runs.values():
            out += run.stamped(run.anomalies() + run.straggler.active())
            hangs += run.stamped(run.hang.evaluate(now_unix_s, horizons, gone))
            run.links.evaluate(now_unix_s)
            links += run.stamped(run.links.active())
        current = {f.key() for f in out}
        out.extend(f for key, f in self._latched.items() if key not in current)
        self._latched.clear()
        self._hangs = hangs
        out = self._with_reports(out + hangs + links, now_unix_s)
        self._evaluated = {(f.key(), _pages(f)) for f in out}
        self._fresh = False
        return out

    def of_latest_run(self, job: str, session: str) -> bool:
        """Whether probe ``session`` of ``job`` is of the job's latest run (the one its
        commands go to); a session no hello here named counts as the latest's."""
        run_id = self._session_runs.get((job, session))
        return run_id is None or run_id == self._latest.get(job)

    def runs(self) -> dict[str, str]:
        """Each live job's latest run, where its probes sent one: the run that the
        alerts of series without a ``run`` label (a job-wide aggregate) are of."""
        return {job: run for job, run in self._latest.items() if run}

    def live_runs(self, job: str) -> list[str]:
        """``job``'s live runs, the oldest first (the last is its latest)."""
        return [run for (name, run) in self._runs if name == job]

    def config_switches(self) -> dict[str, float]:
        """Per job, when (aggregator clock) a rank of its latest run first reported its
        newest config switch; jobs that never switched are left out."""
        return {
            name: job.config_switched_unix_s
            for name, job in self.jobs.items()
            if job.config_switched_unix_s is not None
        }

    # -- link checks (the service sends the commands, to a job's latest run) --------------
    def link_checks_due(self, now_unix_s: float) -> list[tuple[str, str]]:
        """Jobs that need a link check now, each with the reason (their latest runs')."""
        due: list[tuple[str, str]] = []
        for job, run_id in self._latest.items():
            due += self._runs[(job, run_id)].links.due(now_unix_s)
        return due

    def link_check_args(self, job: str) -> dict[str, object]:
        run = self._latest_run(job)
        return {} if run is None else run.links.check_args(job)

    def link_check_sent(self, job: str, check_id: str, reason: str, now_unix_s: float) -> None:
        run = self._latest_run(job)
        if run is not None:
            run.links.sent(job, check_id, reason, now_unix_s)

    def link_check_done(self, job: str, check_id: str, status: str, now_unix_s: float) -> None:
        """The final status of a link_check command (to each live run of ``job``: the
        one that sent it knows its id)."""
        for run in [r for key, r in self._runs.items() if key[0] == job]:
            run.links.command_done(job, check_id, status, now_unix_s)

    def _with_reports(self, found: list[Finding], now_unix_s: float) -> list[Finding]:
        """``found`` with every run's bottleneck report: its bottlenecks added, its
        straggler and slow-link findings replaced by the report's ranked copies."""
        by_run: dict[RunKey, list[Finding]] = {}
        for f in found:
            by_run.setdefault((f.labels.get("job", ""), f.labels.get("run", "")), []).append(f)
        ranked: dict[tuple[str, tuple[tuple[str, str], ...]], Finding] = {}
        for key, run in self._runs.items():
            run.report = self._run_report(run, by_run.get(key, ()), now_unix_s)
            run.bottleneck_since = {
                f.key(): f.since_unix_s for f in run.report if f.kind == "bottleneck"
            }
            ranked.update((f.key(), f) for f in run.report)
        out = [ranked.get(f.key(), f) for f in found]
        out.extend(f for f in ranked.values() if f.kind == "bottleneck")
        return out

    def _run_report(
        self, run: RunState, others: Sequence[Finding], now_unix_s: float
    ) -> list[Finding]:
        """``run``'s report; a bottleneck that held at the last ``findings()`` keeps the
        time it began (the report is recomputed from recent means each time)."""
        snapshot = job_snapshot(run.job, run.state, self.nodes)
        found = bottleneck_report(run.job, snapshot, now_unix_s, thresholds=self.thresholds)
        since = run.bottleneck_since
        kept = [
            dataclasses.replace(f, since_unix_s=since.get(f.key(), f.since_unix_s))
            for f in run.stamped(found)
        ]
        return run.stamped(rank_findings(kept, others, snapshot, thresholds=self.thresholds))

    def report(
        self, job: str, now_unix_s: float, run_id: str | None = None
    ) -> list[Finding] | None:
        """The bottleneck report of ``job``'s run ``run_id`` (None: its latest), highest
        priority first (None if not live): its bottlenecks, stragglers and slow links."""
        run = self._latest_run(job, run_id)
        if run is None:
            return None
        others = run.stamped(run.straggler.active() + run.links.active())
        return self._run_report(run, others, now_unix_s)

    def job_kind(self, job: str, run_id: str | None = None) -> str | None:
        """What ``job``'s probes were attached to (``JobState.kind``), None if unknown."""
        run = self._latest_run(job, run_id)
        return None if run is None else run.state.kind

    def set_tuning(self, name: str, active: bool) -> None:
        """An autotuner session on job ``name`` (its latest run: commands go there) began
        (``active``) or ended: its trials switch configs every few dozen steps and it
        judges their step time itself, so the step-time z-scores leave the run alone
        until past the settling steps after it."""
        run = self._latest_run(name) or self._run_of_hello(name, "")
        run.state.tuning = active
        self._settle(run, max((r.last_step for r in run.state.ranks.values()), default=0))

    def link_reading(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        """``job``'s latest link check as JSON (bytes/s; per node pair when ranks share
        hosts), or None before its first."""
        run = self._latest_run(job, run_id)
        reading = None if run is None else run.links.last(job)
        return None if reading is None else reading_json(reading)

    def memory_history(self, labels: Mapping[str, str]) -> tuple[list[RankMemory], list[GpuMemory]]:
        """The memory behind an alert on ``labels`` (``memory_report.memory_of``): of
        the alert's run, else of each job's latest."""
        run = labels.get("run")
        jobs = self.jobs
        if run is not None and (chosen := self._runs.get((labels.get("job", ""), run))):
            jobs[chosen.job] = chosen.state
        return memory_of(labels, jobs, self.series, self.nodes)

    def set_alerts(self, alerts: Sequence[Alert]) -> None:
        self._alerts = list(alerts)

    def expire(self, now_unix_s: float) -> None:
        """Drop old points, and runs and nodes idle for ``idle_s`` (they ended)."""
        cutoff = now_unix_s - self.idle_s
        for run in [r for r in self._runs.values() if r.state.last_seen_unix_s() < cutoff]:
            self._drop_run(run)
        for node in [n for n, seen in self._node_seen.items() if seen < cutoff]:
            del self._node_seen[node]
            self.nodes.pop(node, None)
            self.series.forget({"node": node})
        for node in self.agents.forget_idle(cutoff):
            self._silence.pop(node, None)
            self._listed.pop(node, None)
            self._running.pop(node, None)
            self.series.forget({"node": node})
        self.series.expire(now_unix_s)

    def forget(self, job: str) -> None:
        """Drop a finished job, every run of it: their ranks, series and detector state."""
        for run in [r for key, r in self._runs.items() if key[0] == job]:
            self._drop_run(run)

    def _drop_run(self, run: RunState) -> None:
        """Drop one run: its ranks, series and detector state; the job's latest run
        becomes the newest of those left."""
        job = run.job
        self._runs.pop(run.key, None)
        run.forget()
        if run.run_id:
            self.series.forget({"job": job, "run": run.run_id})
        self._session_runs = {
            key: r for key, r in self._session_runs.items() if (key[0], r) != run.key
        }
        left = self.live_runs(job)
        if left:
            self._latest[job] = left[-1]
        else:
            self._latest.pop(job, None)
            self._labels.forget(job)
            self.series.forget({"job": job})

    # -- summaries for the API (core.summaries): a job's latest run unless one is named ---
    def job_summary(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        run = self._latest_run(job, run_id)
        return None if run is None else summaries.job_summary(run.state)

    def job_config(self, job: str, run_id: str | None = None) -> dict[str, Any] | None:
        run = self._latest_run(job, run_id)
        config = run.state.config if run is not None else None
        return None if config is None else summaries.config_summary(config)

    def rank_summaries(self, job: str, run_id: str | None = None) -> dict[int, dict[str, Any]]:
        run = self._latest_run(job, run_id)
        return {} if run is None else summaries.rank_summaries(run.state)

    # -- export --------------------------------------------------------------------------
    def snapshot_for_export(self) -> dict[str, Any]:
        """A copy of what the collector needs (it runs on the same event loop), every
        live run by (job, run id); the findings carry their ``run`` label."""
        runs = self._runs
        return {
            "jobs": {
                key: (
                    run.state.bucket_cap_bytes,
                    run.state.config.codec if run.state.config else None,
                    [(rank, copy_rank(r)) for rank, r in run.state.ranks.items()],
                )
                for key, run in runs.items()
            },
            "agent_silence": dict(self._silence),
            "anomalies": [f for run in runs.values() for f in run.stamped(run.anomalies())],
            "stragglers": [f for run in runs.values() for f in run.stamped(run.straggler.active())],
            "hangs": list(self._hangs),
            "slow_links": [f for run in runs.values() for f in run.stamped(run.links.active())],
            "link_bandwidth": {
                key: reading  # frozen: safe to read outside the lock
                for key, run in runs.items()
                if (reading := run.links.last(run.job)) is not None
            },
            "alerts": list(self._alerts),
            # lists of frozen findings, replaced whole
            "reports": {key: run.report for key, run in runs.items()},
            "labels_folded": self._labels.folded(),
        }


def _rank_steps(
    computes: Sequence[float],
    cpu_waits: Sequence[float | None],
    input_waits: Sequence[float | None],
) -> list[RankStep]:
    """What the straggler detector compares, per step: the compute less the time the
    training thread waited for a CPU (where the probe measured it), that wait (host),
    and the wait for the batch before the step (input)."""
    out = []
    for c, w, i in zip(computes, cpu_waits, input_waits, strict=True):
        host = min(w, c) if w is not None and w > 0 else 0.0
        wait = i if i is not None and i > 0 else 0.0
        out.append(RankStep(c - host, wait, host))
    return out


def _pages(finding: Finding) -> bool:
    """Whether ``finding`` pages (a straggler's ``details["page"]``; other kinds always)."""
    return finding.details.get("page") is not False
