"""Ships a rank's step records to the local agent on a background thread.

The training thread only hands raw steps to a bounded ``Outbox``; everything
else (summarising, batching, socket I/O, reconnecting) happens on the shipper's
daemon thread, so a missing or slow agent can never block training. While the
agent is away, batches wait in a bounded buffer; past the bound the oldest are
dropped and counted, and the count travels in every later batch.

Steps are summarised and sent every ``flush_interval_s``, or at once, marked urgent,
while the fast lane is open (``fastlane``: a step out of line with the rank's recent
ones opens it), at most one send per ``poll_s`` then: a job's ranks end a step
together, so their records of it reach the agent together. The thread sleeps between
those times: a step's end wakes it only when the step is due to go (``StepOutbox``),
because it is out of line by the lane's bars or because the lane is open and ``poll_s``
has passed since the last send. Every wake-up costs the training thread on a busy core
(a context switch, the GIL), so the thread no longer polls every ``poll_s``: on the
40-bucket model of ``benchmarks/overhead.py`` the 20 polls a second cost the shipper
about 30 us a step with the lane shut.

The thread runs ``SHIPPER_NICE`` steps below the process's scheduling priority (Linux),
so its work fills the gaps where the training thread waits (for gradients, for the
loader) instead of preempting its compute, where the rank has no core to spare.

The probe sends only to an agent run by its own user, root, or the user of its
``agent_user`` setting (``$TORSHMON_AGENT_USER``; an agent shared by the node's
training users): whoever serves the socket reads the job's data and sends rank 0 its
commands. Any other is treated as no agent, and the refusal is logged once.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from torshmon.backoff import backoff_s
from torshmon.probe.ddpcomm import DdpCollectives
from torshmon.probe.events import RawStep, StepEvents
from torshmon.probe.fastlane import FastLane
from torshmon.probe.groups import GroupRegistry
from torshmon.probe.inflight import InflightTable
from torshmon.probe.summary import aggregate_collectives, summarize_step
from torshmon.probe.timing import PendingTiming, StepGate, resolve, resolve_buckets
from torshmon.ratelog import LogLimiter
from torshmon.wire import (
    FRAME_HEADER,
    SCHEMA_VERSION,
    Batch,
    Closing,
    Command,
    CommandAck,
    EvidenceFile,
    Hello,
    LinkCheckResult,
    StepRecord,
    WireError,
    decode_ack,
    encode_frame,
    frame_length,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How much lower (nice steps) the shipper thread runs than the process. On a rank with
#: one core, where the shipper's 0.2-0.4 ms a step otherwise preempted the training
#: thread, the 40-bucket DDP job of ``benchmarks/overhead.py`` took 1.033x its bare step
#: time with the shipper at the process's priority and 0.988x with it 10 lower (median
#: of 14 rotated rounds, sd 0.08-0.09). At 10 it still gets about a tenth of a core
#: that a busy thread of the job competes for: its own need is about 1 %.
SHIPPER_NICE = 10


def lower_thread_priority(steps: int) -> bool:
    """Make the calling thread ``steps`` nice steps lower (at most 19); False if it
    cannot be done here (not Linux, where a thread's id is not a process id)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + steps))
    except OSError as exc:  # a sandbox that forbids it: the shipper works without it
        log.debug("torshmon: shipper priority unchanged: %s", exc)
        return False
    return True


class Outbox(Generic[T]):
    """Bounded single-producer hand-off; when full, the oldest item is dropped and counted.

    ``put`` is called by the training thread, ``drain`` by the shipper; both use
    deque operations that are atomic under the GIL.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._items: deque[T] = deque()
        self._capacity = capacity
        self.dropped = 0

    def put(self, item: T) -> None:
        if len(self._items) >= self._capacity:
            try:
                self._items.popleft()
                self.dropped += 1
            except IndexError:
                pass
        self._items.append(item)

    def __len__(self) -> int:
        return len(self._items)

    def take(self) -> list[T]:
        """The oldest item alone, or nothing."""
        try:
            return [self._items.popleft()]
        except IndexError:
            return []

    def drain(self) -> list[T]:
        out = []
        try:
            while True:
                out.append(self._items.popleft())
        except IndexError:
            return out


class StepOutbox(Outbox[RawStep]):
    """The steps' outbox, which also wakes the shipper when a step's end calls for it.

    Before it sleeps the shipper sets ``wake_at`` (a monotonic time: a step that ends
    from then on wakes it; its next flush, or while the fast lane is open ``poll_s``
    after its last send) and the lane's bars (``FastLane.bars``): ``slow_ns``, a step
    lasting this long wakes it, and ``loss_above``, a float loss this high, or not a
    number, does. So a step out of line opens the lane as it ends, as the shipper's
    own judgement at a poll would have. The check costs the training thread a few
    comparisons. A loss that is not a float (a GPU tensor, which only the shipper
    reads, so training never waits on the device) and compute time are judged when
    the shipper next summarises, at the latest at its flush.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.wake = threading.Event()
        self.wake_at = -math.inf  # until the shipper first sleeps, every step wakes it
        self.slow_ns = sys.maxsize
        self.loss_above = math.inf

    def put(self, item: RawStep) -> None:
        # Outbox.put's body, inline: in the training loop each call costs the training
        # thread a few us (the step's compute has evicted the interpreter's caches).
        items = self._items
        if len(items) >= self._capacity:
            try:
                items.popleft()
                self.dropped += 1
            except IndexError:
                pass
        items.append(item)
        if self.wake.is_set():
            return
        loss = item.loss
        if (
            item.end_ns - item.start_ns >= self.slow_ns
            or time.monotonic() >= self.wake_at
            or (type(loss) is float and not loss < self.loss_above)
        ):
            self.wake.set()


#: Batches an urgent send leaves awaiting their acks at most (the last urgent one and the
#: one before it, whose ack the agent is about to write).
_MAX_AWAITING_ACK = 2

#: ``struct ucred`` (pid, uid, gid), as SO_PEERCRED returns it.
_UCRED = struct.Struct("3i")


class UntrustedAgentError(PermissionError):
    """The socket is served by a user the probe does not send to; the text says which."""


def trusted_agent_uids(agent_uid: int | None = None) -> frozenset[int]:
    """The users whose agent a probe sends to: this process's, root, and ``agent_uid``
    (the probe's ``agent_user`` setting, resolved where the settings were loaded)."""
    uids = {os.geteuid(), 0}
    if agent_uid is not None:
        uids.add(agent_uid)
    return frozenset(uids)


def check_agent(sock: socket.socket, path: str, trusted_uids: frozenset[int]) -> None:
    """Raise UntrustedAgentError unless the connected socket's server runs as a trusted uid.

    On Linux the kernel names the process that listens (SO_PEERCRED), which no one
    can swap between the check and the connection; elsewhere the socket file's
    owner is read.
    """
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is not None:
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, peercred, _UCRED.size))
    else:
        uid = os.stat(path).st_uid
    if uid not in trusted_uids:
        raise UntrustedAgentError(
            f"the socket is served by uid {uid}, not by this user (uid {os.geteuid()}), root "
            "or the agent_user setting ($TORSHMON_AGENT_USER): not sending to it"
        )


