"""The command book: commands for running jobs, from submission to acknowledgement.

Only a job's rank 0 takes commands (a config switch needs consensus, never timing), so a command
waits here until the agent serving that rank posts its next batch; it goes back in
the ingest reply, and the probe's acknowledgement (accepted, applied at step N, or
rejected with a reason) comes back in a later batch. The exception is an evidence
capture, which every rank takes at once (a hung job agrees on no step): it goes to
every agent serving a rank of the job while it is young (``fan_out``). A command sent but never
acknowledged (the reply was lost, the job ended) expires after ``timeout_s``.
Not thread-safe: the aggregator calls it from its event loop only.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from torshmon.wire import Command, CommandAck

KINDS: Final = frozenset({"config", "link_check", "evidence"})
#: Kinds every agent serving a rank of the job receives, not only rank 0's.
FAN_OUT_KINDS: Final = frozenset({"evidence"})
FINAL_STATES: Final = frozenset({"applied", "rejected", "expired"})


class CommandError(ValueError):
    """A command that cannot be submitted; the text names what is wrong."""


@dataclass(frozen=True, slots=True)
class CommandStatus:
    """Where one command stands; times are Unix seconds."""

    command: Command
    status: str
    created_unix_s: float
    updated_unix_s: float
    reason: str = ""
    version: int | None = None
    effective_step: int | None = None

    @property
    def done(self) -> bool:
        return self.status in FINAL_STATES


class CommandBook:
    """Pending and recent commands per job. ``on_change`` sees every status change."""

    def __init__(
        self,
        *,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[CommandStatus], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._on_change = on_change
        self._status: dict[str, CommandStatus] = {}
        self._pending: dict[str, list[str]] = {}
        #: job -> {fan-out command id: the agents it was handed to}
        self._fan_out: dict[str, dict[str, set[str]]] = {}

    def new(
        self,
        job: str,
        kind: str,
        args: Mapping[str, object],
        *,
        command_id: str | None = None,
        run_id: str = "",
    ) -> Command:
        """A validated command with ``command_id`` or a fresh id (not yet queued: store it,
        then ``add``), for ``job``'s run ``run_id`` ("": whichever run's rank 0)."""
        if kind not in KINDS:
            raise CommandError(f"unknown command kind {kind!r}; allowed: {sorted(KINDS)}")
        if not job or len(job) > 200:
            raise CommandError("job must be a non-empty name of at most 200 characters")
        if kind == "link_check":
            _check_link_check_args(args)
        if kind == "evidence":
            _check_evidence_args(args)
        command_id = command_id or uuid.uuid4().hex[:16]
        return Command(id=command_id, job=job, kind=kind, args=dict(args), run_id=run_id)

    def add(self, command: Command) -> CommandStatus:
        """Queue ``command`` for its job's rank-0 agent."""
        now = self._clock()
        status = CommandStatus(command, "pending", now, now)
        self._status[command.id] = status
        if command.kind in FAN_OUT_KINDS:
            self._fan_out.setdefault(command.job, {})[command.id] = set()
        else:
            self._pending.setdefault(command.job, []).append(command.id)
        self._changed(status)
        return status

    def fan_out(self, agent: str, jobs: Iterable[str]) -> list[Command]:
        """The fan-out commands of ``jobs`` younger than ``timeout_s`` that ``agent`` was
        not handed yet, oldest first; handed from now on (``unfan`` if the reply fails)."""
        now = self._clock()
        out: list[Command] = []
        for job in jobs:
            offers = self._fan_out.get(job)
            if not offers:
                continue
            for command_id, agents in list(offers.items()):
                status = self._status.get(command_id)
                if status is None or now - status.created_unix_s > self.timeout_s:
                    del offers[command_id]
                elif agent not in agents:
                    agents.add(agent)
                    out.append(status.command)
        return out

    def unfan(self, agent: str, ids: Iterable[str]) -> None:
        """Fan-out commands whose reply to ``agent`` failed: hand them to it again."""
        for command_id in ids:
            status = self._status.get(command_id)
            if status is not None:
                self._fan_out.get(status.command.job, {}).get(command_id, set()).discard(agent)

    def reserve(self, jobs: Iterable[str]) -> list[Command]:
        """Take the commands of ``jobs`` not yet sent out of their queues, oldest first,
        for one ingest reply: ``sent`` once it is committed, ``release`` if it fails.
        Until then no other reply takes them."""
        out: list[Command] = []
        for job in jobs:
            queue = self._pending.pop(job, None)
            if queue:
                out.extend(self._status[i].command for i in queue)
        return out

    def release(self, ids: Iterable[str]) -> None:
        """Reserved commands whose reply failed: first in their queues again."""
        for command_id in reversed(list(ids)):
            status = self._status.get(command_id)
            if status is None or status.status != "pending":
                continue
            if status.command.kind in FAN_OUT_KINDS:
                continue
            queue = self._pending.setdefault(status.command.job, [])
            if command_id not in queue:
                queue.insert(0, command_id)

    def sent(self, ids: Iterable[str]) -> None:
        """Those commands went out in a committed ingest reply."""
        changed = []
        for command_id in ids:
            status = self._status.get(command_id)
            if status is None or status.status != "pending":
                continue
            queue = self._pending.get(status.command.job, [])
            if command_id in queue:
                queue.remove(command_id)
            status = replace(status, status="sent", updated_unix_s=self._clock())
            self._status[command_id] = status
            changed.append(status)
        for status in changed:
            self._changed(status)

    def acked(self, ack: CommandAck) -> CommandStatus | None:
        """Apply a probe's acknowledgement; None for an unknown command."""
        status = self._status.get(ack.id)
        if status is None or status.done:
            return None
        status = replace(
            status,
            status=ack.status,
            reason=ack.reason,
            version=ack.version,
            effective_step=ack.effective_step,
            updated_unix_s=self._clock(),
        )
        self._status[ack.id] = status
        self._changed(status)
        return status

    def expire(self) -> list[CommandStatus]:
        """Mark sent commands with no final answer after ``timeout_s`` as expired."""
        now = self._clock()
        expired = []
        for command_id, status in self._status.items():
            if not status.done and (now - status.created_unix_s > self.timeout_s):
                status = replace(
                    status,
                    status="expired",
                    reason=f"no final acknowledgement within {self.timeout_s:g} s",
                    updated_unix_s=now,
                )
                self._status[command_id] = status
                queue = self._pending.get(status.command.job, [])
                if command_id in queue:
                    queue.remove(command_id)
                expired.append(status)
        # Forget finished commands after a while so the book stays small.
        for command_id in [
            i
            for i, s in self._status.items()
            if s.done and now - s.updated_unix_s > 10 * self.timeout_s
        ]:
            del self._status[command_id]
        for job, offers in list(self._fan_out.items()):
            for command_id in [i for i in offers if i not in self._status]:
                del offers[command_id]
            if not offers:
                del self._fan_out[job]
        for status in expired:
            self._changed(status)
        return expired

    def get(self, command_id: str) -> CommandStatus | None:
        return self._status.get(command_id)

    def _changed(self, status: CommandStatus) -> None:
        if self._on_change is not None:
            self._on_change(status)


