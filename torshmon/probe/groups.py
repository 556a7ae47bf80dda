"""The process groups this rank belongs to, with their members, for the hang detector.

A hang is judged against a group's members: a rank that belongs to a group and never
entered its collective is the culprit. The in-flight reports name a group but not who
is in it, so each rank reports its groups' members too, read from torch's own registry
of groups (``_torch_compat.process_groups``: every creation path registers there, and
groups made before attach are in it). ``GroupRegistry.take`` decides which batch
carries them (see ``torshmon.wire.Batch``).

Thread safety: ``take`` and ``resend`` are called from the shipper thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from torshmon.probe import _torch_compat
from torshmon.ratelog import LogLimiter
from torshmon.wire import InflightOp, ProcessGroupMembers

log = logging.getLogger(__name__)

#: An op in flight this long may be a hang: its batch carries the groups, so an
#: aggregator that restarted during a hang judges it with the members.
_STALE_OP_S = 1.0
#: While torch's registry holds as many groups as at the last look, it is read again
#: only this often: a group destroyed and another made in its place between two sends
#: is sent this late at most. Reading and comparing every group at each send was a
#: tenth of an urgent send's work.
_RECHECK_S = 1.0
#: At most this many ranks listed per batch (about 8 bytes each on the wire); groups
#: past it are left out, so a batch never exceeds the frame limit.
MAX_LISTED_RANKS = 200_000


def group_label(pg: Any, default_group: Any) -> str:
    """The ``pg`` label of a group, as the collective wrappers name it in flight."""
    return "default" if pg is default_group else str(pg.group_name)


class GroupRegistry:
    """This rank's process groups and when to send them again.

    ``default_group``: the world group (labelled ``default``); ``world_size`` its size
    (the fallback where torch's registry cannot be read: only the world group is known).
    ``resend_s``: the groups are sent at least this often; ``clock``: monotonic seconds.
    """

    def __init__(
        self,
        default_group: Any,
        world_size: int,
        *,
        resend_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default_group = default_group
        self._world_size = world_size
        self._resend_s = resend_s
        self._clock = clock
        self._cache: dict[Any, ProcessGroupMembers] = {}
        self._sent: list[ProcessGroupMembers] | None = None
        self._next_s = 0.0
        self._count: int | None = None  # the registry's size at the last look
        self._recheck_s = 0.0
        self._failure_log = LogLimiter()

    def snapshot(self) -> list[ProcessGroupMembers]:
        """The groups this rank belongs to now, ordered by label."""
        found = _torch_compat.process_groups()
        if found is None:
            if self._failure_log.allow("registry"):
                log.warning(
                    "torshmon: torch's process group registry is unreadable; "
                    "only the world group's members are reported"
                )
            world = ProcessGroupMembers(pg="default", ranks=list(range(self._world_size)))
            return [world]
        groups = []
        listed = 0
        for pg, ranks in found:
            entry = self._cache.get(pg)
            if entry is None:
                entry = self._describe(pg, ranks)
                if entry is None:
                    continue
                self._cache[pg] = entry
            listed += len(entry.ranks)
            if listed > MAX_LISTED_RANKS:
                if self._failure_log.allow("too many"):
                    log.warning(
                        "torshmon: over %d ranks in this rank's groups; the rest are not reported",
                        MAX_LISTED_RANKS,
                    )
                break
            groups.append(entry)
        if len(self._cache) > len(found):
            live = {id(pg) for pg, _ in found}
            self._cache = {pg: e for pg, e in self._cache.items() if id(pg) in live}
        return sorted(groups, key=lambda g: g.pg)

    def _describe(self, pg: Any, ranks: list[int]) -> ProcessGroupMembers | None:
        try:
            label = group_label(pg, self._default_group)
            desc = str(getattr(pg, "group_desc", "") or "")
        except Exception:
            if self._failure_log.allow("describe"):
                log.warning("torshmon: could not name a process group", exc_info=True)
            return None
        if len(label) > 64:
            return None  # the wire's label limit; its ops cannot be reported either
        return ProcessGroupMembers(pg=label, ranks=ranks, desc=desc[:64])

    def resend(self) -> None:
        """Send the groups with the next batch (a new connection: its agent, or the
        aggregator behind it, may not know them)."""
        self._sent = None

    def take(self, inflight: Sequence[InflightOp]) -> list[ProcessGroupMembers]:
        """The groups for the batch being built, or [] if it need not carry them: they
        go when they changed, after ``resend``, every ``resend_s``, and while an op of
        ``inflight`` has been in flight for a second or more."""
        now = self._clock()
        stale = any(op.age_s >= _STALE_OP_S for op in inflight)
        count = _torch_compat.process_group_count()
        if (
            self._sent is not None
            and not stale
            and now < self._next_s
            and now < self._recheck_s
            and count is not None
            and count == self._count
        ):
            return []  # nothing made or destroyed since the last look
        try:
            current = self.snapshot()
        except Exception:  # telemetry never breaks the shipper's cycle
            if self._failure_log.allow("snapshot"):
                log.warning("torshmon: could not list the process groups", exc_info=True)
            return []
        self._count, self._recheck_s = count, now + _RECHECK_S
        if current == self._sent and now < self._next_s and not stale:
            return []
        self._sent = current
        self._next_s = now + self._resend_s
        return current
