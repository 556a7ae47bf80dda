"""The command sink: commands from the API, the autotuner and the link-check schedule.

A command is validated by the command book, stored in SQL, and only then queued
for its job's rank 0 (``CommandBook``), so a command an agent received is always in
the history. Link checks are also told to the live state, which reads their results
into slow-link findings. Runs on the aggregator's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from torshmon.aggregator.core.commands import CommandBook, CommandStatus

log = logging.getLogger(__name__)


class CommandStore(Protocol):
    """Where commands are stored (``torshmon.history.store.HistoryStore``)."""

    async def add_command(
        self, command_id: str, job: str, kind: str, args: Mapping[str, object], now_unix_s: float
    ) -> None: ...

    async def set_command_status(
        self, command_id: str, status: str, reason: str, updated_unix_s: float
    ) -> None: ...


class LinkChecks(Protocol):
    """The live state's link-check schedule and each job's latest run, the one its
    commands go to (``torshmon.aggregator.core.live.LiveState``)."""

    def runs(self) -> dict[str, str]: ...

    def link_checks_due(self, now_unix_s: float) -> list[tuple[str, str]]: ...

    def link_check_args(self, job: str) -> dict[str, object]: ...

    def link_check_sent(self, job: str, check_id: str, reason: str, now_unix_s: float) -> None: ...

    def link_check_done(self, job: str, check_id: str, status: str, now_unix_s: float) -> None: ...


class CommandDispatch:
    """Submits commands: validated, stored, queued; and stores those that expire.

    ``clock`` is Unix seconds. ``link_check_status`` is the command book's hook that
    hands finished link checks back to ``links``.
    """

    def __init__(
        self,
        book: CommandBook,
        store: CommandStore,
        links: LinkChecks,
        clock: Callable[[], float],
    ) -> None:
        self.book = book
        self._store = store
        self._links = links
        self._clock = clock

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object], *, command_id: str | None = None
    ) -> CommandStatus:
        """Queue a command for the rank 0 of ``job``'s latest live run (an evidence
        capture: for every rank); stored in SQL before it can be sent. ``command_id``:
        an id made by the caller.

        CommandError names a bad kind, job or argument.
        """
        run_id = self._links.runs().get(job, "")
        command = self.book.new(job, kind, args, command_id=command_id, run_id=run_id)
        await self._store.add_command(command.id, job, kind, command.args, self._clock())
        return self.book.add(command)

    async def request_link_check(
        self, job: str, args: Mapping[str, object], reason: str = "requested"
    ) -> CommandStatus:
        """Queue a link check for ``job``; its results are read into slow_link findings."""
        status = await self.submit_command(job, "link_check", args)
        self._links.link_check_sent(job, status.command.id, reason, self._clock())
        return status

    def status(self, command_id: str) -> CommandStatus | None:
        """Where a command of this process stands; None if the book does not know it."""
        return self.book.get(command_id)

    async def expire(self) -> None:
        """Expire commands that had no final answer in time, and store that."""
        for status in self.book.expire():
            await self._store.set_command_status(
                status.command.id, status.status, status.reason, status.updated_unix_s
            )

    async def send_link_checks(self, now_unix_s: float) -> None:
        """Send the link checks the live state asks for; a failure is logged and skipped."""
        for job, reason in self._links.link_checks_due(now_unix_s):
            try:
                args = self._links.link_check_args(job)
                status = await self.request_link_check(job, args, reason)
            except Exception:
                log.exception("could not send a link check to job %s", job)
                continue
            log.info("link check %s sent to job %s: %s", status.command.id, job, reason)

    def link_check_status(self, status: CommandStatus) -> None:
        """The book's hook (any thread): a finished link check goes back to the schedule."""
        if status.command.kind == "link_check" and status.done:
            self._links.link_check_done(
                status.command.job, status.command.id, status.status, self._clock()
            )