@dataclass(frozen=True, slots=True)
class Ending:
    """What a rank's monitor hands its shipper as it closes: why (``reason`` "close" or
    "exit"), when (``end_unix_ns``), and the collectives run since its last step
    (``events``), filed under ``step``, the number the next step would have had."""

    step: int
    end_unix_ns: int
    reason: str = "close"
    events: StepEvents | None = None


class Shipper:
    """The background thread that batches step records and sends them to the agent.

    Protocol: ``hello`` on every new connection, then each batch is sent and
    answered by an ``ack`` (an urgent send takes its ack at the next send, at most two
    batches awaiting one); unacknowledged batches are resent after a reconnect.
    While no agent is there, new steps join the newest batch that was never sent (up
    to ``max_steps_per_batch``), so an outage leaves a few full batches to resend, not
    one per flush: the backlog drains in a few round trips once the agent is back,
    within a job's closing flush. A batch once written to a socket is never changed:
    the agent may have stored it under its seq.
    An agent served by a uid outside ``trusted_uids`` (default: trusted_agent_uids())
    is treated as no agent. ``groups``: this rank's process groups, sent as it says.
    ``start()`` once, ``close()`` any number of times: the first sends a last batch that
    says the rank closed (``wire.Closing``), whatever else it carries.
    """

    def __init__(
        self,
        *,
        socket_path: str,
        hello: Hello,
        outbox: StepOutbox,
        inflight: InflightTable,
        flush_interval_s: float = 0.5,
        poll_s: float = 0.05,
        heartbeat_interval_s: float = 1.0,
        max_buffered_steps: int = 10_000,
        max_steps_per_batch: int = 256,
        io_timeout_s: float = 2.0,
        reconnect_max_s: float = 5.0,
        on_commands: Callable[[list[Command]], None] | None = None,
        fast_lane: FastLane | None = None,
        trusted_uids: frozenset[int] | None = None,
        groups: GroupRegistry | None = None,
    ) -> None:
        self._socket_path = socket_path
        self._trusted_uids = trusted_uids if trusted_uids is not None else trusted_agent_uids()
        self._hello = hello
        self._outbox = outbox
        self._inflight = inflight
        self._groups = groups
        self.ddp_collectives: DdpCollectives | None = None  # see start()
        self._flush_interval_s = flush_interval_s
        self._poll_s = min(poll_s, flush_interval_s)
        self.fast_lane = fast_lane if fast_lane is not None else FastLane()
        self._pending: list[StepRecord] = []
        #: steps whose collectives' device timings are not all ready yet (NCCL)
        self._gate: StepGate[RawStep] = StepGate(_device_timings)
        self.device_timings_unread_total = 0
        self._next_flush = 0.0
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_buffered_steps = max_buffered_steps
        self._max_steps_per_batch = max_steps_per_batch
        self._io_timeout_s = io_timeout_s
        self._reconnect_max_s = reconnect_max_s
        self._on_commands = on_commands
        self.command_acks: Outbox[CommandAck] = Outbox(1024)
        self.link_checks: Outbox[LinkCheckResult] = Outbox(64)
        #: Evidence files waiting for a batch: one per batch, each up to 2 MiB.
        self.evidence: Outbox[EvidenceFile] = Outbox(8)
        self._seq = itertools.count(1)
        self._unacked: deque[Batch] = deque()
        self._sent_seq = 0  # the newest seq ever written to a socket
        self._written_here = 0  # the newest seq written on the present connection
        self._buffered_steps = 0
        self._dropped_here = 0
        self._failures_sent = 0  # failed collectives counted in the newest batch
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._connect_failures = 0
        self._last_batch = 0.0
        self._was_connected = False
        self._down_log = LogLimiter()  # once per outage
        self._stop = threading.Event()
        self._ending: Ending | None = None
        self._last_step = 0  # the newest step summarised
        self._last_urgent = -math.inf
        self._thread = threading.Thread(target=self._run, name="torshmon-shipper", daemon=True)

    @property
    def dropped_records_total(self) -> int:
        """Step records lost so far (outbox overflow plus buffer overflow)."""
        return self._outbox.dropped + self._dropped_here

    @property
    def native_id(self) -> int | None:
        """The shipper thread's kernel id (None before it starts)."""
        return self._thread.native_id

    def start(self, ddp_collectives: DdpCollectives | None = None) -> None:
        """Start the thread; with ``ddp_collectives``, each step waits for it to file
        DDP's collectives (``probe.ddpcomm``) before it is summarised."""
        self.ddp_collectives = ddp_collectives
        self._thread.start()

    def close(self, timeout_s: float = 5.0, ending: Ending | None = None) -> None:
        """Flush what can be sent within ``timeout_s``, with the mark that the rank closed
        (``ending``, else a plain close after the last step summarised), and stop the
        thread."""
        if self._stop.is_set():
            return
        self._ending = ending
        self._stop.set()
        self._outbox.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority(SHIPPER_NICE)
        failures = 0
        self._next_flush = time.monotonic() + self._flush_interval_s
        while True:
            self._wait()
            stopping = self._stop.is_set()
            try:
                self._poll(final=stopping)
            except Exception:
                failures += 1
                if failures == 1:
                    log.exception("torshmon: shipper cycle failed; records may be dropped")
            if stopping:
                break
        self._disconnect()

    def _wait(self) -> None:
        """Until a step's end calls for it (``StepOutbox``), the next flush, or close().

        While the lane is open the thread also wakes ``poll_s`` after its last send, to
        send what ended since; past that, the next step's end wakes it. Until the lane
        has the history for a bar, it wakes every ``poll_s`` to summarise (not where the
        lane is off: then only the flush wakes it)."""
        outbox = self._outbox
        now = time.monotonic()
        deadline = self._next_flush
        if self.fast_lane.is_open(now):
            floor = self._last_urgent + self._poll_s
            outbox.wake_at = floor
            if floor > now:  # then whatever ended meanwhile goes
                deadline = min(deadline, floor)
            # Open, every step goes at the next send anyway: a step out of line only
            # keeps the lane open, which the next summary sees. Waking for it early
            # would only wake the thread twice per send.
            outbox.slow_ns, outbox.loss_above = sys.maxsize, math.inf
        else:
            outbox.wake_at = self._next_flush
            outbox.slow_ns, outbox.loss_above = self.fast_lane.bars()
            if outbox.slow_ns == sys.maxsize and self.fast_lane.enabled:
                # Too few steps judged for a bar: summarise every poll_s, as they come.
                deadline = min(deadline, now + self._poll_s)
        if not (len(outbox) and now >= outbox.wake_at):  # else one came meanwhile: at once
            outbox.wake.wait(max(0.0, deadline - now))
        # Until the next wait only the bars wake it: a step that ends while this
        # thread works is judged as it ends, so none is left waiting for a flush.
        outbox.wake_at = math.inf
        outbox.wake.clear()

    def _poll(self, *, final: bool) -> None:
        """Summarise new steps; send when the flush is due or the fast lane is open."""
        self._gate.add(self._outbox.drain())
        ready = self._gate.ready(final=final)
        if self.ddp_collectives is not None:  # held until a read files DDP's collectives
            ready = self.ddp_collectives.file(ready, final=final)
        steps = [self._summarize(raw) for raw in ready]
        now = time.monotonic()
        if steps:
            self._last_step = steps[-1].step
            self._pending += steps
            self.fast_lane.observe(steps, now)
        urgent = (
            bool(self._pending)
            and self.fast_lane.is_open(now)
            and now >= self._last_urgent + self._poll_s
        )
        if final or urgent or now >= self._next_flush:
            self._next_flush = now + self._flush_interval_s
            if urgent:
                self._last_urgent = now
            self._cycle(final=final, urgent=urgent)

    def _summarize(self, raw: RawStep) -> StepRecord:
        """The step's record, its collectives' device timings read first (NCCL)."""
        events = raw.events
        marks = events.marks
        if marks is None and not any(e.device is not None for e in events.collectives):
            return summarize_step(raw)
        events.collectives, unread = resolve(events.collectives)
        # A bucket's timing is its all-reduce's: counted once, with the collective.
        events.buckets, _ = resolve_buckets(events.buckets)
        split = None if marks is None else marks.split()
        unread += marks is not None and split is None
        self.device_timings_unread_total += unread
        record = summarize_step(raw, split)
        return replace_clock(record, "host" if unread else "device")

    def _closing(self) -> Closing:
        """The mark of the rank's last batch, with the collectives run since its last
        step (their device timings read where ready, as a step's)."""
        ending = self._ending
        if ending is None:
            return Closing(step=self._last_step + 1, end_unix_ns=time.time_ns())
        collectives = [] if ending.events is None else ending.events.collectives
        if any(e.device is not None for e in collectives):
            collectives, unread = resolve(collectives)
            self.device_timings_unread_total += unread
        return Closing(
            step=ending.step,
            end_unix_ns=ending.end_unix_ns,
            reason=ending.reason,
            collectives=aggregate_collectives(collectives),
        )

    def _cycle(self, *, final: bool, urgent: bool = False) -> None:
        steps, self._pending = self._pending, []
        for start in range(0, len(steps), self._max_steps_per_batch):
            self._enqueue(steps[start : start + self._max_steps_per_batch], urgent=urgent)
        now = time.monotonic()
        if self._sock is None and (final or now >= self._next_connect):
            self._connect()
        # The steps go now, and the acks that came: what awaits one decides the heartbeat.
        self._send_unacked(wait=False)
        if self._sock is None:
            return
        idle = now - self._last_batch >= self._heartbeat_interval_s
        failed = self._inflight.failure_count()
        tail = self._unacked[-1] if self._unacked else None
        if failed != self._failures_sent:
            # A collective raised: the job may be about to die of it, so say so now.
            self._enqueue([], urgent=True)
        elif not self._unacked and (idle or self.command_acks or self.link_checks):
            self._enqueue([])  # heartbeat: carries in-flight ops of a stuck rank
        while self.evidence and len(self._unacked) < 4:
            self._enqueue([], evidence=True)
        if final:
            # Always a last batch: the aggregator learns the rank finished, and the
            # in-flight ops of its previous batch (a gather after the last step) are
            # not left standing as if it still waited in them.
            self._enqueue([], closing=self._closing())
        if final or not urgent or (self._unacked[-1] if self._unacked else None) is not tail:
            # An urgent send with nothing new since the first call has sent all it
            # may: a second call would only look for acks again (a select on the
            # socket), which the next send does anyway.
            self._send_unacked(wait=final or not urgent)

    def _enqueue(
        self,
        steps: list[StepRecord],
        *,
        urgent: bool = False,
        evidence: bool = False,
        closing: Closing | None = None,
    ) -> None:
        # Make room first, so the count stamped on this batch includes what it evicts.
        excess = self._buffered_steps + len(steps) - self._max_buffered_steps
        while excess > 0 and self._unacked:
            lost = self._unacked.popleft()
            self._buffered_steps -= len(lost.steps)
            self._dropped_here += len(lost.steps)
            excess -= len(lost.steps)
        if excess > 0:
            self._dropped_here += excess
            steps = steps[excess:]
        self._last_batch = time.monotonic()
        inflight = self._inflight.oldest()
        failures = self._inflight.failures()
        self._failures_sent = sum(f.count for f in failures)
        groups = self._groups.take(inflight) if self._groups is not None else []
        last = self._unacked[-1] if self._unacked else None
        if (
            not evidence
            and last is not None
            and not last.evidence  # a 2 MiB file leaves no room in its frame for 256 steps
            and last.seq > self._sent_seq
            and len(last.steps) + len(steps) <= self._max_steps_per_batch
        ):
            # Never sent: it may still grow. The newest in-flight ops and send time.
            self._unacked[-1] = msgspec.structs.replace(
                last,
                sent_unix_ns=time.time_ns(),
                dropped_records_total=self.dropped_records_total,
                steps=[*last.steps, *steps],
                inflight=inflight,
                command_acks=[*last.command_acks, *self.command_acks.drain()],
                link_checks=[*last.link_checks, *self.link_checks.drain()],
                urgent=last.urgent or urgent,
                groups=groups or last.groups,
                collective_failures=failures,
                closing=closing,
            )
            self._buffered_steps += len(steps)
            return
        batch = Batch(
            v=SCHEMA_VERSION,
            session=self._hello.session,
            seq=next(self._seq),
            job=self._hello.job,
            rank=self._hello.rank,
            sent_unix_ns=time.time_ns(),
            dropped_records_total=self.dropped_records_total,
            steps=steps,
            inflight=inflight,
            command_acks=self.command_acks.drain(),
            link_checks=self.link_checks.drain(),
            urgent=urgent,
            groups=groups,
            evidence=self.evidence.take() if evidence else [],
            collective_failures=failures,
            closing=closing,
        )
        self._unacked.append(batch)
        self._buffered_steps += len(steps)

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._io_timeout_s)
        try:
            sock.connect(self._socket_path)
            check_agent(sock, self._socket_path, self._trusted_uids)
            sock.sendall(encode_frame(self._hello))
        except OSError as exc:
            sock.close()
            self._schedule_reconnect(exc)
            return
        self._sock = sock
        self._written_here = 0  # a new connection: every unacknowledged batch again
        if self._groups is not None:
            self._groups.resend()
        self._connect_failures = 0
        self._down_log.reset()
        if self._was_connected:
            log.info(
                "torshmon: reconnected to agent at %s; %d step records dropped so far",
                self._socket_path,
                self.dropped_records_total,
            )
        self._was_connected = True

    def _send_unacked(self, *, wait: bool = True) -> None:
        """Send what awaits an ack: one batch at a time, each after the ack of the one
        before (``wait``), or, taking only the acks already here, the batches this
        connection has not had while fewer than ``_MAX_AWAITING_ACK`` await an ack.
        An urgent send does not wait: the next one, ``poll_s`` later,
        takes its ack, and the thread sleeps until then instead of waking once more for
        it (on a busy core a wake-up is what the shipper costs the training thread). A
        backlog (after an outage) goes one batch at a time, as the agent stores them."""
        sock = self._sock
        if sock is None:
            return
        try:
            if wait:
                while self._unacked:
                    self._write(sock, self._unacked[0])
                    self._take_acks(sock, wait=True, until=self._unacked[0].seq)
            else:
                self._take_acks(sock, wait=False)
                awaiting = sum(b.seq <= self._written_here for b in self._unacked)
                for batch in self._unacked:
                    if awaiting >= _MAX_AWAITING_ACK:
                        break  # a backlog goes as its acks come
                    if batch.seq > self._written_here:
                        self._write(sock, batch)
                        awaiting += 1
        except (OSError, WireError) as exc:
            self._disconnect()
            self._schedule_reconnect(exc)

    def _write(self, sock: socket.socket, batch: Batch) -> None:
        """Write a batch unless this connection has had it."""
        if batch.seq <= self._written_here:
            return
        # Frozen from the first try: the agent may store what it got of it.
        self._sent_seq = max(self._sent_seq, batch.seq)
        self._written_here = batch.seq
        sock.sendall(encode_frame(batch))

    def _take_acks(self, sock: socket.socket, *, wait: bool, until: int = 0) -> None:
        """Read acks: until ``until`` is acknowledged (``wait``), or those already here."""
        while self._unacked:
            if wait and self._unacked[0].seq > until:
                return
            if not wait and not select.select([sock], [], [], 0.0)[0]:
                return
            ack = decode_ack(_recv_frame(sock))
            if ack.commands and self._on_commands is not None:
                self._on_commands(ack.commands)
            while self._unacked and self._unacked[0].seq <= ack.seq:
                done = self._unacked.popleft()
                self._buffered_steps -= len(done.steps)

    def _schedule_reconnect(self, exc: Exception) -> None:
        if self._down_log.allow():
            log.warning(
                "torshmon: agent at %s unavailable (%s); buffering up to %d step records",
                self._socket_path,
                exc,
                self._max_buffered_steps,
            )
        self._connect_failures += 1
        delay_s = backoff_s(self._connect_failures, initial_s=0.1, max_s=self._reconnect_max_s)
        self._next_connect = time.monotonic() + delay_s

    def _disconnect(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _device_timings(raw: RawStep) -> Iterator[PendingTiming]:
    yield from (e.device for e in raw.events.collectives if e.device is not None)
    if raw.events.marks is not None:
        yield raw.events.marks


def replace_clock(record: StepRecord, clock: str) -> StepRecord:
    """``record`` saying which clock timed its collectives."""
    return msgspec.structs.replace(record, collective_clock=clock)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("agent closed the connection")
        chunks += chunk
    return bytes(chunks)


def _recv_frame(sock: socket.socket) -> bytes:
    return _recv_exact(sock, frame_length(_recv_exact(sock, FRAME_HEADER.size)))
