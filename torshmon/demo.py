"""``torshmon demo``: the whole system on one machine.

An aggregator (SQLite history, detection, alert rules, API on a loopback port)
and an agent (probe socket, spool, forwarding) run in this process; a real
multi-process gloo DDP job trains an MLP with the probe attached. The demo drives
them as any user would: progress and tuning go through the aggregator's HTTP API
(as ``torshmon tune`` does) and the summary at the end comes from the SQL history
(as ``torshmon query`` reads it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from torshmon.faults import Fault, FaultRunner
from torshmon.launch import run_ranks

if TYPE_CHECKING:
    import aiohttp

    from torshmon.aggregator.core.tuner import Trial, TunerSettings, TuningSession
    from torshmon.aggregator.service import Aggregator
    from torshmon.linkshape import LinkShaper

log = logging.getLogger(__name__)

#: The environment of the demo's ranks, unless the user's sets these: torch's profiler
#: (kineto) logs a line to stderr as each evidence capture starts and stops, and
#: libraries' Python warnings would interleave with the progress lines.
QUIET_RANKS: Final[Mapping[str, str]] = {"KINETO_LOG_LEVEL": "6", "PYTHONWARNINGS": "ignore"}

#: The demo clips the gradient norm (a common guard), so one corrupted batch cannot
#: wreck the model for every rank (see the loss-spike fault).
GRAD_CLIP_NORM = 1.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo runs; sizes in elements. ``db`` is the SQLite history file.

    ``port`` is the aggregator's HTTP port and ``agent_metrics_port`` the agent's
    ``/metrics`` port (0: any free port). ``bucket_timing`` attaches the probe with
    ``bucket_timing=True``: every DDP bucket all-reduce is timed and reported as a
    collective, not only while a codec runs.
    """

    world_size: int = 2
    steps: int = 200
    hidden: int = 1024
    layers: int = 4
    batch_size: int = 64
    job: str = "demo"
    #: The history: a SQLite file path or a ``sqlite:///PATH`` URL.
    db: Path | str = Path("torshmon.db")
    port: int = 0
    agent_metrics_port: int = 0
    bucket_timing: bool = False
    faults: tuple[Fault, ...] = ()
    #: A pause between steps (outside ``mon.step()``): the probe measures it as input
    #: wait, as it would a slow data loader.
    step_sleep_s: float = 0.0
    #: Work of the job's own inside each step beyond the model's (a sleep after the
    #: optimizer step): real steps take 0.1-1 s, the demo's model a few ms.
    step_compute_s: float = 0.0
    linger_s: float = 0.0
    #: When set, the job may end before ``steps``: every 10 steps the ranks agree (an
    #: all-reduce MAX) whether this file exists, and all stop at the same step if it does.
    stop_file: str | None = None
    #: Where ranks leave a file when a fault that acts outside them (a slow link) starts
    #: or stops (``FaultRunner.signal_dir``); run_system sets it for such faults.
    signal_dir: str | None = None
    quiet: bool = False
    env: dict[str, str] = field(default_factory=dict)
    #: Per-rank link rate, e.g. ``"1gbit"`` (``linkshape.parse_rate`` units): the ranks
    #: then run in network namespaces over tbf-shaped links (needs root and iproute2).
    link_rate: str | None = None
    #: The job's time limit (``launch.run_ranks``); every rank is stopped past it.
    timeout_s: float = 3600.0
    #: Tune the job (``POST /api/v1/jobs/{job}/tune``, as ``torshmon tune`` does) once it
    #: trains; the job stops soon after the session ends (``steps`` stays an upper bound).
    autotune: bool = False
    #: Configs the session measures, the baseline included (None: the tuner's default).
    tune_max_trials: int | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "steps", "hidden", "layers", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.link_rate is not None:
            from torshmon.linkshape import parse_rate

            try:
                parse_rate(self.link_rate)
            except ValueError as exc:
                raise ValueError(f"link_rate: {exc}") from None
        if self.tune_max_trials is not None and self.tune_max_trials < 2:
            raise ValueError(f"tune_max_trials must be >= 2, got {self.tune_max_trials}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.db_url.startswith("sqlite:///"):
            # Its summary queries the history as the aggregator's own user, which
            # PostgreSQL's reader-role check refuses; one machine needs no server.
            raise ValueError(
                f"--db {self.db}: the demo keeps its history in SQLite; give a file path "
                "or sqlite:///PATH"
            )
        for fault in self.faults:
            if fault.rank is not None and fault.rank >= self.world_size:
                raise ValueError(
                    f"fault {fault.describe()} names rank {fault.rank}, "
                    f"but the job has ranks 0..{self.world_size - 1}"
                )

    @property
    def model_bytes(self) -> int:
        per_layer = self.hidden * self.hidden + self.hidden
        return 4 * self.layers * per_layer

    @property
    def db_url(self) -> str:
        """``db`` as an absolute URL (``history.db.as_db_url``)."""
        from torshmon.history.db import as_db_url

        return as_db_url(str(self.db))


def train_rank(
    rank: int, world_size: int, config: DemoConfig, socket_path: str
) -> dict[str, float]:
    """One rank of the demo job: DDP over an MLP, the probe attached."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import torshmon

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(config.layers):
        layers += [torch.nn.Linear(config.hidden, config.hidden), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + rank)
    target = torch.randn(config.hidden, config.hidden, generator=generator) / config.hidden**0.5
    monitor = torshmon.attach(
        model, job=config.job, agent_socket=socket_path, bucket_timing=config.bucket_timing
    )
    faults = FaultRunner(rank, config.faults, signal_dir=config.signal_dir)
    loss = torch.zeros(())
    try:
        for step in range(config.steps):
            x = torch.randn(config.batch_size, config.hidden, generator=generator)
            faults.before_step(step + 1)
            with monitor.step(batch_size=config.batch_size) as scope:
                faults.begin_step(step + 1)  # the probe numbers steps from 1
                x, y = faults.batch(step + 1, x, x @ target)
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # As a loss scaler does: gradients are all-reduced, so every rank sees the
                # same norm and skips the same steps; clipping bounds what one bad batch does.
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
                if torch.isfinite(norm):
                    optimizer.step()
                if config.step_compute_s:
                    time.sleep(config.step_compute_s)
                faults.end_compute(step + 1)
                scope.loss = loss
            if config.step_sleep_s:
                time.sleep(config.step_sleep_s)
            if config.stop_file is not None and step % 10 == 9 and _agree_to_stop(config.stop_file):
                break
    finally:
        monitor.close()
    return {
        "final_loss": loss.item(),
        "dropped": float(monitor.dropped_records_total),
        **faults.events,
    }


def _agree_to_stop(path: str) -> bool:
    """True on every rank once any rank sees ``path``: all ranks stop at the same step."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if os.path.exists(path) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


@dataclass(slots=True)
class DemoResult:
    """What a demo run produced (for tests and the summary)."""

    wall_s: float
    results: list[dict[str, float]]
    alerts: list[dict[str, Any]]
    port: int
    db_url: str
    #: The demo's tuning session (``config.autotune``), ended or not; None without one.
    tuning: TuningSession | None = None
    #: When faults applied from outside the ranks (slow links) started and stopped,
    #: keyed as ``FaultRunner.events`` are.
    fault_events: dict[str, float] = field(default_factory=dict)


#: ``on_tick(aggregator, shaper)``: called on the event loop every ``tick_s`` while the job
#: runs; ``shaper`` is the running LinkShaper (None without ``link_rate``), so a hook can
#: change link rates mid-run (``shaper.set_rate("100mbit", rank=1)``; tc runs for a few
#: tens of ms, on the loop). A hook must not raise: an exception ends the demo. The
#: hooks are seams for tests that watch the running aggregator; the demo itself goes
#: through the HTTP API.
TickHook = Callable[["Aggregator", "LinkShaper | None"], None]
#: ``on_progress(aggregator)``: called every ``progress_s`` while the job runs.
ProgressHook = Callable[["Aggregator"], None]
#: ``on_line(text)``: a line for people (progress, tuning trials), as the demo prints them.
LineHook = Callable[[str], None]


async def run_system(
    config: DemoConfig,
    *,
    targets: Sequence[Any] | None = None,
    on_progress: ProgressHook | None = None,
    progress_s: float = 1.0,
    on_tick: TickHook | None = None,
    tick_s: float = 0.25,
    tuner_settings: TunerSettings | None = None,
    on_line: LineHook | None = None,
) -> DemoResult:
    """Aggregator + agent + the job, to completion; everything is flushed at the end.

    With ``config.link_rate`` the ranks run inside a :class:`~torshmon.linkshape.LinkShaper`
    (built before anything else starts, removed at the end): LinkShapingUnavailable
    (no root / no iproute2) or LinkShapingError is raised before the aggregator starts.
    With ``config.autotune`` a tuning session (``tuner_settings``, else the tuner's
    defaults) starts as soon as the job reports its config; when it ends, the ranks
    stop at the next agreed step (a stop file); a session still running when the job
    reaches ``steps`` is aborted. ``on_line`` gets the progress lines (every
    ``progress_s``) and the tuning session's trials as they start and end.
    """
    import aiohttp
    from prometheus_client import CollectorRegistry

    from torshmon.agent.daemon import Agent, AgentSettings
    from torshmon.aggregator.core.tuner import TunerSettings
    from torshmon.aggregator.notify.targets import targets_from_env
    from torshmon.aggregator.service import Aggregator
    from torshmon.aggregator.settings import AggregatorSettings

    if not (progress_s > 0 and tick_s > 0):
        raise ValueError(f"progress_s and tick_s must be > 0, got {progress_s} and {tick_s}")
    token = secrets.token_hex(16)
    started = time.monotonic()
    shaper = _start_shaper(config)
    try:
        with tempfile.TemporaryDirectory(prefix="torshmon-demo-") as tmp:
            if config.autotune and config.stop_file is None:
                config = replace(config, stop_file=os.path.join(tmp, "stop"))
            links = _SlowLinks(config, tmp) if _slow_links(config) else None
            if links is not None:
                config = replace(config, signal_dir=links.signal_dir)
            autotune = _Autotune(config) if config.autotune else None
            settings = AggregatorSettings(
                port=config.port,
                db_url=config.db_url,
                token=token,
                aggregator_id="demo",
                tuner=tuner_settings if tuner_settings is not None else TunerSettings(),
            )
            async with (
                Aggregator(
                    settings,
                    registry=CollectorRegistry(),
                    # As before settings held targets: the demo notifies the TORSHMON_* ones.
                    targets=targets if targets is not None else targets_from_env(),
                ) as aggregator,
                aiohttp.ClientSession() as http,
            ):
                port = aggregator.port or 0
                api = ApiClient(http, f"http://127.0.0.1:{port}", token)
                if on_line is not None:
                    on_line(page_line(port, config.job, token))
                watch = _Watch(api, config, on_line)
                agent_settings = AgentSettings(
                    socket_path=os.path.join(tmp, "agent.sock"),
                    metrics_port=config.agent_metrics_port,
                    aggregator_url=f"http://127.0.0.1:{port}",
                    token=token,
                    spool_path=os.path.join(tmp, "spool.db"),
                    sample_interval_s=1.0,
                )
                async with Agent(agent_settings, registry=CollectorRegistry()):
                    job = asyncio.ensure_future(
                        asyncio.to_thread(_launch, shaper, config, agent_settings.socket_path)
                    )
                    next_progress = time.monotonic() + progress_s
                    while not job.done():
                        await asyncio.wait({job}, timeout=tick_s)
                        if job.done():
                            break
                        if autotune is not None:
                            await autotune.tick(api)
                            await watch.tuning(autotune.session)
                        if links is not None and shaper is not None:
                            await asyncio.to_thread(links.tick, shaper)
                        if on_tick is not None:
                            on_tick(aggregator, shaper)
                        if time.monotonic() >= next_progress:
                            next_progress += progress_s
                            await watch.progress()
                            if on_progress is not None:
                                on_progress(aggregator)
                    results = job.result()
                    if config.linger_s:
                        await asyncio.sleep(config.linger_s)
                    if autotune is not None:
                        await autotune.close(api)
            # The agent flushed its spool on close and the aggregator ran a last
            # evaluation on its own: the history now holds everything that arrived.
            alerts = await asyncio.to_thread(_alert_rows, config.db_url, config.job)
            tuning = None
            if autotune is not None and autotune.session_id is not None:
                tuning = await asyncio.to_thread(
                    _stored_session, config.db_url, autotune.session_id
                )
    finally:
        if shaper is not None:
            shaper.close()
    return DemoResult(
        time.monotonic() - started,
        results,
        alerts,
        port,
        config.db_url,
        tuning=tuning,
        fault_events=links.events if links is not None else {},
    )


def _slow_links(config: DemoConfig) -> list[tuple[int, Fault]]:
    return [(i, f) for i, f in enumerate(config.faults) if f.kind == "slow-link"]


class _SlowLinks:
    """Applies slow-link faults: the faulted rank leaves a file when the fault starts or
    stops (it knows its step; the aggregator only sees it a batch later), and this sets
    that rank's link rate within a tick (``tc`` takes a few milliseconds)."""

    def __init__(self, config: DemoConfig, tmp: str) -> None:
        self.faults = _slow_links(config)
        self.base_rate = config.link_rate
        self.signal_dir = os.path.join(tmp, "faults")
        os.makedirs(self.signal_dir, exist_ok=True)
        self.events: dict[str, float] = {}

    def tick(self, shaper: LinkShaper) -> None:
        for index, fault in self.faults:
            onset, end = f"fault{index}_onset_unix_s", f"fault{index}_end_unix_s"
            if onset not in self.events and self._signalled(index, "on"):
                shaper.set_rate(fault.rate, rank=fault.rank)
                self.events[onset] = time.time()
                self.events[f"fault{index}_onset_step"] = float(fault.start_step)
            if onset in self.events and end not in self.events and self._signalled(index, "off"):
                shaper.set_rate(self.base_rate, rank=fault.rank)
                self.events[end] = time.time()

    def _signalled(self, index: int, what: str) -> bool:
        return os.path.exists(os.path.join(self.signal_dir, f"fault{index}.{what}"))


class ApiClient:
    """The aggregator's HTTP API as any client calls it: a bearer token, JSON both ways."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None) -> None:
        self._session = session
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token is not None else {}

    async def call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """(status, decoded JSON) of one request; HTTP errors are returned, not raised.
        A body goes as ``application/json`` (the aggregator refuses any other kind)."""
        async with self._session.request(
            method, self._base_url + path, json=body, headers=self._headers
        ) as response:
            return response.status, await response.json(content_type=None)

    async def stored_session(self, session_id: str) -> TuningSession | None:
        """A tuning session as stored in the history (the read-only query API), rebuilt
        read-only from its state; None if it is not stored (yet)."""
        status, reply = await self.call("POST", "/api/v1/query", {"sql": _session_sql(session_id)})
        if status != 200 or not reply["rows"]:
            return None
        return _session_from_blob(reply["rows"][0][0])


class _Autotune:
    """Drives the demo's one tuning session through the HTTP API, as ``torshmon tune``
    does, from ``run_system``'s loop."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.session_id: str | None = None
        self.session: TuningSession | None = None
        self.stopping = False

    async def tick(self, api: ApiClient) -> None:
        if self.stopping:
            return
        job = self.config.job
        if self.session_id is None:
            body: dict[str, Any] = {}
            if self.config.tune_max_trials is not None:
                body["max_trials"] = self.config.tune_max_trials
            status, reply = await api.call("POST", f"/api/v1/jobs/{_quote(job)}/tune", body)
            if status == 404:
                return  # the job has not reported its config yet
            if status == 409:
                # An alert's autotune action was first, or the session was resumed from
                # this history file: follow that session.
                self.session_id = await _active_session_id(api, job)
                if self.session_id is None:
                    return
            elif status == 400:  # e.g. the job runs a config outside the space
                log.error("autotune: cannot tune job %s: %s", job, reply.get("error"))
                self._stop()
                return
            elif status != 201:
                raise RuntimeError(f"autotune: POST .../tune answered {status}: {reply}")
            else:
                self.session_id = str(reply["session_id"])
        session = await api.stored_session(self.session_id)
        if session is not None:
            self.session = session
            if session.done:
                self._stop()

    def _stop(self) -> None:
        """Have the ranks stop at their next agreed step."""
        if not self.stopping and self.config.stop_file is not None:
            self.stopping = True
            Path(self.config.stop_file).touch()

    async def close(self, api: ApiClient) -> None:
        """The job is over: a session still running can never finish."""
        steps = self.config.steps
        reason = f"the job stopped (its {steps} steps are done) before the session ended"
        body = {"reason": reason, "restore": False}
        await api.call("DELETE", f"/api/v1/jobs/{_quote(self.config.job)}/tune", body)


class _Watch:
    """The lines ``run_system`` hands ``on_line``: progress and the tuning trials."""

    def __init__(self, api: ApiClient, config: DemoConfig, on_line: LineHook | None) -> None:
        self.api = api
        self.config = config
        self.on_line = on_line
        self.trials = TuningProgress(config.job)
        self._last = ""

    async def progress(self) -> None:
        if self.on_line is None:
            return
        job = _quote(self.config.job)
        status, row = await self.api.call("GET", f"/api/v1/jobs/{job}")
        summary = row.get("live") if status == 200 else None
        firing: list[dict[str, Any]] = []
        if summary:
            status, reply = await self.api.call(
                "GET", f"/api/v1/alerts?job={job}&state=firing&limit=1000"
            )
            firing = reply["alerts"] if status == 200 else []
        line = progress_line(summary, firing, self.config)
        if line != self._last:  # a job that waits or ends says so once
            self._last = line
            self.on_line(line)

    async def tuning(self, session: TuningSession | None) -> None:
        if self.on_line is None:
            return
        for line in self.trials.new_lines(session):
            self.on_line(line)


async def _active_session_id(api: ApiClient, job: str) -> str | None:
    status, reply = await api.call("GET", f"/api/v1/tuning/sessions?job={_quote(job)}")
    if status != 200:
        return None
    for row in reply["sessions"]:  # newest first
        if row["state"] not in ("finished", "aborted"):
            return str(row["id"])
    return None


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def _sql_text(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _session_sql(session_id: str) -> str:
    return f"SELECT state_blob FROM tuning_sessions WHERE id = {_sql_text(session_id)}"


def _session_from_blob(blob: Any) -> TuningSession:
    from torshmon.aggregator.core.tuner import TuningSession

    state = json.loads(blob) if isinstance(blob, str) else blob
    return TuningSession.from_state(state or {})


def _stored_session(db_url: str, session_id: str) -> TuningSession | None:
    """The session as the history holds it (``torshmon query``), or None."""
    from torshmon.history.query import run_query

    result = run_query(db_url, _session_sql(session_id))
    return _session_from_blob(result.rows[0][0]) if result.rows else None


def _start_shaper(config: DemoConfig) -> LinkShaper | None:
    if config.link_rate is None and not _slow_links(config):
        return None
    from torshmon.linkshape import LinkShaper

    return LinkShaper(config.world_size, config.link_rate).start()


def _launch(shaper: LinkShaper | None, config: DemoConfig, socket_path: str) -> list[Any]:
    """The job's ranks, in the shaper's namespaces when there is one (a worker thread)."""
    env = config.env or None
    if shaper is not None:
        # The agent's socket is a path, which every network namespace sees.
        return shaper.run_ranks(
            train_rank, config, socket_path, env=env, timeout_s=config.timeout_s
        )
    return run_ranks(
        train_rank, config.world_size, config, socket_path, env=env, timeout_s=config.timeout_s
    )


def _alert_rows(db_url: str, job: str) -> list[dict[str, Any]]:
    """The job's alerts as the history holds them (``torshmon query``), oldest first."""
    from torshmon.history.query import run_query

    result = run_query(db_url, f"SELECT * FROM alerts WHERE job = {_sql_text(job)} ORDER BY id")
    rows = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
    for row in rows:
        for name in ("labels", "annotations"):  # JSON columns arrive as their text
            if isinstance(row[name], str):
                row[name] = json.loads(row[name])
    return rows


def page_line(port: int, job: str, token: str) -> str:
    """Where the job's page is while the demo runs, and the token it signs in with."""
    return (
        f"the job's page, while the demo runs: http://127.0.0.1:{port}/jobs/{_quote(job)} "
        f"(sign in with the token {token})"
    )


def progress_line(
    summary: dict[str, Any] | None, firing: Sequence[dict[str, Any]], config: DemoConfig
) -> str:
    """One progress line from the job's live summary and its firing alerts (the API's
    ``GET /api/v1/jobs/{job}`` ``live`` and ``GET /api/v1/alerts`` rows)."""
    if not summary or summary["last_step"] < 0:
        return "waiting for the ranks to start..."
    step_ms = 1e3 * (summary["step_duration_s"] or 0.0)
    comm = summary["communication_time_ratio"] or 0.0
    alerts = ", ".join(sorted({_alert_title(a) for a in firing})) or "none"
    throughput = summary["throughput_samples_per_s"] or 0.0
    return (
        f"step {summary['last_step']:>5}/{config.steps}  {step_ms:7.1f} ms/step  "
        f"comm {comm:5.1%}  {throughput:7.0f} samples/s per job  alerts firing: {alerts}"
    )


def _alert_title(row: Any) -> str:
    """The rule's own name ("Step Time Anomaly"), not the ``alertname`` label's CamelCase."""
    rank = row["labels"].get("rank")
    return f"{row['rule']}" + (f" (rank {rank})" if rank is not None else "")


def run_demo(config: DemoConfig) -> int:
    """Run the demo and print its summary; returns the process exit code."""
    print(
        f"torshmon demo: {config.world_size} gloo ranks x {config.steps} steps, "
        f"MLP of {config.model_bytes / 1e6:.1f} MB; history -> {config.db}",
        flush=True,
    )
    if config.link_rate is not None:
        print(f"links: {config.link_rate} per rank (network namespaces, tc tbf)", flush=True)
    for fault in config.faults:
        print(f"injecting: {fault.describe()}", flush=True)

    if config.autotune:
        print(
            f"autotune: a tuning session starts once the job trains; the job stops when it "
            f"ends (at most {config.steps} steps)",
            flush=True,
        )

    def show(line: str) -> None:
        print(line, flush=True)

    from torshmon.linkshape import LinkShapingError, LinkShapingUnavailable

    # The ranks' libraries keep to themselves unless the user's environment says
    # otherwise: the progress lines are the demo's output.
    quiet = {k: v for k, v in QUIET_RANKS.items() if k not in os.environ}
    config = replace(config, env={**quiet, **config.env})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # libraries' warnings in this process (optuna's)
            result = asyncio.run(run_system(config, on_line=None if config.quiet else show))
    except LinkShapingUnavailable as exc:
        print(f"torshmon demo: --link-rate needs link shaping: {exc}", file=sys.stderr)
        return 2
    except LinkShapingError as exc:
        print(f"torshmon demo: link shaping failed: {exc}", file=sys.stderr)
        return 1
    print(summary(config, result))
    return 0


class TuningProgress:
    """Lines for people about a job's tuning session: each trial as it starts and as it
    is decided (config, score, decision, why). Call ``new_lines`` as often as you like."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._started: set[int] = set()
        self._decided: set[int] = set()
        self._ended = False

    def new_lines(self, session: TuningSession | None) -> list[str]:
        """The lines not yet given for ``session`` (the job's, as stored)."""
        if session is None:
            return []
        lines = []
        for trial in session.trials:
            if trial.index not in self._started:
                self._started.add(trial.index)
                lines.append(f"autotune: {_trial_name(trial)} {trial.config.describe()}: measuring")
            if trial.decision is not None and trial.index not in self._decided:
                self._decided.add(trial.index)
                score = f"{trial.score:.0f} {session.unit}" if trial.score is not None else "-"
                lines.append(
                    f"autotune: {_trial_name(trial)} {trial.config.describe()}: {score} -> "
                    f"{trial.decision}" + (f" ({trial.reason})" if trial.reason else "")
                )
        if session.done and not self._ended:
            self._ended = True
            lines.append(f"autotune: session {session.phase}: {session.summary()}")
        return lines


def _trial_name(trial: Trial) -> str:
    return "baseline" if trial.kind == "baseline" else f"{trial.kind} {trial.index}"


def tuning_summary(session: TuningSession) -> str:
    """The end-of-run tuning report: the session's summary line and its trials."""
    lines = [f"autotune ({session.phase}): {session.summary()}"]
    for trial in session.trials:
        score = f"{trial.score:8.0f}" if trial.score is not None else "       -"
        lines.append(
            f"  {_trial_name(trial):<10} {trial.config.describe():<42} {score} "
            f"{session.unit}  {trial.decision or 'unfinished'}"
        )
    if session.final_config is not None:
        lines.append(f"  the job ended on {session.final_config.describe()}")
    return "\n".join(lines)


def summary(config: DemoConfig, result: DemoResult) -> str:
    """The end-of-run report, read back from the SQL history."""
    from torshmon.history.query import format_result, run_query

    per_rank = run_query(
        result.db_url,
        "SELECT rank, count(*) AS steps, round(avg(duration_s) * 1000, 1) AS step_ms, "
        "round(avg(compute_s) * 1000, 1) AS compute_ms, "
        "round(avg(comm_wait_s) * 1000, 1) AS comm_wait_ms, "
        "round(avg(communication_time_ratio), 3) AS comm_ratio, "
        "round(avg(samples_per_s), 0) AS rank_samples_per_s "
        f"FROM steps WHERE job = '{config.job.replace(chr(39), chr(39) * 2)}' "
        "GROUP BY rank ORDER BY rank",
    )
    lines = [
        "",
        f"finished in {result.wall_s:.1f} s; final loss {result.results[0]['final_loss']:.4f}",
        format_result(per_rank, "table"),
    ]
    step_ms = [row[2] for row in per_rank.rows if row[2] is not None]
    if step_ms:
        throughput = config.world_size * config.batch_size / (max(step_ms) / 1e3)
        lines.append(
            f"job throughput: {throughput:.0f} samples/s per job (mean step of the slowest rank)"
        )
    fired = [a for a in result.alerts if a["fired_at_unix_s"] is not None]
    if fired:
        lines.append(f"alerts fired: {len(fired)}")
        for a in fired:
            state = "resolved" if a["state"] == "resolved" else "still firing"
            lines.append(
                f"  [{a['severity']}] {a['rule']} ({state}): {a['annotations'].get('summary', '')}"
            )
    else:
        lines.append("alerts fired: none")
    if result.tuning is not None:
        lines.append(tuning_summary(result.tuning))
    elif config.autotune:
        lines.append("autotune: no session started (see the log above)")
    job, db = shlex.quote(config.job), shlex.quote(str(config.db))
    lines += [
        f"history: {config.db_url}",
        "the report, with what to do (--html FILE writes a page with plots):",
        f"  torshmon report {job} --db {db}",
        f"  torshmon report {job} --db {db} --html {shlex.quote(config.job + '.html')}",
        "or SQL:",
        f'  torshmon query --db {db} "SELECT rank, avg(duration_s) FROM steps GROUP BY rank"',
    ]
    return "\n".join(lines)