#: What a "link_check" command may set (the probe's ``_LINK_CHECK_ARGS``).
LINK_CHECK_ARGS: Final = ("size_bytes", "repeats")


def _check_link_check_args(args: Mapping[str, object]) -> None:
    """CommandError naming an unknown field or a value that is not an integer: the API
    answers 400 at once, whichever endpoint took it, instead of the probe rejecting it
    a round trip later."""
    unknown = sorted(set(args) - set(LINK_CHECK_ARGS))
    if unknown:
        allowed = ", ".join(LINK_CHECK_ARGS)
        raise CommandError(f"unknown field(s) {', '.join(unknown)}; allowed: {allowed}")
    for name in LINK_CHECK_ARGS:
        value = args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CommandError(f"{name} must be an integer, got {value!r}")


#: What an "evidence" command may set (``torshmon.probe.evidence.ARGS``).
EVIDENCE_ARGS: Final = ("profile_ranks", "profile_steps")
MAX_PROFILE_STEPS: Final = 20


def _check_evidence_args(args: Mapping[str, object]) -> None:
    """CommandError naming an unknown field or a bad value, before any probe sees it."""
    unknown = sorted(set(args) - set(EVIDENCE_ARGS))
    if unknown:
        allowed = ", ".join(EVIDENCE_ARGS)
        raise CommandError(f"unknown field(s) {', '.join(unknown)}; allowed: {allowed}")
    ranks = args.get("profile_ranks", [])
    if not isinstance(ranks, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
    ):
        raise CommandError(f"profile_ranks must be a list of ranks, got {ranks!r}")
    steps = args.get("profile_steps")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_PROFILE_STEPS
    ):
        raise CommandError(
            f"profile_steps must be an integer from 1 to {MAX_PROFILE_STEPS}, got {steps!r}"
        )
