"""The autotuner in the aggregator: runs one ``TuningSession`` per job against the real job.

The pure session (``core.tuner``) decides; this module does the I/O around it. It
pushes each ``ApplyConfig`` as a ``config`` command and routes only that command's
final acknowledgement back (applied -> ``on_applied``, rejected or expired ->
``on_rejected``), feeds rank 0's step records in order (``observe``), calls
``on_timeout`` on every evaluation tick, persists the session and its trials after
every event that changed them, exports metrics and spans, and notifies when a
session ends. Everything runs on the aggregator's event loop: command status
changes arrive from the writer thread and are marshalled onto the loop, and one lock
per manager keeps decisions executing in the order the sessions returned them.

The manager sees only what it needs, each a narrow interface: a store for its
sessions, a command sink, a view of the jobs' live data, an alert sink for the
notifications, a tracer, a registry and a clock. The service wires them and routes
command statuses (``on_command_status``) and ``autotune`` alert actions (``on_alert``)
here.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol, get_args

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.commands import CommandError, CommandStatus
from torshmon.aggregator.core.rules import alert_name
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.core.tuner import (
    Abort,
    ApplyConfig,
    Decision,
    DriftWatch,
    Finish,
    SearchSpace,
    StepSample,
    Trial,
    TrialConfig,
    TunerError,
    TunerSettings,
    TuningSession,
)
from torshmon.aggregator.core.tuner.prior import slowest_link
from torshmon.aggregator.core.tuner.state import Phase
from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.codecs import MIB
from torshmon.history.store import TuningSessionRow, TuningTrialRow
from torshmon.wire import StepRecord

log = logging.getLogger(__name__)

PHASES: Final = get_args(Phase)
#: The rule name of the notification sent when a session ends.
FINISHED_RULE: Final = "Autotune Finished"
#: torch's default first bucket cap (``dist._DEFAULT_FIRST_BUCKET_BYTES``), MiB.
_TORCH_FIRST_BUCKET_MB: Final = 1.0


class TuningStore(Protocol):
    """Where sessions and trials are kept (``torshmon.history.store.HistoryStore``)."""

    async def save_tuning(
        self, session: TuningSessionRow, trials: Sequence[TuningTrialRow]
    ) -> None: ...

    async def unfinished_tuning(self) -> list[TuningSessionRow]: ...

    async def abort_tuning(self, session_id: str, reason: str, now_unix_s: float) -> None: ...


class CommandSink(Protocol):
    """Queues a command for a job's rank 0 (``dispatch.CommandDispatch``)."""

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object]
    ) -> CommandStatus: ...


class JobView(Protocol):
    """What the live state knows of a job (``live.LiveState``)."""

    def job_config(self, job: str) -> dict[str, Any] | None: ...

    def job_summary(self, job: str) -> dict[str, Any] | None: ...

    def link_reading(self, job: str) -> dict[str, Any] | None: ...

    def set_tuning(self, job: str, active: bool) -> None: ...

    def of_latest_run(self, job: str, session: str) -> bool: ...


class AlertSink(Protocol):
    """Takes alerts to notify (``notify.Notifier``); never blocks."""

    def submit(self, alerts: Sequence[Alert]) -> None: ...


class DecisionTracer(Protocol):
    """Records a tuning decision as a span (``otel.Tracing``)."""

    def record_decision(self, name: str, attributes: dict[str, str | float | int]) -> None: ...


class TuningConflict(RuntimeError):
    """The job already has an active tuning session; names it."""


class TuningUnavailable(RuntimeError):
    """A session cannot start (no live data for the job yet); says what is missing."""


@dataclass(slots=True)
class _Active:
    """One running session and what the manager knows beside it."""

    session_id: str
    job: str
    trigger: str
    session: TuningSession
    started_unix_s: float
    command_id: str | None = None  # the config command awaiting its acknowledgement
    trial_commands: dict[int, str] = field(default_factory=dict)
    counted: set[int] = field(default_factory=set)  # trials already in trials_total


