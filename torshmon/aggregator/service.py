"""``torshmon aggregator``: the HTTP service around ingest, detection, rules and history.

One event loop serves HTTP. Ingest is stored by the ingest process, one ordered
writer that keeps it idempotent (``torshmon.aggregator.writer``; the writer thread
instead where ``ingest_process`` is off or the database is in memory); one writer
thread owns the aggregator's other writes (alerts, findings, commands, retention);
reads run on the default executor, and users' history queries on threads and
connections of their own (``http.queries``), so a runaway query stalls none of these.
Every ``eval_interval_s``, and at once after an ingest that brought a new finding,
the evaluation tick asks the live
state for its findings, runs the rules engine, stores findings and alert
transitions, hands alerts to the notifier, which never blocks this loop, and sends
the link checks the live state asks for.

This is the one module that wires the parts: each receives the narrow things it
needs (the history store, the command sink, the live state, a registry, a clock),
never the ``Aggregator``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy.engine import make_url

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.commands import CommandBook, CommandStatus
from torshmon.aggregator.core.episodes import FindingChange, FindingEpisodes
from torshmon.aggregator.core.live import LiveState
from torshmon.aggregator.core.memory_report import memory_report
from torshmon.aggregator.core.rules import WINDOW_KINDS, RuleSet
from torshmon.aggregator.core.silences import SilenceBook
from torshmon.aggregator.core.stored import Stored
from torshmon.aggregator.dispatch import CommandDispatch
from torshmon.aggregator.evidence import EvidenceKeeper
from torshmon.aggregator.http import api, evidence_api
from torshmon.aggregator.http.alerting import add_alerting_routes
from torshmon.aggregator.http.connections import Connections
from torshmon.aggregator.http.guard import RequestGuard, ServerLog, log_rejection, read_body
from torshmon.aggregator.http.queries import QueryPool
from torshmon.aggregator.ingest import IngestStore
from torshmon.aggregator.live_metrics import LiveCollector
from torshmon.aggregator.notify import otel
from torshmon.aggregator.notify.delivery import STAT_NAMES, Notifier
from torshmon.aggregator.notify.targets import Target
from torshmon.aggregator.rule_files import default_rules, load_rules
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.aggregator.tuning_manager import TuningManager
from torshmon.aggregator.writer import (
    IngestWriter,
    ProcessIngest,
    StoreRefused,
    StoreUnavailable,
    ThreadIngest,
    tune_gc_for_daemon,
)
from torshmon.aio import wait_event
from torshmon.catalogue import metrics as catalogue
from torshmon.catalogue.metrics import MetricSpec, build_info
from torshmon.history.db import normalize_url, sqlite_path
from torshmon.history.migrate import upgrade
from torshmon.history.reader import reader_of
from torshmon.history.store import HistoryStore
from torshmon.redact import redact_url
from torshmon.report.source import HistoryReports
from torshmon.wire import (
    SCHEMA_VERSION,
    Command,
    IngestBatch,
    IngestReply,
    WireError,
    decode_json,
    encode_json,
)

log = logging.getLogger(__name__)

INGEST_PATH = "/api/v1/ingest"

#: Called with each alert transition that has the ``autotune`` action (the tuner hooks here).
ActionHook = Callable[[Alert], None]


class Aggregator:
    """The service's parts and their lifecycle: ``async with Aggregator(settings)``.

    ``registry`` receives the job-level and service metrics (a fresh one per test);
    ``targets`` overrides the notification targets of ``settings.notify``;
    ``clock`` is Unix seconds (detection and rules use it); ``tracer`` replaces the OTLP
    exporter set up from the settings (spans to memory in tests).
    """

    def __init__(
        self,
        settings: AggregatorSettings,
        *,
        registry: CollectorRegistry | None = None,
        targets: Sequence[Target] | None = None,
        rules: RuleSet | None = None,
        clock: Callable[[], float] = time.time,
        migrate: bool = True,
        tracer: otel.Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.guard = RequestGuard(settings)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._migrate = migrate
        self.rules = rules if rules is not None else self._load_rules()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torshmon-writer")
        self.store = HistoryStore(
            settings.db_url, aggregator_id=settings.aggregator_id, writer=self.writer
        )
        self.commands = CommandBook(
            timeout_s=settings.command_timeout_s, clock=clock, on_change=self._command_changed
        )
        self.alerts = AlertEngine(self.rules)
        self.live = LiveState(
            series_retention_s=_series_retention_s(self.rules, self.alerts.stale_after_s),
            series_windows_s=_series_windows_s(self.rules),
            straggler=settings.straggler,
            zscore=settings.zscore,
            hang=settings.hang,
            link_check=settings.link_check,
            anomaly_metrics={r.metric for r in self.rules if r.kind == "anomaly" and r.metric},
            collective_series=any(r.metric == "collective_duration_seconds" for r in self.rules),
        )
        self.notifier = Notifier(
            list(targets) if targets is not None else settings.notify.targets(),
            external_url=settings.external_url,
            **settings.notify.delivery(),
        )
        self._unwritten_findings: list[FindingChange] = []
        self._unwritten_alerts: list[Alert] = []
        self.silences = SilenceBook()
        #: fingerprint -> a firing alert not notified because a silence matched it
        self._held_back: dict[str, Alert] = {}
        self.tracer = (
            tracer
            if tracer is not None
            else otel.Tracing(settings.otlp_endpoint, service_instance=settings.aggregator_id)
        )
        self.ingest: IngestWriter | None = None
        #: job -> the agent that last delivered its rank 0's data (commands go there)
        self.rank0_agent: dict[str, str] = {}
        self.dispatch = CommandDispatch(self.commands, self.store, self.live, clock)
        self.command_hooks: list[Callable[[CommandStatus], None]] = [
            self.dispatch.link_check_status
        ]
        self.episodes = FindingEpisodes()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._eval_wanted = asyncio.Event()
        self._closed = False
        self._started = False
        self.port: int | None = None
        self._metrics()
        self.tuning = TuningManager(
            store=self.store,
            commands=self.dispatch,
            jobs=self.live,
            notifier=self.notifier,
            tracer=self.tracer,
            registry=self.registry,
            clock=clock,
            settings=settings.tuner,
        )
        self.command_hooks.append(self.tuning.on_command_status)
        self.evidence = EvidenceKeeper(
            settings.evidence,
            store=self.store,
            commands=self.dispatch,
            world_size=self._world_size,
            clock=clock,
        )
        self.action_hooks: dict[str, list[ActionHook]] = {
            "autotune": [self.tuning.on_alert],
            "capture_evidence": [self.evidence.on_alert],
        }

    def _world_size(self, job: str) -> int | None:
        summary = self.live.job_summary(job)
        size = None if summary is None else summary.get("world_size")
        return size if isinstance(size, int) else None

    def _load_rules(self) -> RuleSet:
        if self.settings.rules_path:
            return load_rules(self.settings.rules_path)
        return default_rules()

    def _metrics(self) -> None:
        r = self.registry
        self.m_batches = _counter(catalogue.INGEST_BATCHES_TOTAL, r)
        self.m_records = _counter(catalogue.INGEST_RECORDS_TOTAL, r)
        self.m_duplicates = _counter(catalogue.INGEST_DUPLICATES_TOTAL, r)
        self.m_silenced = _counter(catalogue.ALERTS_SILENCED_TOTAL, r)
        self.m_samples = _counter(catalogue.INGEST_SAMPLES_TOTAL, r)
        spec = catalogue.INGEST_DURATION_SECONDS
        self.m_ingest_seconds = Histogram(
            spec.name,
            spec.help,
            spec.labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=r,
        )
        r.register(
            LiveCollector(self.live, collectives_per_rank=self.settings.collective_metrics_per_rank)
        )
        r.register(_NotifierCollector(self.notifier))
        settings = self.settings
        self.connections = Connections(
            max_connections=settings.http_max_connections,
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            registry=r,
        )
        self.queries = QueryPool(
            max_running=settings.query_max_running,
            max_per_client=settings.query_max_per_client,
            registry=r,
        )

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Migrate the database, restore alert state, serve HTTP, start the loops.

        If a step fails (the port is taken, the database is unreachable) what the earlier
        steps started (the ingest process, the writer thread) is closed before the error
        is raised: a caller that never got a started aggregator has nothing to close.
        """
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        url = self.settings.db_url
        if self._migrate:
            role, password = reader_of(url, self.settings.query_db_url)
            migrate = functools.partial(upgrade, url, reader_role=role, reader_password=password)
            reader = await loop.run_in_executor(self.writer, migrate)
            if reader is not None and reader.refused:
                log.warning("history queries: %s (query_db_url)", reader.refused)
            elif reader is not None and reader.for_admin:
                log.warning(
                    "history queries connect as the reader role %s, which this database "
                    "user may not set up; an administrator should run: %s",
                    reader.role,
                    "; ".join(reader.for_admin),
                )
        self.store.open()
        if self.settings.ingest_process and _other_process_can_open(url):
            ingest = ProcessIngest(url, self.settings.aggregator_id)
            await ingest.start()
            self.ingest = ingest
        else:
            store = IngestStore(self.store.engine, aggregator_id=self.settings.aggregator_id)
            self.ingest = ThreadIngest(store, self.writer)
        await self._restore_alerts()
        for silence in await self.store.open_silences(self.clock()):
            self.silences.add(silence)
        closed = await self.store.close_open_findings(self.clock())
        if closed:
            log.info("closed %d findings left open by this aggregator's last run", closed)
        await self._restore_jobs()
        await self.tuning.start()
        await self.notifier.start()
        app = api.make_app(
            self.settings,
            guard=self.guard,
            store=self.store,
            live=self.live,
            commands=self.dispatch,
            tuning=self.tuning,
            reports=HistoryReports(lambda: self.store.engine),
            registry=self.registry,
            clock=self.clock,
            connections=self.connections,
            queries=self.queries,
        )
        add_alerting_routes(
            app,
            guard=self.guard,
            store=self.store,
            book=self.silences,
            clock=self.clock,
            max_body_bytes=self.settings.max_body_bytes,
            changed=self._silences_changed,
        )
        app.router.add_post(INGEST_PATH, self._ingest)
        evidence_api.add_routes(
            app,
            guard=self.guard,
            store=self.store,
            keeper=self.evidence,
            max_body_bytes=self.settings.max_body_bytes,
        )
        # Bodies are inflated by read_body, which answers a broken or unknown content
        # coding with a 4xx; aiohttp's own inflating logs them as unhandled errors.
        # ServerLog keeps aiohttp's 400s for malformed HTTP out of the error log.
        # aiohttp closes idle kept-alive connections; Connections bounds the rest.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            auto_decompress=False,
            logger=ServerLog(),
            keepalive_timeout=self.settings.http_idle_timeout_s,
        )
        await self._runner.setup()
        site = self.connections.site(self._runner, self.settings.host, self.settings.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        if self.settings.external_url == f"http://{self.settings.host}:0":
            # Derived from port 0 (any free port): messages link to the port it got.
            self.notifier.set_external_url(f"http://{self.settings.host}:{self.port}")
        self._tasks = [
            asyncio.create_task(self._evaluate_forever(), name="aggregator-evaluate"),
            asyncio.create_task(self._retention_forever(), name="aggregator-retention"),
        ]
        self._started = True
        if self.settings.token is None:  # where() says so too, on the start line
            log.info("no token configured: the API accepts unauthenticated requests")
        log.info("aggregator %s started", self.settings.aggregator_id)

    def where(self) -> str:
        """Where it listens and stores, for the start line: ``listening on
        http://127.0.0.1:9470, history in sqlite:////abs/torshmon.db`` (no password)."""
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        history = redact_url(self.settings.db_url)
        line = f"listening on http://{host}:{self.port}, history in {history}"
        if self.settings.token is None:
            line += " (no token: the API accepts unauthenticated requests)"
        return line

    async def aclose(self) -> None:
        """Stop serving, run a last evaluation, flush notifications, close the database."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The loop over parts is deliberate: one failing must not leave the rest running.
        # Queries first: the server waits for the answers in progress, and an interrupted
        # query answers at once where a runaway one would hold it to its timeout.
        parts = (
            self.queries.aclose,
            self._close_http,
            self._last_evaluation,
            self.tuning.aclose,
            self.evidence.aclose,
            self.notifier.aclose,
        )
        for part in parts:
            try:
                await part()
            except Exception as exc:  # reported together below
                errors.append(exc)
        if self.ingest is not None:
            try:
                await self.ingest.aclose()
            except Exception as exc:
                errors.append(exc)
        self.writer.shutdown(wait=True)
        self.tracer.shutdown()
        self.store.close()
        for error in errors:
            log.error("aggregator shutdown step failed: %s", error)

    async def __aenter__(self) -> Aggregator:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _close_http(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _last_evaluation(self) -> None:
        if self._started:
            await self.evaluate()

    # -- ingest --------------------------------------------------------------------------
    async def _ingest(self, request: web.Request) -> web.Response:
        if not self.guard.authorized(request.headers):
            self.m_batches.labels("unauthorized").inc()
            return api.error(401, "missing or wrong bearer token")
        try:
            body = await read_body(request, self.settings.max_body_bytes)
        except web.HTTPException as exc:
            self.m_batches.labels("invalid").inc()
            log_rejection(request, exc.text or exc.reason)
            raise
        try:
            batch = decode_json(body, IngestBatch)
        except WireError as exc:
            self.m_batches.labels("invalid").inc()
            log_rejection(request, str(exc))
            return api.error(400, str(exc))
        if self.ingest is None:
            return api.error(503, "the aggregator is starting or stopping; retry later")
        started = time.perf_counter()
        handed = self._hand_out(batch)
        try:
            stored = await self.ingest.store(body, batch, handed)
        except BaseException as exc:
            self.commands.release([c.id for c in handed])
            self.commands.unfan(batch.agent_id, [c.id for c in handed])
            if isinstance(exc, StoreRefused):
                self.m_batches.labels("invalid").inc()
                return api.error(400, str(exc))
            if isinstance(exc, StoreUnavailable):
                self.m_batches.labels("unavailable").inc()
                log.error("%s", exc)
                return api.error(503, "history database unavailable; retry later")
            raise
        self.m_ingest_seconds.observe(time.perf_counter() - started)
        if stored.commands:
            self.commands.sent([c.id for c in stored.commands])
        for ack in stored.command_acks:
            self.commands.acked(ack)
        self.m_batches.labels("stored").inc()
        self.m_records.inc(stored.records)
        self.m_duplicates.inc(stored.duplicates)
        self.m_samples.inc(stored.samples)
        self._observe(stored, batch.node)
        await self.evidence.receive(batch)
        if self.live.take_fresh() and self.settings.eval_on_finding:
            self._eval_wanted.set()
        reply = IngestReply(v=SCHEMA_VERSION, acked_seq=stored.acked_seq, commands=stored.commands)
        return web.Response(body=encode_json(reply), content_type="application/json")

    def _hand_out(self, batch: IngestBatch) -> list[Command]:
        """The pending commands that go back to the agent posting ``batch``: those of
        the jobs whose rank 0 it serves (reserved until its store commits or fails), and
        the fan-out commands (evidence) of every job it brought data of."""
        agent = batch.agent_id
        served: set[str] = set()
        for item in batch.records:
            for message in item.record.messages:
                served.add(message.job)
                if message.rank == 0:
                    self.rank0_agent[message.job] = agent
        jobs = [job for job, a in self.rank0_agent.items() if a == agent]
        handed = self.commands.reserve(jobs) if jobs else []
        return handed + self.commands.fan_out(agent, sorted(served)) if served else handed

    def _observe(self, stored: Stored, agent_node: str) -> None:
        """Feed the live state; a bug there must never fail an ingest already stored."""
        try:
            self.live.observe(stored, self.clock(), agent_node)
            self.tracer.record_steps(stored)
        except Exception:
            log.exception("live state update failed; the data is stored")
        try:
            self.tuning.observe(stored)
        except Exception:
            log.exception("autotuner update failed; the data is stored")

    # -- evaluation ----------------------------------------------------------------------
    async def _evaluate_forever(self) -> None:
        """Evaluate every ``eval_interval_s``, and at once when an ingest brought a new
        finding (an alert then costs no timer wait). Early evaluations keep a gap of at
        least ``eval_min_gap_s`` and of the last evaluation's own duration, so a storm
        of findings can take at most half of the loop."""
        settings = self.settings
        gap = 0.0
        while True:
            await wait_event(self._eval_wanted, max(0.0, settings.eval_interval_s - gap))
            self._eval_wanted.clear()
            started = time.perf_counter()
            try:
                await self.evaluate()
            except Exception:
                log.exception("evaluation failed; retrying next tick")
            gap = max(settings.eval_min_gap_s, time.perf_counter() - started)
            await asyncio.sleep(gap)

    async def evaluate(self) -> list[Alert]:
        """One evaluation tick: findings, rules, storage, notifications. Returns transitions."""
        now = self.clock()
        findings = self.live.findings(now)
        transitions = [
            self._recommend_memory(a)
            for a in self.alerts.evaluate(
                now, self.live.series, findings, self.live.config_switches(), self.live.runs()
            )
        ]
        # An open alert's stored text follows its figures; only transitions notify.
        revised = [self._recommend_memory(a) for a in self.alerts.revised(now)]
        episodes = self.episodes.evaluate(findings, now)
        self.live.set_alerts(self.alerts.active())
        # Transitions happen once: if their write fails they are kept and written with the
        # next tick's, and notifications and actions below still go out now.
        self._unwritten_findings += episodes
        self._unwritten_alerts += transitions
        if self._unwritten_findings or self._unwritten_alerts or revised:
            try:
                await self.store.record(
                    self._unwritten_findings, self._unwritten_alerts, now, revised
                )
            except Exception:
                log.exception("storing findings and alert transitions failed; retrying next tick")
            else:
                self._unwritten_findings, self._unwritten_alerts = [], []
        to_send = self._unsilenced([a for a in transitions if "notify" in a.actions], now)
        if to_send:
            self.notifier.submit(to_send)
        for alert in transitions:
            self.tracer.record_alert(alert)
            if alert.state == "firing":
                for action in alert.actions:
                    for hook in self.action_hooks.get(action, ()):
                        try:
                            hook(alert)
                        except Exception:
                            log.exception("action %s failed for %s", action, alert.rule)
        await self.dispatch.expire()
        await self.dispatch.send_link_checks(now)
        try:
            await self.tuning.tick()
        except Exception:
            log.exception("autotuner tick failed")
        self.live.expire(now)
        return transitions

    def _unsilenced(self, alerts: list[Alert], now: float) -> list[Alert]:
        """Of ``alerts`` (to notify), those no active silence matches, plus the firing
        alerts a silence held back that are no longer silenced (told late rather than
        never). A silenced alert's resolution is not told either, nor is the resolution of
        one whose firing was held back: its people never heard it fire."""
        self.silences.prune(now)
        out: list[Alert] = []
        for alert in alerts:
            if self.silences.silencing(alert.labels, now):
                self._held_back.pop(alert.fingerprint, None)
                if alert.state == "firing":
                    self._held_back[alert.fingerprint] = alert
                self.m_silenced.labels(alertname=alert.rule).inc()
            elif alert.state == "resolved" and alert.fingerprint in self._held_back:
                del self._held_back[alert.fingerprint]
                continue
            else:
                out.append(alert)
        if self._held_back:
            firing = {a.fingerprint for a in self.alerts.active() if a.state == "firing"}
            for fingerprint, alert in list(self._held_back.items()):
                if fingerprint not in firing:
                    del self._held_back[fingerprint]
                elif not self.silences.silencing(alert.labels, now):
                    del self._held_back[fingerprint]
                    out.append(alert)
        return out

    def _silences_changed(self) -> None:
        """A silence was added or expired: evaluate soon, so what it releases goes out."""
        self._eval_wanted.set()

    def _recommend_memory(self, alert: Alert) -> Alert:
        """``alert`` as it fires, with the ``recommend_memory`` action's message (how the
        memory of the ranks it concerns grew, step by step) as its description."""
        if alert.state != "firing" or "recommend_memory" not in alert.actions:
            return alert
        try:
            text = memory_report(*self.live.memory_history(alert.labels))
        except Exception:
            log.exception("memory recommendation failed for %s", alert.rule)
            return alert
        if not text:
            return alert
        description = alert.annotations.get("description", "")
        annotations = {**alert.annotations, "description": f"{description}\n{text}".strip()}
        return dataclasses.replace(alert, annotations=annotations)

    async def _restore_alerts(self) -> None:
        """Resume pending and firing alerts this aggregator left in SQL."""
        alerts = await self.store.open_alerts()
        if alerts:
            self.alerts.restore(alerts)
            log.info("resumed %d pending or firing alerts", len(alerts))

    async def _restore_jobs(self) -> None:
        """Give the live state the world size of the jobs this aggregator served until it
        stopped (and that were not idle yet): their probes will not say hello again."""
        jobs = await self.store.running_jobs(self.clock() - self.live.idle_s)
        for job in jobs:
            self.live.restore_job(job.job, job.world_size, job.last_seen_unix_s, job.run_id)
        if jobs:
            log.info("resumed %d running jobs from the history", len(jobs))

    # -- commands ------------------------------------------------------------------------
    def _command_changed(self, status: CommandStatus) -> None:
        for hook in self.command_hooks:
            try:
                hook(status)
            except Exception:
                log.exception("command hook failed")

    # -- retention -----------------------------------------------------------------------
    async def _retention_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.retention_interval_s)
            try:
                await self.store.apply_retention(
                    self.clock(),
                    raw_retention_s=self.settings.raw_retention_s,
                    rollup_retention_s=self.settings.rollup_retention_s,
                )
                await self.evidence.prune(self.clock())
            except Exception:
                log.exception("retention failed; retrying next interval")


def _other_process_can_open(url: str) -> bool:
    """Whether an ingest process can open the database at ``url``: not so for an
    in-memory SQLite database (nor a ``file:`` URI, which may name one)."""
    return make_url(normalize_url(url)).get_backend_name() != "sqlite" or (
        sqlite_path(url) is not None
    )


def _series_retention_s(rules: RuleSet, stale_after_s: float) -> float:
    """How long live series must keep points for ``rules``: the longest rate window,
    absent duration or staleness bound, plus a minute. Older points are only in SQL."""
    needed = [stale_after_s]
    needed += [r.window_s for r in rules if r.kind in ("rate", "increase")]
    needed += [r.for_s for r in rules if r.kind == "absent"]
    return max(needed) + 60.0


def _series_windows_s(rules: RuleSet) -> dict[str, float]:
    """The metrics whose points ``rules`` read (rate, increase and non-finite rules), each with its
    longest window plus a minute; the rules read only the newest point of the others."""
    windows: dict[str, float] = {}
    for rule in rules:
        if rule.kind in WINDOW_KINDS and rule.metric:
            windows[rule.metric] = max(windows.get(rule.metric, 0.0), rule.window_s + 60.0)
    return windows


class _NotifierCollector:
    """Exports the notifier's per-target counters (``notify.STAT_NAMES``)."""

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    def collect(self) -> Iterator[Metric]:
        stats = self._notifier.stats()
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for stat in STAT_NAMES:
            spec = catalogue.METRICS[f"torshmon_notifications_{stat}"]
            families[stat] = spec.counter() if spec.kind == "counter" else spec.gauge()
        for target, counts in stats.items():
            for stat, family in families.items():
                family.add_metric([target], float(counts.get(stat, 0)))
        yield from families.values()
        # Here rather than in a collector of its own: one family, and the notifier's
        # collector is the service's own already.
        yield build_info("aggregator")


def _counter(spec: MetricSpec, registry: CollectorRegistry) -> Counter:
    return Counter(spec.family_name, spec.help, spec.labels, registry=registry)


async def run_aggregator(
    settings: AggregatorSettings, *, announce: Callable[[str], None] | None = None
) -> int:
    """Run until SIGTERM or SIGINT; returns the exit code. ``announce`` gets one line
    once it serves, saying where it listens and stores."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with Aggregator(settings) as aggregator:
        if announce is not None:
            announce(f"torshmon aggregator {aggregator.where()}")
        tune_gc_for_daemon()
        await stop.wait()
        log.info("aggregator stopping")
    return 0
