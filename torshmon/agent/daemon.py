"""``torshmon agent``: the per-node daemon between the probes and the aggregator.

It serves the probes of its node on a Unix socket, makes what they send durable
in an on-disk spool before acknowledging it, samples the node, exposes
``/metrics`` and ``/healthz``, forwards the spool to the aggregator and relays
the aggregator's commands to each job's rank-0 probe (evidence captures to every
rank of the job). It keeps working when everything around it fails: with no
aggregator it spools (bounded), a bad probe frame costs that frame, and SIGTERM
flushes before exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from torshmon.agent.forwarder import Forwarder
from torshmon.agent.metrics import AgentMetrics, AgentState, make_metrics_handler
from torshmon.agent.receiver import ProbeReceiver
from torshmon.agent.sampler import NodeSampler
from torshmon.agent.settings import AgentSettings
from torshmon.agent.spool import Spool
from torshmon.paths import ensure_agent_dir, ensure_private_dir, runtime_dir
from torshmon.redact import redact_url
from torshmon.wire import (
    Batch,
    Command,
    Hello,
    IngestReply,
    NodeSample,
    ProbeMessage,
    SpoolRecord,
    encode_json,
)

__all__ = ["Agent", "AgentSettings", "run_agent"]

log = logging.getLogger(__name__)

#: How long probe messages wait to be read, together, into one durable spool write
#: (probes flush every 0.5 s and wait up to 2 s for an ack, so 100 ms is invisible
#: to them; the agent wakes twice per window instead of once per frame).
GROUP_COMMIT_S = 0.1
#: The read window while a probe's fast lane is open (its batches are urgent): a
#: step its detectors wait for reaches the spool, and the shipper its ack, in about
#: this long rather than a group commit later.
URGENT_READ_WINDOW_S = 0.005
#: Where the aggregator takes agent batches, under its base URL.
INGEST_PATH = "/api/v1/ingest"
#: Commands kept per job while no rank-0 probe of it is connected.
MAX_QUEUED_COMMANDS = 64
#: Commands every rank of a job takes, not only rank 0 (an evidence capture must reach
#: the ranks of a hung job, which agree on no step), and how long each is offered to
#: the job's probes that have not taken it yet.
FAN_OUT_KINDS = frozenset({"evidence"})
FAN_OUT_S = 60.0


class Agent:
    """The daemon's parts and their lifecycle: ``async with Agent(settings)``.

    Everything runs on one event loop; ``aclose`` is safe to call twice.
    """

    def __init__(self, settings: AgentSettings, *, registry: CollectorRegistry | None = None):
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(self.registry, node=settings.node)
        _prepare_folders(settings)
        self.spool = Spool(settings.spool_path, max_bytes=settings.spool_max_bytes)
        self.sampler = NodeSampler(settings.node)
        socket_gid = settings.socket_gid()
        self.server = ProbeReceiver(
            settings.socket_path,
            on_message=self._observe,
            store=self._store,
            commands_for=self._commands_for,
            read_window_s=GROUP_COMMIT_S,
            urgent_window_s=URGENT_READ_WINDOW_S,
            socket_mode=0o600 if socket_gid is None else 0o660,
            socket_gid=socket_gid,
        )
        # The aggregator de-duplicates by (agent id, seq): a new spool restarts seq at
        # 1, so its id is part of the agent's unless one was given.
        self.agent_id = settings.agent_id or f"{settings.node}-{self.spool.instance_id[:8]}"
        self.forwarder: Forwarder | None = None
        if settings.aggregator_url is not None:
            self.forwarder = Forwarder(
                self.spool,
                url=settings.aggregator_url.rstrip("/") + INGEST_PATH,
                token=settings.token,
                agent_id=self.agent_id,
                node=settings.node,
                on_reply=self._on_reply,
            )
        self._commands: dict[str, deque[Command]] = defaultdict(
            lambda: deque(maxlen=MAX_QUEUED_COMMANDS)
        )
        #: job -> [(command, sessions that took it, offered until (monotonic s))]
        self._fan_out: dict[str, list[tuple[Command, set[str], float]]] = defaultdict(list)
        self._pending: list[bytes] = []
        #: the jobs of the pending urgent batches (none: nothing pending is urgent)
        self._urgent_jobs: set[str] = set()
        #: session -> the newest step its batches brought (``_step_complete``)
        self._newest_step: dict[str, int] = {}
        self._pending_done: asyncio.Future[None] | None = None
        self._commit_handle: asyncio.Handle | None = None
        self._sampler_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._closed = False
        self.metrics_port: int | None = None

    async def start(self) -> None:
        """Serve probes and /metrics, start sampling and forwarding."""
        app = web.Application()
        app.router.add_get("/metrics", make_metrics_handler(self.registry))
        app.router.add_get("/healthz", self._healthz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.metrics_host, self.settings.metrics_port)
        await site.start()
        self.metrics_port = int(self._runner.addresses[0][1])
        await self.server.start()
        if self.forwarder is not None:
            await self.forwarder.start()
        else:
            # where() says so on the start line.
            log.info("no aggregator configured: records stay in the spool %s", self.spool_path)
        self._sampler_task = asyncio.create_task(self._sample_forever(), name="agent-sampler")
        log.info("agent %s started", self.agent_id)

    def where(self) -> str:
        """Where it listens, stores and forwards, for the start line (no credentials)."""
        host = self.settings.metrics_host
        host = f"[{host}]" if ":" in host else host
        target = self.settings.aggregator_url
        forwards = (
            f"forwarding to {redact_url(target)}"
            if target
            else "not forwarding: no aggregator URL, records stay in the spool"
        )
        return (
            f"listening on {self.settings.socket_path} (probes) and "
            f"http://{host}:{self.metrics_port}/metrics, spool in {self.spool_path}, {forwards}"
        )

    @property
    def spool_path(self) -> str:
        return self.settings.spool_path

    async def aclose(self) -> None:
        """Stop taking probe data, make what was taken durable, flush, stop."""
        if self._closed:
            return
        self._closed = True
        # The loop over parts is deliberate: one failing must not leave the rest running.
        errors: list[BaseException] = []
        for step in (
            self.server.aclose,
            self._flush_pending,
            self._stop_sampler,
            self._close_forwarder,
            self._close_http,
        ):
            try:
                await step()
            except Exception as exc:  # report all together below
                errors.append(exc)
        self.spool.close()
        self.sampler.close()
        for error in errors:
            log.error("agent shutdown step failed: %s", error)

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- probes -----------------------------------------------------------------------
    def _observe(self, message: ProbeMessage) -> None:
        if isinstance(message, Hello):
            # A new probe shows in torshmon_rank_info at once; gone ones at the next sample.
            self.metrics.observe_probes(self.server.probes)

    def _store(self, message: ProbeMessage, payload: bytes) -> asyncio.Future[None]:
        """The commit that will make this message durable; it fails if the write does.

        The receiver reads a whole window's frames in one pass, so they are
        committed together right after it (a failed commit acks none of them:
        the probes resend). The probe's own validated JSON goes into the spool
        record as it came: decoding was needed to validate it, re-encoding is not.
        """
        self._pending.append(payload)
        if isinstance(message, Batch):
            if message.steps:
                self._newest_step[message.session] = message.steps[-1].step
            if message.urgent:
                self._urgent_jobs.add(message.job)
        done = self._pending_done
        if done is None:
            loop = asyncio.get_running_loop()
            done = self._pending_done = loop.create_future()
            # A callback, not a task: the commit is synchronous anyway.
            self._commit_handle = loop.call_soon(self._commit)
        return done

    def _commit(self) -> None:
        self._commit_handle = None
        try:
            self._flush_pending_now()
        except Exception:
            # The waiting probes got the error (no ack: they resend); say it once here.
            log.exception("could not write probe data to the spool %s", self.spool_path)

    async def _flush_pending(self) -> None:
        handle, self._commit_handle = self._commit_handle, None
        if handle is not None:
            handle.cancel()
        self._flush_pending_now()

    def _flush_pending_now(self) -> None:
        messages, self._pending = self._pending, []
        jobs, self._urgent_jobs = self._urgent_jobs, set()
        urgent = bool(jobs)
        done, self._pending_done = self._pending_done, None
        if not messages:
            if done is not None and not done.done():
                done.set_result(None)
            return
        try:
            self._append_raw(
                b'{"messages":[%s]}' % b",".join(messages),
                urgent=urgent,
                complete=urgent and self._step_complete(jobs),
            )
        except Exception as exc:
            if done is not None and not done.done():
                done.set_exception(exc)
            raise
        if done is not None and not done.done():
            done.set_result(None)

    def _append(self, record: SpoolRecord) -> None:
        self._append_raw(encode_json(record))

    def _append_raw(
        self, record_json: bytes, *, urgent: bool = False, complete: bool = False
    ) -> None:
        """Append one SpoolRecord's JSON durably and wake the forwarder (at once, not
        after its gathering wait, when a probe marked a batch urgent; ``complete``:
        without gathering the node's other records of the step either)."""
        self.spool.append(record_json)
        if self.forwarder is not None:
            self.forwarder.notify(urgent=urgent, complete=complete)

    def _step_complete(self, jobs: set[str]) -> bool:
        """Whether every connected probe of each of ``jobs`` has brought that job's
        newest step here: the node's records of it are all spooled, so gathering for
        more of them would only delay it (a straggler's record comes last, alone)."""
        probes = self.server.probes
        connected = {h.session for h in probes}
        for session in [s for s in self._newest_step if s not in connected]:
            del self._newest_step[session]
        newest: dict[str, list[int]] = defaultdict(list)
        for hello in probes:
            if hello.job in jobs:
                newest[hello.job].append(self._newest_step.get(hello.session, 0))
        return all(min(steps) == max(steps) for steps in newest.values())

    def _commands_for(self, hello: Hello) -> list[Command]:
        """What ``hello``'s probe takes now: its job's fan-out commands, and if it is a
        rank 0 the job's commands for its run (those for another run of the job, one
        launched beside it, wait for that run's rank 0)."""
        out = self._fanned_out(hello)
        if hello.rank == 0 and hello.job in self._commands:
            queued = self._commands.pop(hello.job)
            other_runs = [c for c in queued if c.run_id not in ("", hello.run_id)]
            out += [c for c in queued if c.run_id in ("", hello.run_id)]
            if other_runs:
                self._commands[hello.job].extend(other_runs)
        return out

    def _fanned_out(self, hello: Hello) -> list[Command]:
        """The fan-out commands of ``hello``'s job that its session has not taken yet."""
        offers = self._fan_out.get(hello.job)
        if not offers:
            return []
        now = time.monotonic()
        offers[:] = [offer for offer in offers if offer[2] > now]
        out = []
        for command, sessions, _until in offers:
            if hello.session not in sessions:
                sessions.add(hello.session)
                out.append(command)
        return out

    def _on_reply(self, reply: IngestReply) -> None:
        for command in reply.commands:
            if command.kind in FAN_OUT_KINDS:
                offers = self._fan_out[command.job]
                if all(offer[0].id != command.id for offer in offers):
                    offers.append((command, set(), time.monotonic() + FAN_OUT_S))
                    del offers[:-MAX_QUEUED_COMMANDS]
            else:
                self._commands[command.job].append(command)

    # -- node -------------------------------------------------------------------------
    async def _sample_forever(self) -> None:
        while True:
            try:
                sample = self._sample()
                self.metrics.observe_node(sample)
                self.metrics.observe_probes(self.server.probes)
                self._append(SpoolRecord(node_samples=[sample]))
            except Exception:
                log.exception("node sampling failed; trying again next interval")
            self._publish_state()
            await asyncio.sleep(self.settings.sample_interval_s)

    def _publish_state(self) -> None:
        forwarder = self.forwarder
        self.metrics.set_agent_state(
            AgentState(
                frames_rejected_total=self.server.frames_rejected,
                probe_connections=len(self.server.probes),
                spool_records=self.spool.records,
                spool_bytes=self.spool.bytes,
                spool_dropped_records_total=self.spool.dropped_records,
                forward_failures_total=forwarder.failures_total if forwarder else 0,
                forward_up=bool(
                    forwarder
                    and forwarder.last_success_unix is not None
                    and forwarder.consecutive_failures == 0
                ),
            )
        )

    def _sample(self) -> NodeSample:
        ranks = [(h.job, h.rank, h.pid) for h in self.server.probes]
        return self.sampler.sample(ranks)

    # -- lifecycle helpers ------------------------------------------------------------
    async def _stop_sampler(self) -> None:
        task, self._sampler_task = self._sampler_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _close_forwarder(self) -> None:
        if self.forwarder is not None:
            await self.forwarder.aclose()

    async def _close_http(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "agent_id": self.agent_id,
                "probes": len(self.server.probes),
                "spool_records": self.spool.records,
            }
        )


def _prepare_folders(settings: AgentSettings) -> None:
    """Make or check the folders of the socket and the spool; UnsafePathError if unsafe.

    The default runtime folder must be this user's alone (0700). A folder given
    explicitly may be shared with the training users' group for reading, but no
    one else may write to it (see ``torshmon.paths``).
    """
    own = runtime_dir()
    for folder, what in (
        (Path(settings.socket_path).parent, "socket folder"),
        (Path(settings.spool_path).parent, "spool folder"),
    ):
        if folder == own:
            ensure_private_dir(folder)
        else:
            ensure_agent_dir(folder, what)


async def run_agent(
    settings: AgentSettings, *, announce: Callable[[str], None] | None = None
) -> int:
    """Run until SIGTERM or SIGINT; returns the exit code. ``announce`` gets one line
    once it serves, saying where it listens, stores and forwards."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with Agent(settings) as agent:
        if announce is not None:
            announce(f"torshmon agent {agent.where()}")
        # What start-up made (modules, the app) lives as long as the process: keep
        # it out of the collector's full passes, which would otherwise trace
        # hundreds of thousands of objects that are never garbage.
        gc.freeze()
        await stop.wait()
        log.info("agent stopping: flushing")
    return 0