class TuningManager:
    """Runs tuning sessions for the aggregator's jobs, at most one active per job.

    ``settings`` and ``space`` are the defaults of every session (a session may
    override ``max_trials`` and pin knobs); ``seed`` makes proposals repeatable (a
    session's own seed is derived from it and the session id when None). Their
    ``retune`` says when a job whose session finished is tuned again because its
    throughput drifted from what the session verified (``enabled=False``: never).
    """

    def __init__(
        self,
        *,
        store: TuningStore,
        commands: CommandSink,
        jobs: JobView,
        notifier: AlertSink,
        tracer: DecisionTracer,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        settings: TunerSettings | None = None,
        space: SearchSpace | None = None,
        seed: int | None = None,
    ) -> None:
        self._store = store
        self._commands = commands
        self._jobs = jobs
        self._notifier = notifier
        self._tracer = tracer
        self._clock = clock
        self._drift: dict[str, DriftWatch] = {}
        self.settings = settings if settings is not None else TunerSettings()
        self.space = space if space is not None else SearchSpace()
        self.seed = seed
        self._active: dict[str, _Active] = {}
        self._ended: dict[str, _Active] = {}  # each job's last ended session (this process)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        r = registry
        trials, best, state = (
            catalogue.TUNER_TRIALS_TOTAL,
            catalogue.TUNER_BEST_SCORE,
            catalogue.TUNER_STATE,
        )
        self.m_trials = Counter(trials.family_name, trials.help, trials.labels, registry=r)
        self.m_best = Gauge(best.name, best.help, best.labels, registry=r)
        self.m_state = Gauge(state.name, state.help, state.labels, registry=r)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume this aggregator's unfinished sessions (on the loop that runs them)."""
        self._loop = asyncio.get_running_loop()
        rows = await self._store.unfinished_tuning()
        now = self._clock()
        for row in rows:
            await self._resume(row, now)

    async def aclose(self) -> None:
        """Wait for decisions being executed (sessions stay resumable in SQL)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def active(self, job: str) -> str | None:
        """The id of ``job``'s active session, if any."""
        entry = self._active.get(job)
        return entry.session_id if entry is not None else None

    def session(self, job: str) -> TuningSession | None:
        """``job``'s active session, else the last one that ended in this process.

        Read-only use (progress displays, the demo's summary): the manager drives it.
        """
        entry = self._active.get(job) or self._ended.get(job)
        return entry.session if entry is not None else None

    async def abort_session(self, job: str, reason: str, *, restore: bool = True) -> bool:
        """Abort ``job``'s active session (stored, notified); False if it has none.

        ``restore=False`` skips pushing the incumbent config back, for a job that
        has already stopped.
        """
        entry = self._active.get(job)
        if entry is None or entry.session.done:
            return False
        decision = entry.session.abort(reason, self._clock())
        if not restore:
            decision = replace(decision, restore_config=None)
        await self._execute(entry, decision)
        return True

    # -- starting ------------------------------------------------------------------------

    async def start_session(
        self,
        job: str,
        *,
        trigger: str,
        max_trials: int | None = None,
        pinned: Iterable[str] = (),
    ) -> str:
        """Start tuning ``job``; returns the session id.

        TuningConflict when one is active; TuningUnavailable when the job has sent no
        config or DDP stats yet; TunerError names a bad ``max_trials`` or pinned knob.
        """
        self._drift.pop(job, None)  # a new session sets its own reference
        if job in self._active:
            raise TuningConflict(
                f"job {job!r} already has an active tuning session {self._active[job].session_id}"
            )
        settings = self.settings
        if max_trials is not None:
            if isinstance(max_trials, bool) or not isinstance(max_trials, int):
                raise TunerError(f"max_trials must be an integer, got {max_trials!r}")
            settings = msgspec.structs.replace(settings, max_trials=max_trials)
        space = replace(self.space, pinned=frozenset(pinned))
        baseline = self._baseline(job)
        session_id = uuid.uuid4().hex[:16]
        seed = self.seed if self.seed is not None else int(session_id[:8], 16)
        now = self._clock()
        entry = _Active(session_id, job, trigger, TuningSession(space, settings, seed=seed), now)
        self._active[job] = entry
        self._jobs.set_tuning(job, True)
        link = slowest_link(self._jobs.link_reading(job))
        decision = entry.session.start(now, baseline, link_bytes_per_s=link)
        log.info("tuning %s: session %s started (%s)", job, session_id, trigger)
        await self._execute(entry, decision)
        return session_id

    def _baseline(self, job: str) -> TrialConfig:
        config = self._jobs.job_config(job)
        if config is not None:
            return TrialConfig(
                bucket_cap_mb=config["bucket_cap_bytes"] / MIB,
                first_bucket_cap_mb=config["first_bucket_cap_bytes"] / MIB,
                codec=config["codec"],
                codec_params=dict(config["codec_params"]),
            )
        summary = self._jobs.job_summary(job)
        cap_bytes = summary["bucket_cap_bytes"] if summary is not None else None
        if cap_bytes is None:
            raise TuningUnavailable(
                f"no config or DDP stats from job {job!r} yet; start tuning once it trains"
            )
        # The job runs its config version 0, which the probe does not report: DDP's own
        # bucket cap with torch's default first bucket and no codec.
        cap = cap_bytes / MIB
        return TrialConfig(cap, min(cap, _TORCH_FIRST_BUCKET_MB))

    def on_alert(self, alert: Alert) -> None:
        """The ``autotune`` action of a firing alert: tune its job unless already tuning."""
        job = alert.job
        if not job or job in self._active:
            return
        self._spawn(self._start_from_alert(job, alert.rule))

    async def _start_from_alert(self, job: str, rule: str) -> None:
        try:
            await self.start_session(job, trigger=f"alert: {rule}")
        except (TuningConflict, TuningUnavailable, TunerError) as exc:
            log.warning("tuning %s not started by %s: %s", job, rule, exc)

    # -- events --------------------------------------------------------------------------

    def observe(self, stored: Stored) -> None:
        """Rank 0's steps of each ingest, in order (called on the loop after storage)."""
        now = self._clock()
        for batch, _node in stored.batches:
            if batch.rank != 0 or not self._jobs.of_latest_run(batch.job, batch.session):
                continue  # a session tunes the job's latest run, which takes its configs
            entry = self._active.get(batch.job)
            if entry is None:
                self._watch_drift(batch.job, batch.steps, now)
                continue
            if entry.session.wants_link:
                entry.session.observe_link(slowest_link(self._jobs.link_reading(batch.job)))
            for record in batch.steps:
                decision = entry.session.on_step(StepSample.from_record(record), now)
                if decision is not None or entry.session.done:
                    self._after(entry, decision)
                    if entry.session.done:
                        break

    def _watch_drift(self, job: str, steps: Iterable[StepRecord], now: float) -> None:
        watch = self._drift.get(job)
        if watch is None:
            return
        for record in steps:
            why = watch.observe(StepSample.from_record(record), now)
            if watch.stopped:
                del self._drift[job]
                return
            if why is not None:
                del self._drift[job]
                log.info("tuning %s again: %s", job, why)
                self._spawn(self._start_from_drift(job, why))
                return

    async def _start_from_drift(self, job: str, why: str) -> None:
        try:
            await self.start_session(job, trigger=f"drift: {why}")
        except (TuningConflict, TuningUnavailable, TunerError) as exc:
            log.warning("tuning %s not restarted on drift: %s", job, exc)

    def drift_watch(self, job: str) -> DriftWatch | None:
        """The watch on ``job``'s throughput since its last session finished, if any."""
        return self._drift.get(job)

    async def tick(self) -> None:
        """The evaluation tick: timeouts of every active session."""
        now = self._clock()
        for entry in list(self._active.values()):
            decision = entry.session.on_timeout(now)
            if decision is not None:
                await self._execute(entry, decision)

    def on_command_status(self, status: CommandStatus) -> None:
        """The command book's hook (any thread): hand final statuses to the loop."""
        if not status.done or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._on_command, status)
        except RuntimeError:  # the loop is closed: the aggregator is gone
            return

    def _on_command(self, status: CommandStatus) -> None:
        entry = self._active.get(status.command.job)
        if entry is None or status.command.id != entry.command_id:
            return
        entry.command_id = None
        now = self._clock()
        if status.status == "applied" and status.version is not None:
            step = status.effective_step if status.effective_step is not None else 0
            decision = entry.session.on_applied(status.version, step, now)
        else:
            decision = entry.session.on_rejected(status.reason or status.status, now)
        self._after(entry, decision)

    # -- executing decisions -------------------------------------------------------------

    def _after(self, entry: _Active, decision: Decision | None) -> None:
        """From synchronous code: execute ``decision`` (or just persist) in order."""
        self._spawn(self._execute(entry, decision))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("tuning task failed", exc_info=task.exception())

    async def _execute(self, entry: _Active, decision: Decision | None) -> None:
        async with self._lock:
            await self._execute_locked(entry, decision)

    async def _execute_locked(self, entry: _Active, decision: Decision | None) -> None:
        job, session = entry.job, entry.session
        if decision is not None:
            self._trace(entry, decision)
        if isinstance(decision, ApplyConfig):
            await self._push(entry, decision)
        elif isinstance(decision, Finish):
            log.info("tuning %s finished: %s", job, decision.summary)
            self._notify(entry, decision.summary, "info")
            self._start_watch(entry, decision)
        elif isinstance(decision, Abort):
            log.warning("tuning %s aborted: %s", job, decision.reason)
            if decision.restore_config is not None:
                try:
                    await self._commands.submit_command(
                        job, "config", decision.restore_config.args()
                    )
                except CommandError as exc:
                    log.error("tuning %s: could not restore the config: %s", job, exc)
            self._notify(entry, session.summary(), "warning")
        self._update_metrics(entry)
        await self._store.save_tuning(*_rows(entry, session.to_state()))
        if session.done and self._active.get(job) is entry:
            del self._active[job]
            self._jobs.set_tuning(job, False)
            self._ended[job] = entry

    def _start_watch(self, entry: _Active, decision: Finish) -> None:
        """After a finished session: watch for drift from the windows it stood by."""
        retune = self.settings.retune
        if not retune.enabled:
            return
        trials = entry.session.trials
        reference = trials[-1] if decision.changed else trials[0]
        if len(reference.windows) < 2:
            return
        now = self._clock()
        self._drift[entry.job] = DriftWatch(reference.windows, entry.session.unit, now, retune)

    async def _push(self, entry: _Active, decision: ApplyConfig) -> None:
        try:
            status = await self._commands.submit_command(entry.job, "config", decision.args)
        except CommandError as exc:
            follow = entry.session.on_rejected(str(exc), self._clock())
            if follow is not None:
                # Recursion is bounded: the session concludes after max_failures refusals.
                self._trace(entry, follow)
                if isinstance(follow, ApplyConfig):
                    await self._push(entry, follow)
                else:
                    self._after(entry, follow)
            return
        # No await since the command was queued: its acknowledgement, marshalled onto
        # the loop, cannot be handled before this id is known.
        entry.command_id = status.command.id
        if decision.trial_index is not None:
            entry.trial_commands[decision.trial_index] = status.command.id

    def _trace(self, entry: _Active, decision: Decision) -> None:
        attributes: dict[str, str | float | int] = {
            "torshmon.job": entry.job,
            "torshmon.tuning.session": entry.session_id,
        }
        name: str
        if isinstance(decision, ApplyConfig):
            name = decision.purpose
            attributes["torshmon.tuning.reason"] = decision.reason
            attributes["torshmon.tuning.config"] = decision.config.describe()
            if decision.trial_index is not None:
                attributes["torshmon.tuning.trial"] = decision.trial_index
        elif isinstance(decision, Finish):
            name = "finish"
            attributes["torshmon.tuning.summary"] = decision.summary
            attributes["torshmon.tuning.changed"] = int(decision.changed)
            if decision.best_score is not None:
                attributes["torshmon.tuning.best_score"] = decision.best_score
        else:
            name = "abort"
            attributes["torshmon.tuning.reason"] = decision.reason
        self._tracer.record_decision(name, attributes)

    def _notify(self, entry: _Active, summary: str, severity: str) -> None:
        now = self._clock()
        labels = {"alertname": alert_name(FINISHED_RULE), "severity": severity, "job": entry.job}
        alert = Alert(
            rule=FINISHED_RULE,
            state="firing",
            severity=severity,
            labels=labels,
            annotations={
                "summary": f"autotune of {entry.job}: {summary}",
                "description": entry.session.reason,
            },
            value=None,
            starts_at_unix_s=now,
            actions=("notify",),
            # One notification per session, not per job: sessions repeat.
            fingerprint=f"tune-{entry.session_id}",
        )
        self._notifier.submit([alert])

    def _update_metrics(self, entry: _Active) -> None:
        session, job = entry.session, entry.job
        for trial in session.trials:
            if trial.decision is not None and trial.index not in entry.counted:
                entry.counted.add(trial.index)
                self.m_trials.labels(job, trial.decision).inc()
        best = session.best
        if best is not None and best.score is not None:
            self.m_best.labels(job).set(best.score)
        for phase in PHASES:
            self.m_state.labels(job, phase).set(1.0 if phase == session.phase else 0.0)

    async def _resume(self, row: TuningSessionRow, now: float) -> None:
        job, session_id = row.job, row.id
        try:
            session = TuningSession.from_state(dict(row.state_blob))
        except TunerError as exc:
            log.error("tuning %s: session %s cannot be resumed: %s", job, session_id, exc)
            await self._store.abort_tuning(session_id, f"not resumable: {exc}", now)
            return
        previous = self._active.get(job)
        if previous is not None:
            # Only one session per job: the newer one (rows come oldest first) wins.
            reason = f"superseded by session {session_id} on resume"
            await self._store.abort_tuning(previous.session_id, reason, now)
        session.resume(now)
        entry = _Active(session_id, job, row.trigger, session, row.started_unix_s)
        entry.counted = {t.index for t in session.trials if t.decision is not None}
        self._active[job] = entry
        self._jobs.set_tuning(job, True)
        log.info("tuning %s: resumed session %s in phase %s", job, session_id, session.phase)
        pending = session.pending
        if pending is not None:
            # The command book died with the old process, so that command's answer
            # would never be routed: ask again (the probe keeps equal caps as they are).
            await self._execute(entry, pending)
        else:
            await self._execute(entry, None)


