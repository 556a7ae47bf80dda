"""The aggregator's live view of every job: latest values, detectors, job-level metrics.

``LiveState.observe`` takes what one ingest stored and feeds the series store
(for the rules), the detectors (step-time and loss z-scores, the cross-rank
straggler detector, the hang detector, the link checker) and the per-rank state behind the
job-level ``/metrics``. Everything here runs on the aggregator's event loop, the
Prometheus collector too (``torshmon.aggregator.live_metrics``, called by the loop's
``/metrics`` handler), so nothing here takes a lock.
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
from torshmon.aggregator.core.hang import HangDetector, HangSettings
from torshmon.aggregator.core.job_snapshot import job_snapshot
from torshmon.aggregator.core.linkcheck import LinkChecker, LinkCheckSettings, reading_json
from torshmon.aggregator.core.memory_report import GpuMemory, RankMemory, memory_of
from torshmon.aggregator.core.rank_state import (
    JobState,
    RankState,
    copy_rank,
    failure_points,
    observe_collectives,
)
from torshmon.aggregator.core.rules import ANOMALY_METRICS
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.core.step_columns import (
    StepColumns,
    add_step_series,
    fold_extras,
    fold_latest,
    fold_totals,
)
from torshmon.aggregator.core.step_series import observe_collective_series
from torshmon.aggregator.core.step_time import StepTimeDetector
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.straggler import RankStep, StragglerDetector, StragglerSettings
from torshmon.aggregator.core.zscore import ZScoreDetector, ZScoreSettings, observe_from
from torshmon.labels import LabelCap
from torshmon.wire import (
    Batch,
    NodeSample,
)

_first: Callable[[tuple[int, Finding]], int] = operator.itemgetter(0)


class LiveState:
    """Live state of every job and node this aggregator serves (not thread-safe: one event loop)."""

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
        """``idle_s``: a job (or node) that sent nothing for this long is dropped, with
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
        self.jobs: dict[str, JobState] = {}
        # Per job, the runs a later launch of it took over from, and their sessions: the
        # history keeps their rows apart, but the live state is the latest launch's.
        self._superseded_runs: dict[str, set[str]] = {}
        self._superseded_sessions: dict[str, set[str]] = {}
        self.nodes: dict[str, NodeSample] = {}
        self._node_seen: dict[str, float] = {}
        self.agents = Agents()
        # Per node, the (job, rank) its agent has listed as running, ever and in its
        # latest sample: one listed before and no longer has ended.
        self._listed: dict[str, set[tuple[str, int]]] = {}
        self._running: dict[str, set[tuple[str, int]]] = {}
        # Seconds since each node's agent last POSTed, as of the last ``findings()``.
        self._silence: dict[str, float] = {}
        self.step_z = StepTimeDetector(zscore)
        self.loss_z = ZScoreDetector(zscore, metric="loss", direction="up")
        self.comm_z = ZScoreDetector(zscore, metric="comm_wait_seconds", direction="up")
        self.throughput_z = ZScoreDetector(
            zscore, metric="throughput_samples_per_second", direction="down"
        )
        wanted = set(ANOMALY_METRICS) if anomaly_metrics is None else set(anomaly_metrics)
        self._comm_z_on = "comm_wait_seconds" in wanted
        self._throughput_z_on = "throughput_samples_per_second" in wanted
        self._collective_series = collective_series
        self.straggler = StragglerDetector(straggler)
        self.hang = HangDetector(hang)
        self.links = LinkChecker(link_check)
        self.thresholds = bottleneck if bottleneck is not None else Thresholds()
        # Each job's report as of the last ``findings()``, and since when each of its
        # bottlenecks has held (the report is recomputed from recent means each time).
        self._reports: dict[str, list[Finding]] = {}
        self._bottleneck_since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
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

    # -- feeding -------------------------------------------------------------------------
    def observe(self, stored: Stored, now_unix_s: float, agent_node: str | None = None) -> None:
        """Take in what one ingest stored, POSTed by the agent of ``agent_node`` (None:
        the nodes the data names)."""
        self._contact(stored, now_unix_s, agent_node)
        for hello in stored.hellos:
            if hello.run_id in self._superseded_runs.get(hello.job, ()):
                self._superseded_sessions[hello.job].add(hello.session)
                continue
            job = self._job(hello.job)
            if hello.run_id and job.run_id not in ("", hello.run_id):
                # A new launch under the same name: the last one's state is not its own,
                # and its ranks, if they still run, are no longer watched live.
                self._superseded_runs.setdefault(hello.job, set()).add(job.run_id)
                self._superseded_sessions.setdefault(hello.job, set()).update(job.sessions)
                self.forget(hello.job)
                job = self._job(hello.job)
            job.run_id = hello.run_id or job.run_id
            job.sessions.add(hello.session)
            if job.world_size != hello.world_size:
                self._set_world(hello.job, job, hello.world_size)
            self._rank(hello.job, job, hello.rank).node = hello.node
            self.links.set_node(hello.job, hello.rank, hello.node)
        for batch, node in stored.batches:
            self._observe_batch(batch, node, now_unix_s)
        for sample in stored.node_samples:
            self._observe_node(sample)
            self._node_seen[sample.node] = now_unix_s

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
        latest run ``run_id`` its alerts and findings would name none. Its ranks count
        as seen at ``last_seen_unix_s``, so the job expires as it would have."""
        job = self._job(name)
        job.run_id = job.run_id or run_id
        if job.world_size is None:
            self._set_world(name, job, world_size)
        for rank in range(world_size):
            r = self._rank(name, job, rank)
            r.last_seen_unix_s = max(r.last_seen_unix_s, last_seen_unix_s)

    def _set_world(self, name: str, job: JobState, world_size: int) -> None:
        job.world_size = world_size
        job.collector = StepCollector(world_size)
        self.hang.set_world(name, world_size)
        self.links.set_world(name, world_size)

    def _job(self, name: str) -> JobState:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = JobState(labels=(("job", name),))
        return job

    def _rank(self, job_name: str, job: JobState, rank: int) -> RankState:
        state = job.ranks.get(rank)
        if state is None:
            state = job.ranks[rank] = RankState(labels=(("job", job_name), ("rank", str(rank))))
        return state

    def _observe_batch(self, batch: Batch, node: str, now_unix_s: float) -> None:
        if batch.session in self._superseded_sessions.get(batch.job, ()):
            return
        job = self._job(batch.job)
        r = self._rank(batch.job, job, batch.rank)
        if r.node != node:
            r.node = node
            self.links.set_node(batch.job, batch.rank, node)
        r.last_seen_unix_s = now_unix_s
        r.dropped_records_total = batch.dropped_records_total
        r.inflight_oldest_age_s = max((op.age_s for op in batch.inflight), default=0.0)
        if batch.steps:
            self._observe_steps(batch, job, r, now_unix_s)
            if batch.urgent:
                r.urgent_steps_total += len(batch.steps)
        if batch.groups:
            self.hang.observe_groups(batch.job, batch.groups)
        # When the report was current, on the aggregator's clock: a batch replayed from a
        # spool is old news, not "now".
        ts = self.agents.dated(node, batch.sent_unix_ns / 1e9, now_unix_s)
        if batch.collective_failures:
            self._observe_failures(batch, r, ts, now_unix_s)
        closing = batch.closing
        if job.world_size is None or batch.rank < job.world_size:
            self.hang.observe(
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
            self.links.observe_result(result, now_unix_s)
            self._fresh = True

    def _observe_failures(self, batch: Batch, r: RankState, ts: float, now_unix_s: float) -> None:
        """The probe's counts of failed collectives into ``r`` and the series."""
        for labels, t, count in failure_points(r, batch, ts, now_unix_s):
            self.series.add("collective_failures_total", labels, t, count)
            self._fresh = True

    def _observe_steps(self, batch: Batch, job: JobState, r: RankState, now_unix_s: float) -> None:
        """Every step of ``batch`` into the series, detectors and ``r``, in step order."""
        # The ingest hot path. Each consumer takes the batch's steps as columns in one
        # call (series, detectors, collector), as it would step by step; the findings
        # are latched in the per-step order: loss, step time, straggler.
        cols = StepColumns.of(batch.steps)
        fold_totals(r, cols)
        add_step_series(self.series, r, cols)
        loss_found = self._judge_losses(r, cols)
        versions = cols.config_versions
        if versions[-1] > job.config_version:
            self._config_switched(batch.job, job, cols.numbers, versions)
            job.config_switched_unix_s = now_unix_s
        self.links.observe_steps(batch.job, batch.rank, cols.waits, cols.computes)
        step_found, straggler_found = self._judge_complete_steps(batch, job, cols)
        step_found += self._judge_opt_in(job, r, cols)
        if loss_found or step_found or straggler_found:
            # Sorting is stable: within a step, loss before step time before straggler.
            for _, found in sorted(loss_found + step_found + straggler_found, key=_first):
                self._latch(found)
        fold_extras(
            r,
            job,
            cols,
            job_name=batch.job,
            labels=self._labels,
            series=self.series if self._collective_series else None,
        )
        self.hang.observe_step_duration(batch.job, cols.durations[-1])
        fold_latest(r, cols, batch.steps[-1])

    def _judge_losses(self, r: RankState, cols: StepColumns) -> list[tuple[int, Finding]]:
        """The steps' losses into the loss z-score (and, where some are missing or not
        finite, into the loss series: ``add_step_series`` took the others); the
        findings, by step."""
        if cols.every_loss:
            losses = cast(Sequence[float], cols.losses)
            r.loss = losses[-1]
            return self.loss_z.observe_many(r.labels, cols.ts, losses)
        return self._observe_losses(r, cols.ts, cols.losses, cols.nonfinite)

    def _judge_complete_steps(
        self, batch: Batch, job: JobState, cols: StepColumns
    ) -> tuple[list[tuple[int, Finding]], list[tuple[int, Finding]]]:
        """The steps every rank has now reported into the straggler detector and the
        job's step-time z-score; (step-time findings, straggler findings), by step."""
        step_found: list[tuple[int, Finding]] = []
        straggler_found: list[tuple[int, Finding]] = []
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
            for found in self.straggler.observe_step(
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
            found_at = self.step_z.observe_many(job.labels, job_ts, job_durations, job_waits)
            step_found = [(at[j], finding) for j, finding in found_at]
        return step_found, straggler_found

    def _judge_opt_in(
        self, job: JobState, r: RankState, cols: StepColumns
    ) -> list[tuple[int, Finding]]:
        """The opt-in z-scores, per rank, past a config switch's settling (as step time)."""
        found: list[tuple[int, Finding]] = []
        if self._comm_z_on:
            found += observe_from(
                self.comm_z, r.labels, cols.numbers, cols.ts, cols.waits, job.judged_from()
            )
        if self._throughput_z_on:
            found += observe_from(
                self.throughput_z,
                r.labels,
                cols.numbers,
                cols.ts,
                cols.throughputs,
                job.judged_from(),
            )
        return found

    def _config_switched(
        self, name: str, job: JobState, numbers: Sequence[int], versions: Sequence[int]
    ) -> None:
        """A new communication config took effect at the first of ``numbers`` whose
        version is newer than the job's: its steps and the next few take a new bucket
        layout or codec, and the step time settles at a new level. The detectors that
        compare a job with its past start over from there, and the straggler detector
        skips those steps (ranks rebuild buckets unevenly)."""
        first = next(i for i, v in enumerate(versions) if v > job.config_version)
        job.config_version = versions[-1]
        switch_step = numbers[first]
        self.straggler.pause(name, switch_step, switch_step + self.config_settle_steps)
        self._settle(name, job, switch_step)

    def _settle(self, name: str, job: JobState, step: int) -> None:
        """The z-scores judge ``name``'s steps afresh from ``step`` + the settling steps."""
        job.settled_from_step = max(job.settled_from_step, step + self.config_settle_steps)
        for detector in (self.step_z, self.comm_z, self.throughput_z):
            detector.forget(name)

    def _observe_losses(
        self,
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
        found = self.loss_z.observe_many(
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
            job = self.jobs.get(proc.job)
            if job is not None and proc.rank in job.ranks:
                job.ranks[proc.rank].rss_bytes = proc.rss_bytes
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
        """Every active finding of every detector."""
        out = self._anomalies() + self.straggler.active()
        current = {f.key() for f in out}
        out.extend(f for key, f in self._latched.items() if key not in current)
        self._latched.clear()
        self._silence = self.agents.silence_s(now_unix_s)
        for node, silence_s in self._silence.items():
            self.series.add("agent_silence_seconds", (("node", node),), now_unix_s, silence_s)
        gone = {
            pair
            for node, listed in self._listed.items()
            for pair in listed - self._running.get(node, set())
        }
        self._hangs = self.hang.evaluate(now_unix_s, self.agents.horizons(), gone)
        out.extend(self._hangs)
        self.links.evaluate(now_unix_s)
        out.extend(self.links.active())
        out = self._with_reports(out, now_unix_s)
        self._evaluated = {(f.key(), _pages(f)) for f in out}
        self._fresh = False
        return [self._of_run(f) for f in out]

    def _of_run(self, finding: Finding) -> Finding:
        """``finding`` labelled ``run`` with its job's run, where the job has one: its
        episode, alerts and history rows are that run's."""
        job = self.jobs.get(finding.labels.get("job", ""))
        if job is None or not job.run_id or "run" in finding.labels:
            return finding
        return dataclasses.replace(finding, labels={**finding.labels, "run": job.run_id})

    def runs(self) -> dict[str, str]:
        """Each live job's run, where its probes sent one: the run its alerts are of."""
        return {name: job.run_id for name, job in self.jobs.items() if job.run_id}

    def config_switches(self) -> dict[str, float]:
        """Per job, when (aggregator clock) a rank first reported its newest config
        switch; jobs that never switched are left out."""
        return {
            name: job.config_switched_unix_s
            for name, job in self.jobs.items()
            if job.config_switched_unix_s is not None
        }

    # -- link checks (the service sends the commands) --------------------------------------
    def link_checks_due(self, now_unix_s: float) -> list[tuple[str, str]]:
        """Jobs that need a link check now, each with the reason."""
        return self.links.due(now_unix_s)

    def link_check_args(self, job: str) -> dict[str, object]:
        return self.links.check_args(job)

    def link_check_sent(self, job: str, check_id: str, reason: str, now_unix_s: float) -> None:
        self.links.sent(job, check_id, reason, now_unix_s)

    def link_check_done(self, job: str, check_id: str, status: str, now_unix_s: float) -> None:
        """The final status of a link_check command (any thread)."""
        self.links.command_done(job, check_id, status, now_unix_s)

    def _anomalies(self) -> list[Finding]:
        return (
            self.step_z.active()
            + self.loss_z.active()
            + self.comm_z.active()
            + self.throughput_z.active()
        )

    def _with_reports(self, found: list[Finding], now_unix_s: float) -> list[Finding]:
        """``found`` with every job's bottleneck report: its bottlenecks added, its
        straggler and slow-link findings replaced by the report's ranked copies."""
        by_job: dict[str, list[Finding]] = {}
        for f in found:
            by_job.setdefault(f.labels.get("job", ""), []).append(f)
        reports = {
            name: self._job_report(name, job, by_job.get(name, ()), now_unix_s)
            for name, job in self.jobs.items()
        }
        self._reports = reports
        ranked = {f.key(): f for report in reports.values() for f in report}
        self._bottleneck_since = {
            key: f.since_unix_s for key, f in ranked.items() if f.kind == "bottleneck"
        }
        out = [ranked.get(f.key(), f) for f in found]
        out.extend(f for f in ranked.values() if f.kind == "bottleneck")
        return out

    def _job_report(
        self, name: str, job: JobState, others: Sequence[Finding], now_unix_s: float
    ) -> list[Finding]:
        """``name``'s report; a bottleneck that held at the last ``findings()`` keeps the
        time it began (the report is recomputed from recent means each time)."""
        snapshot = job_snapshot(name, job, self.nodes)
        found = bottleneck_report(name, snapshot, now_unix_s, thresholds=self.thresholds)
        since = self._bottleneck_since
        kept = [
            dataclasses.replace(f, since_unix_s=since.get(f.key(), f.since_unix_s)) for f in found
        ]
        return rank_findings(kept, others, snapshot, thresholds=self.thresholds)

    def report(self, job: str, now_unix_s: float) -> list[Finding] | None:
        """The bottleneck report of ``job``, highest priority first (None if the job is
        unknown): its bottlenecks, stragglers and slow links, ranked."""
        state = self.jobs.get(job)
        if state is None:
            return None
        others = [
            f for f in self.straggler.active() + self.links.active() if f.labels.get("job") == job
        ]
        return self._job_report(job, state, others, now_unix_s)

    def job_kind(self, job: str) -> str | None:
        """What ``job``'s probes were attached to (``JobState.kind``), None if unknown."""
        state = self.jobs.get(job)
        return None if state is None else state.kind

    def set_tuning(self, name: str, active: bool) -> None:
        """An autotuner session on job ``name`` began (``active``) or ended: its trials
        switch configs every few dozen steps and it judges their step time itself, so the
        step-time z-scores leave the job alone until past the settling steps after it."""
        job = self._job(name)
        job.tuning = active
        self._settle(name, job, max((r.last_step for r in job.ranks.values()), default=0))

    def link_reading(self, job: str) -> dict[str, Any] | None:
        """``job``'s latest link check as JSON (bytes/s; per node pair when ranks share
        hosts), or None before its first."""
        reading = self.links.last(job)
        return None if reading is None else reading_json(reading)

    def memory_history(self, labels: Mapping[str, str]) -> tuple[list[RankMemory], list[GpuMemory]]:
        """The memory behind an alert on ``labels`` (``memory_report.memory_of``)."""
        return memory_of(labels, self.jobs, self.series, self.nodes)

    def set_alerts(self, alerts: Sequence[Alert]) -> None:
        self._alerts = list(alerts)

    def expire(self, now_unix_s: float) -> None:
        """Drop old points, and jobs and nodes idle for ``idle_s`` (they ended)."""
        cutoff = now_unix_s - self.idle_s
        idle_jobs = [name for name, job in self.jobs.items() if job.last_seen_unix_s() < cutoff]
        for name in idle_jobs:
            self.forget(name)
            self._superseded_runs.pop(name, None)
            self._superseded_sessions.pop(name, None)
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
        """Drop a finished job: its ranks, series and detector state."""
        self.jobs.pop(job, None)
        self._labels.forget(job)
        self.series.forget({"job": job})
        z_scores = (self.step_z, self.loss_z, self.comm_z, self.throughput_z)
        for detector in (*z_scores, self.straggler, self.hang, self.links):
            detector.forget(job)

    # -- summaries for the API (core.summaries) -----------------------------------------
    def job_summary(self, job: str) -> dict[str, Any] | None:
        state = self.jobs.get(job)
        return None if state is None else summaries.job_summary(state)

    def job_config(self, job: str) -> dict[str, Any] | None:
        state = self.jobs.get(job)
        config = state.config if state is not None else None
        return None if config is None else summaries.config_summary(config)

    def rank_summaries(self, job: str) -> dict[int, dict[str, Any]]:
        state = self.jobs.get(job)
        return {} if state is None else summaries.rank_summaries(state)

    # -- export --------------------------------------------------------------------------
    def snapshot_for_export(self) -> dict[str, Any]:
        """A copy of what the collector needs (it runs on the same event loop)."""
        return {
            "jobs": {
                name: (
                    job.bucket_cap_bytes,
                    job.config.codec if job.config else None,
                    [(rank, copy_rank(r)) for rank, r in job.ranks.items()],
                    job.run_id,
                )
                for name, job in self.jobs.items()
            },
            "agent_silence": dict(self._silence),
            "anomalies": self._anomalies(),
            "stragglers": self.straggler.active(),
            "hangs": list(self._hangs),
            "slow_links": self.links.active(),
            "link_bandwidth": {
                name: reading  # frozen: safe to read outside the lock
                for name in self.jobs
                if (reading := self.links.last(name)) is not None
            },
            "alerts": list(self._alerts),
            "reports": dict(self._reports),  # lists of frozen findings, replaced whole
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
