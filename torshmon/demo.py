"""``torshmon demo``: the whole system on one machine.

An aggregator (SQLite history, detection, alert rules, API on a loopback port)
and an agent (probe socket, spool, forwarding) run in this process; a real
multi-process gloo DDP job trains an MLP with the probe attached. Progress shows
while it runs; the summary at the end comes from the SQL history.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torshmon.faults import Fault, FaultRunner
from torshmon.launch import run_ranks

if TYPE_CHECKING:
    from torshmon.aggregator.service import Aggregator
    from torshmon.aggregator.tuner import Trial, TunerSettings, TuningSession
    from torshmon.linkshape import LinkShaper

log = logging.getLogger(__name__)

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
    db: Path = Path("torshmon.db")
    port: int = 0
    agent_metrics_port: int = 0
    bucket_timing: bool = False
    faults: tuple[Fault, ...] = ()
    step_sleep_s: float = 0.0
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
    #: Tune the job (the aggregator's TuningManager, as ``torshmon tune`` does) once it
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
        return f"sqlite:///{self.db.resolve()}"


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
#: tens of ms, on the loop). A hook must not raise: an exception ends the demo.
TickHook = Callable[["Aggregator", "LinkShaper | None"], None]
#: ``on_progress(aggregator)``: called every ``progress_s`` while the job runs.
ProgressHook = Callable[["Aggregator"], None]


async def run_system(
    config: DemoConfig,
    *,
    targets: Sequence[Any] | None = None,
    on_progress: ProgressHook | None = None,
    progress_s: float = 1.0,
    on_tick: TickHook | None = None,
    tick_s: float = 0.25,
    tuner_settings: TunerSettings | None = None,
) -> DemoResult:
    """Aggregator + agent + the job, to completion; everything is flushed at the end.

    With ``config.link_rate`` the ranks run inside a :class:`~torshmon.linkshape.LinkShaper`
    (built before anything else starts, removed at the end): LinkShapingUnavailable
    (no root / no iproute2) or LinkShapingError is raised before the aggregator starts.
    With ``config.autotune`` a tuning session (``tuner_settings``, else the tuner's
    defaults) starts as soon as the job reports its config; when it ends, the ranks
    stop at the next agreed step (a stop file); a session still running when the job
    reaches ``steps`` is aborted.
    """
    from prometheus_client import CollectorRegistry

    from torshmon.agent.daemon import Agent, AgentSettings
    from torshmon.aggregator.notify import targets_from_env
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
                port=config.port, db_url=config.db_url, token=token, aggregator_id="demo"
            )
            async with Aggregator(
                settings,
                registry=CollectorRegistry(),
                # As before settings held targets: the demo notifies the TORSHMON_* ones.
                targets=targets if targets is not None else targets_from_env(),
                tuner_settings=tuner_settings,
            ) as aggregator:
                port = aggregator.port or 0
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
                            await autotune.tick(aggregator)
                        if links is not None and shaper is not None:
                            await asyncio.to_thread(links.tick, shaper)
                        if on_tick is not None:
                            on_tick(aggregator, shaper)
                        if on_progress is not None and time.monotonic() >= next_progress:
                            next_progress += progress_s
                            on_progress(aggregator)
                    results = job.result()
                    if config.linger_s:
                        await asyncio.sleep(config.linger_s)
                    if autotune is not None:
                        await autotune.close(aggregator)
                # The agent flushed its spool on close; one last look at what arrived.
                await aggregator.evaluate()
                newest_first = await aggregator.store.rows("alerts", {"job": config.job}, 10_000)
                alerts = newest_first[::-1]
    finally:
        if shaper is not None:
            shaper.close()
    tuning = autotune.session if autotune is not None else None
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


class _Autotune:
    """Drives the demo's one tuning session from ``run_system``'s loop."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.session: TuningSession | None = None
        self.stopping = False

    async def tick(self, aggregator: Aggregator) -> None:
        from torshmon.aggregator.tuner import TunerError
        from torshmon.aggregator.tuning import TuningConflict, TuningUnavailable

        tuning, job = aggregator.tuning, self.config.job
        if self.stopping:
            return
        if self.session is None:
            if tuning.active(job) is None:  # else: resumed from this history file
                try:
                    await tuning.start_session(
                        job,
                        trigger="torshmon demo --autotune",
                        max_trials=self.config.tune_max_trials,
                    )
                except TuningUnavailable:
                    return  # the job has not reported its config yet
                except TuningConflict:
                    pass  # an alert's autotune action was first: follow that session
                except TunerError as exc:  # e.g. the job runs a config outside the space
                    log.error("autotune: cannot tune job %s: %s", job, exc)
                    self._stop()
                    return
            self.session = tuning.session(job)
        elif tuning.active(job) is None:
            self._stop()

    def _stop(self) -> None:
        """Have the ranks stop at their next agreed step."""
        if not self.stopping and self.config.stop_file is not None:
            self.stopping = True
            Path(self.config.stop_file).touch()

    async def close(self, aggregator: Aggregator) -> None:
        """The job is over: a session still running can never finish."""
        steps = self.config.steps
        reason = f"the job stopped (its {steps} steps are done) before the session ended"
        await aggregator.tuning.abort_session(self.config.job, reason, restore=False)


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


def progress_line(aggregator: Any, config: DemoConfig) -> str:
    summary = aggregator.live.job_summary(config.job)
    if not summary or summary["last_step"] < 0:
        return "waiting for the ranks to start..."
    step_ms = 1e3 * (summary["step_duration_s"] or 0.0)
    comm = summary["communication_time_ratio"] or 0.0
    firing = [a for a in aggregator.alerts.active() if a.state == "firing"]
    alerts = ", ".join(sorted({_alert_name(a.labels) for a in firing})) or "none"
    throughput = summary["throughput_samples_per_s"] or 0.0
    return (
        f"step {summary['last_step']:>5}/{config.steps}  {step_ms:7.1f} ms/step  "
        f"comm {comm:5.1%}  {throughput:7.0f} samples/s  alerts firing: {alerts}"
    )


def _alert_name(labels: Any) -> str:
    rank = labels.get("rank")
    return f"{labels.get('alertname')}" + (f" (rank {rank})" if rank is not None else "")


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

    def show(aggregator: Any) -> None:
        print(progress_line(aggregator, config), flush=True)

    tuning_lines = TuningProgress(config.job)

    def tick(aggregator: Aggregator, shaper: LinkShaper | None) -> None:
        for line in tuning_lines.new_lines(aggregator):
            print(line, flush=True)

    from torshmon.linkshape import LinkShapingError, LinkShapingUnavailable

    try:
        result = asyncio.run(
            run_system(
                config,
                on_progress=None if config.quiet else show,
                on_tick=tick if config.autotune and not config.quiet else None,
            )
        )
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

    def new_lines(self, aggregator: Aggregator) -> list[str]:
        session = aggregator.tuning.session(self.job)
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
        "round(avg(samples_per_s), 0) AS samples_per_s "
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
        lines.append(f"job throughput: {throughput:.0f} samples/s (mean step of the slowest rank)")
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
    lines += [
        f"history: {config.db} (SQLite); try:",
        f"  torshmon query --db {config.db_url} "
        '"SELECT rank, avg(duration_s) FROM steps GROUP BY rank"',
    ]
    return "\n".join(lines)