def _rows(entry: _Active, state: dict[str, Any]) -> tuple[TuningSessionRow, list[TuningTrialRow]]:
    """The stored rows of ``entry``'s session (``state``: its ``to_state()``) and trials."""
    session = entry.session
    baseline = session.baseline
    best = session.best
    best_config = session.final_config or (best.config if best is not None else baseline)
    trials = session.trials
    row = TuningSessionRow(
        id=entry.session_id,
        job=entry.job,
        state=session.phase,
        trigger=entry.trigger[:200],
        started_unix_s=entry.started_unix_s,
        ended_unix_s=state.get("ended_unix_s"),
        baseline_config=baseline.to_dict() if baseline is not None else {},
        best_config=best_config.to_dict() if best_config is not None else None,
        baseline_score=trials[0].score if trials else None,
        best_score=session.best_score,
        reason=session.reason,
        state_blob=state,
    )
    return row, [_trial_row(entry, trial) for trial in trials]


def _trial_row(entry: _Active, trial: Trial) -> TuningTrialRow:
    return TuningTrialRow(
        session_id=entry.session_id,
        job=entry.job,
        trial_index=trial.index,
        config=trial.config.to_dict(),
        command_id=entry.trial_commands.get(trial.index),
        state=trial.state,
        windows=list(trial.windows),
        score=trial.score,
        decision=trial.decision,
        reason=trial.reason,
        started_unix_s=trial.started_unix_s,
        ended_unix_s=trial.ended_unix_s,
    )
