"""Hung collectives, named by the rank that holds them up, from in-flight reports.

In: per rank, its latest report of in-flight operations (``observe``: the oldest
unfinished op per process group, numbered per group; per group and peer for
point-to-point), the groups each probe belongs to (``observe_groups``), the job's world
size (``set_world``) and typical step duration (``observe_step_duration``); at
``evaluate``, each node's horizon (the newest time its agent's data is current for) and
the ranks whose process ended.

Out: ``Finding`` records of kind ``hang``. A collective some members have been in for
longer than the timeout while others are not in it is blocked; the chain of waits is
followed to its end and the rank there is named (the culprit: it never joined, is stuck
on an older op, stopped reporting, exited, or is in a deadlock), with the ranks waiting
behind it in ``details["victims"]``; victims are never named. A collective every member
joined that is still stuck gets one finding without a rank. Ranks whose node's agent
has gone quiet are neither waiting nor named, and a rank that said it closed is never a
culprit.

Knobs (``HangSettings``, section ``hang``): ``timeout_s`` (5 s) makes a collective
hung, lowered in jobs of short steps to ``step_multiple`` (20) typical steps but never
under ``min_timeout_s`` (2 s); ``fresh_s`` (3 s) is how long a node's agent may send
nothing new before its ranks' reports stop counting as evidence.

Why each rule is as it is (membership, ages, silence, closed ranks):
docs/detectors/hang.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final, Protocol

from torshmon.aggregator.core.findings import Finding
from torshmon.aggregator.core.waits import (
    DEFAULT_PG,
    Block,
    Entry,
    Waits,
    members_text,
    op_text,
    pair_blocks,
    ranks_text,
)
from torshmon.settings import Section, SettingsError, setting

#: How late past its own time a report may arrive and still vouch for the time since:
#: an agent POSTs at least once a second, so a report on a live channel is in within
#: about that.
LATE_ALLOWANCE_S: Final = 1.0

_NEVER_JOINED_ADVICE: Final = (
    "Rank {rank} is the one to look at: dump its Python stacks (py-spy dump --pid) to "
    "see where it is - a slow or stuck data loader, a long host-side computation, or a "
    "collective issued under a rank-dependent condition so the ranks took different "
    "code paths. The waiting ranks stay blocked until it joins or the backend times out."
)
_OLDER_ADVICE: Final = (
    "Rank {rank} is still inside an earlier operation on this group that its peers "
    "finished: dump its stacks (py-spy dump --pid) and compare the order of collectives "
    "across ranks - a mismatched order or a lost message hangs the job."
)
_SILENT_ADVICE: Final = (
    "Rank {rank} stopped reporting: check whether its process is alive (crash, OOM "
    "kill, SIGSTOP), its node and its agent; the other ranks are waiting for it."
)
_P2P_ADVICE: Final = (
    "Rank {rank} never posted the send or receive that matches {waiting}'s: dump its "
    "stacks (py-spy dump --pid) - a pipeline schedule that differs between the two ranks, "
    "a wrong peer or tag, or a rank stuck before it posts (data loader, host computation)."
)
_DEADLOCK_ADVICE: Final = (
    "The ranks wait for each other in a cycle: rank {rank} waits in a collective that a "
    "peer never joins while that peer waits for rank {rank} elsewhere - the ranks issue "
    "collectives on these groups in different orders (or under rank-dependent "
    "conditions). Compare the order of collectives across ranks (py-spy dump --pid on "
    "each, TORCH_DISTRIBUTED_DEBUG=DETAIL)."
)
_ALL_STUCK_ADVICE: Final = (
    "Every member joined, so the collective itself does not complete: suspect the network "
    "or the backend between its members - links and NICs between the nodes (NCCL_DEBUG=INFO, "
    "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME), firewalls and ports, a failing peer node. "
    "A process-group timeout will abort the job eventually."
)


class InflightLike(Protocol):
    """What the detector reads of an in-flight op (``torshmon.wire.InflightOp`` fits)."""

    @property
    def pg(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def start_unix_ns(self) -> int: ...
    @property
    def age_s(self) -> float: ...
    @property
    def peer(self) -> int | None: ...


class GroupLike(Protocol):
    """What the detector reads of a group (``torshmon.wire.ProcessGroupMembers`` fits)."""

    @property
    def pg(self) -> str: ...
    @property
    def ranks(self) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class _Op:
    pg: str
    seq: int
    op: str
    age_s: float
    peer: int | None


@dataclass(slots=True, eq=False)
class _Report:
    """A rank's latest report; updated in place by the next (every batch brings one)."""

    ts_unix_s: float
    ops: tuple[_Op, ...]
    node: str | None = None
    #: How much later than usual it arrived (its receive time less ``ts_unix_s``, less
    #: ``LATE_ALLOWANCE_S``; 0 on time): a probe replaying the batches it buffered
    #: while its agent was away delivers each late, and newer ones are still on the way.
    late_s: float = 0.0
    #: The rank's probe closed (its last batch): it finished, or runs on unmonitored.
    closed: bool = False


@dataclass(slots=True)
class _Job:
    world_size: int | None = None
    reports: dict[int, _Report] = field(default_factory=dict)
    # Non-default groups: ranks ever seen in flight on them (where none reported them).
    members: dict[str, set[int]] = field(default_factory=dict)
    # Groups' members as the probes reported them, by ``pg`` label.
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    #: Moving average of the job's step durations (None until one is observed).
    step_s: float | None = None


class HangSettings(Section, frozen=True):
    """The hang detector's settings, checked once when built."""

    timeout_s: Annotated[float, setting("seconds in a collective that make it hung", gt=0)] = 5.0
    min_timeout_s: Annotated[
        float, setting("the shortest timeout short steps may bring it down to", gt=0)
    ] = 2.0
    step_multiple: Annotated[
        float, setting("a job's timeout is at most this many typical step durations", gt=0)
    ] = 20.0
    fresh_s: Annotated[
        float,
        setting(
            "seconds a node's agent may send nothing new before its ranks' reports stop "
            "counting as evidence of a hang (an agent sends at least once a second)",
            gt=0,
        ),
    ] = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise SettingsError(f"{name} must be a finite number, got {value}")


class HangDetector:
    """Finds hung collectives and names the ranks holding them up.

    Takes the ``hang:`` section as checked when it was built (``HangSettings``). Pure
    and deterministic: ``observe`` stores the latest report per rank (O(ops)),
    ``evaluate`` derives the findings from those reports (O(ranks x ops)). Not
    thread-safe; the aggregator drives it from one task.
    """

    def __init__(self, settings: HangSettings | None = None) -> None:
        s = settings if settings is not None else HangSettings()
        self._timeout_s = s.timeout_s
        # Short steps may lower the timeout to min_timeout_s, never raise it.
        self._min_timeout_s = min(s.min_timeout_s, s.timeout_s)
        self._step_multiple = s.step_multiple
        self._fresh_s = s.fresh_s
        self._jobs: dict[str, _Job] = {}
        # Per node, the newest time its agent's data is current for, and the (job, rank)
        # whose process its agent saw end (``evaluate``).
        self._horizons: Mapping[str, float] = {}
        self._gone: Collection[tuple[str, int]] = frozenset()

    def set_world(self, job: str, world_size: int) -> None:
        """Declare the job's world size (from its hello); ValueError if below 1.

        Reports of ranks outside a new, smaller world are dropped.
        """
        if world_size < 1:
            raise ValueError(f"world_size of job {job!r} must be at least 1, got {world_size}")
        state = self._job(job)
        state.world_size = world_size
        for rank in [r for r in state.reports if r >= world_size]:
            del state.reports[rank]
        for members in state.members.values():
            members.difference_update([r for r in members if r >= world_size])
        for pg in [pg for pg, ranks in state.groups.items() if max(ranks) >= world_size]:
            del state.groups[pg]

    def observe_groups(self, job: str, groups: Sequence[GroupLike]) -> None:
        """Record process groups' members as a rank reported them (each member reports
        the same list; the latest wins). Groups naming a rank outside a declared world,
        or none, are ignored."""
        state = self._job(job)
        for group in groups:
            ranks = tuple(group.ranks)
            if not ranks or (state.world_size is not None and max(ranks) >= state.world_size):
                continue
            state.groups[group.pg] = ranks

    def observe(
        self,
        job: str,
        rank: int,
        ts_unix_s: float,
        inflight: Sequence[InflightLike],
        node: str | None = None,
        received_unix_s: float | None = None,
        *,
        closed: bool = False,
    ) -> None:
        """Record a rank's latest in-flight report (an empty list: in no collective),
        current at ``ts_unix_s``, delivered by the agent of ``node`` (None: unknown) at
        ``received_unix_s`` (None: at ``ts_unix_s``; see ``_Report.late_s``); ``closed``:
        it is the last report of the rank's probe (``wire.Closing``).

        A report older than the one held for the rank is ignored. Raises ValueError if
        ``rank`` is negative or outside a declared world size.
        """
        state = self._job(job)
        if rank < 0 or (state.world_size is not None and rank >= state.world_size):
            limit = "" if state.world_size is None else f"..{state.world_size - 1}"
            raise ValueError(f"rank of job {job!r} must be in 0{limit}, got {rank}")
        held = state.reports.get(rank)
        if held is not None and ts_unix_s < held.ts_unix_s:
            return
        ops = tuple(_Op(o.pg, o.seq, o.op, o.age_s, o.peer) for o in inflight) if inflight else ()
        late = 0.0
        if received_unix_s is not None and math.isfinite(received_unix_s):
            late = max(0.0, received_unix_s - ts_unix_s - LATE_ALLOWANCE_S)
        if held is None:
            state.reports[rank] = _Report(ts_unix_s, ops, node, late, closed)
        else:
            held.ts_unix_s, held.ops, held.node, held.late_s = ts_unix_s, ops, node, late
            held.closed = closed
        for op in ops:
            if op.peer is None and op.pg != DEFAULT_PG:
                state.members.setdefault(op.pg, set()).add(rank)

    def observe_step_duration(self, job: str, duration_s: float) -> None:
        """Feed one step duration of ``job`` (seconds); non-finite or negative ones are
        ignored. Short steps shorten the job's collective timeout (see the module doc)."""
        if not (math.isfinite(duration_s) and duration_s >= 0):
            return
        state = self._job(job)
        held = state.step_s
        state.step_s = duration_s if held is None else held + 0.1 * (duration_s - held)

    def collective_timeout_s(self, job: str) -> float:
        """How long ``job``'s peers may wait in a collective before it counts as hung."""
        state = self._jobs.get(job)
        return self._timeout_s if state is None else self._collective_timeout(state)

    def _collective_timeout(self, state: _Job) -> float:
        if state.step_s is None:
            return self._timeout_s
        scaled = self._step_multiple * state.step_s
        return min(self._timeout_s, max(self._min_timeout_s, scaled))

    def evaluate(
        self,
        now_unix_s: float,
        horizons: Mapping[str, float] | None = None,
        gone: Collection[tuple[str, int]] = frozenset(),
    ) -> list[Finding]:
        """Every hang at ``now_unix_s`` (Unix seconds), ordered by job and ``Finding.key()``.

        ``horizons``: per node, the newest time its agent's data is current for
        (``Agents.horizon``); reports from nodes not in it are taken as current.
        ``gone``: (job, rank) whose process its agent saw end: such a rank waits in no
        collective, whatever its last report said, and is named only as exited."""
        self._horizons = horizons if horizons is not None else {}
        self._gone = gone
        findings: list[Finding] = []
        for job in sorted(self._jobs):
            findings.extend(self._evaluate_job(job, self._jobs[job], now_unix_s))
        return findings

    def forget(self, job: str) -> None:
        """Drop all state of a finished job (unknown jobs are ignored)."""
        self._jobs.pop(job, None)

    def _job(self, job: str) -> _Job:
        state = self._jobs.get(job)
        if state is None:
            state = self._jobs[job] = _Job()
        return state

    def _reach(self, report: _Report, now: float) -> float:
        """How far the report's channel vouches for it: its node's horizon, or ``now``."""
        if report.node is None:
            return now
        return min(now, self._horizons.get(report.node, now))

    def _quiet(self, report: _Report, now: float) -> bool:
        """Whether the report's node has sent nothing new for more than ``fresh_s``."""
        return now - self._reach(report, now) > self._fresh_s

    def _evaluate_job(self, job: str, state: _Job, now: float) -> list[Finding]:
        timeout = self._timeout_s
        # Only reports with an op in flight give entries (usually few of a large job's).
        fresh = [
            (r, rep)
            for r, rep in state.reports.items()
            if rep.ops
            and not rep.closed
            and now - rep.ts_unix_s <= timeout
            and not self._quiet(rep, now)
            and (job, r) not in self._gone
        ]
        groups: dict[str, dict[int, Entry]] = {}
        pairs: dict[tuple[str, int, int], Entry] = {}
        for rank, report in fresh:
            # Silence after the report is not time spent in the op, unless the node's
            # agent has delivered newer data without a newer report of this rank. A
            # report that came late vouches that much less: the rank's newer reports
            # may be on their way as late (a probe catching up after an agent restart
            # showed an op it had long left, and its peers "never joined" it).
            reach = self._reach(report, now) - report.late_s
            since_report = max(0.0, reach - report.ts_unix_s)
            for op in report.ops:
                entry = Entry(rank, op.seq, op.op, op.age_s + since_report)
                if op.peer is None:
                    groups.setdefault(op.pg, {})[rank] = entry
                else:
                    pairs[(op.pg, rank, op.peer)] = entry
        timeout = self._collective_timeout(state)
        blocks = [
            block
            for pg in sorted(groups)
            if (block := self._group_block(state, pg, groups[pg], timeout)) is not None
        ]
        blocks.extend(pair_blocks(pairs, timeout))
        closed = {r for r, rep in state.reports.items() if rep.closed}
        blocks = _held_by_open(blocks, closed)
        found: dict[tuple[str, tuple[tuple[str, str], ...]], Finding] = {}
        if blocks:
            blocked = {b.pg for b in blocks if b.members is not None}
            young = _held_by_open(self._young_waits(state, groups, pairs, blocked), closed)
            waits = Waits(blocks, groups, pairs, timeout, young)
            self._attribute(job, state, now, waits, found)
        active_keys = set(found)
        state.since = {k: v for k, v in state.since.items() if k in active_keys}
        return [found[k] for k in sorted(found)]

    def _young_waits(
        self,
        state: _Job,
        groups: Mapping[str, Mapping[int, Entry]],
        pairs: Mapping[tuple[str, int, int], Entry],
        blocked: set[str],
    ) -> list[Block]:
        """Ops ranks wait in, not yet past the timeout, for members not in them: their
        ranks are victims too, named in the culprit's finding from its first report."""
        young = []
        for pg, entries in groups.items():
            members, known = self._members(state, pg)
            if pg in blocked or not known or not entries:
                continue
            counts: dict[int, int] = {}
            for e in entries.values():
                counts[e.seq] = counts.get(e.seq, 0) + 1
            seq = max(counts, key=lambda s: (counts[s], s))
            waiting = sorted(r for r, e in entries.items() if e.seq == seq)
            missing = sorted(members - set(waiting))
            if missing:
                age = max(entries[r].age_s for r in waiting)
                op = entries[waiting[0]].op
                young.append(Block(pg, op, seq, waiting, missing, age, age, sorted(members)))
        for (pg, rank, peer), entry in pairs.items():
            partner = pairs.get((pg, peer, rank))
            if partner is None or partner.seq < entry.seq:
                young.append(
                    Block(pg, entry.op, entry.seq, [rank], [peer], entry.age_s, entry.age_s)
                )
        return young

    def _members(self, state: _Job, pg: str) -> tuple[set[int], bool]:
        """The members of ``pg`` and whether they are known (reported by the probes, or
        the world for the default group) rather than the ranks seen in flight on it."""
        reported = state.groups.get(pg)
        if reported is not None:
            return set(reported), True
        if pg == DEFAULT_PG:
            if state.world_size is not None:
                return set(range(state.world_size)), True
            return set(state.reports), False
        return set(state.members.get(pg, ())), False

    def _group_block(
        self, state: _Job, pg: str, entries: dict[int, Entry], timeout: float
    ) -> Block | None:
        """The collective of ``pg`` its ranks are held in past ``timeout``, if any."""
        members, known = self._members(state, pg)
        entries = {r: e for r, e in entries.items() if r in members or not known}
        stuck_seqs = {e.seq for e in entries.values() if e.age_s > timeout}
        if not stuck_seqs:
            return None
        counts: dict[int, int] = {}
        for e in entries.values():
            counts[e.seq] = counts.get(e.seq, 0) + 1
        # The hung collective is the one most ranks wait in; on a tie the newer one,
        # since a rank lagging on an older op is the usual culprit.
        seq = max(stuck_seqs, key=lambda s: (counts[s], s))
        waiting = sorted(r for r, e in entries.items() if e.seq == seq)
        ages = [entries[r].age_s for r in waiting]
        missing = sorted(members - set(waiting))
        if not missing and min(ages) <= timeout:
            return None  # every member is in it, the last only just: not stuck yet
        return Block(
            pg=pg,
            op=entries[waiting[0]].op,
            seq=seq,
            waiting=waiting,
            missing=missing,
            age_s=max(ages),
            youngest_s=min(ages),
            members=sorted(members | set(waiting)),
            known=known,
        )

    def _attribute(
        self,
        job: str,
        state: _Job,
        now: float,
        waits: Waits,
        found: dict[tuple[str, tuple[tuple[str, str], ...]], Finding],
    ) -> None:
        """Name the root causes of the job's blocked ops; the ranks waiting because of
        them are their victims, named in their findings and never blamed."""
        culprits: dict[int, list[Block]] = {}
        for block in waits.blocks:
            for rank in block.missing:
                if waits.role(block, rank) == "culprit":
                    culprits.setdefault(rank, []).append(block)
        deadlocked = waits.deadlocked()
        cycle = {rank for block in deadlocked for rank in block.missing}
        for block in deadlocked:
            for rank in block.missing:
                culprits.setdefault(rank, []).append(block)
        for rank, held in sorted(culprits.items()):
            block = max(held, key=lambda b: (b.age_s, b.pg, b.seq))
            reason = "deadlock" if block in deadlocked else None
            named = self._missing(job, state, now, rank, block, waits, reason, cycle)
            if named is not None:
                self._add(found, state, named, now - block.age_s + waits.timeout)
        for block in waits.blocks:
            if not block.missing:
                finding = self._all_stuck(job, block, waits)
                self._add(found, state, finding, now - block.youngest_s + waits.timeout)

    def _add(
        self,
        found: dict[tuple[str, tuple[tuple[str, str], ...]], Finding],
        state: _Job,
        finding: Finding,
        began_unix_s: float,
    ) -> None:
        key = finding.key()
        held = found.get(key)
        # Two hangs with one identity (same rank, op and group) are one finding: keep
        # the older, which is the one that started the chain.
        if held is not None and held.value >= finding.value:
            return
        # The start stays where it was first seen, so report ages jittering between
        # batches do not move it.
        since = state.since.setdefault(key, began_unix_s)
        found[key] = dataclasses.replace(finding, since_unix_s=since)

    def _missing(
        self,
        job: str,
        state: _Job,
        now: float,
        rank: int,
        block: Block,
        waits: Waits,
        reason: str | None,
        cycle: Collection[int] = (),
    ) -> Finding | None:
        """The finding naming ``rank`` as the cause of ``block`` (``reason`` "deadlock",
        or None to read it from the rank's report; ``cycle``: the ranks of the deadlock,
        not its victims); None when its node went quiet."""
        report = state.reports.get(rank)
        if report is not None and self._quiet(report, now):
            return None
        own = waits.own(block, rank)
        op, seq, pg = block.op, block.seq, block.pg
        waiting = block.waiting
        who = ranks_text(waiting)
        where = f"pg {pg}" + members_text(block)
        if block.members is None:
            counterpart = "recv" if op in ("send", "isend") else "send"
            joined = (
                f"posted the {counterpart} matching {who}'s {op} #{seq} on {where}, "
                f"entered {block.age_s:.1f} s ago"
            )
        else:
            joined = f"joined {op} #{seq} on {where} that {who} entered {block.age_s:.1f} s ago"
        victims = waits.victims([rank], exclude=cycle)
        details: dict[str, object] = {
            "waiting_ranks": waiting,
            "seq": seq,
            "age_s": block.age_s,
            "victims": victims,
        }
        if block.members is not None:
            details["members"] = block.members
        advice = _P2P_ADVICE if block.members is None else _NEVER_JOINED_ADVICE
        if reason == "deadlock":
            elsewhere = waits.waits_in.get(rank, [])
            there = elsewhere[0] if elsewhere else None
            in_text = (
                ""
                if there is None
                else f": it waits in {op_text(there)} for {ranks_text(there.missing)}, a deadlock"
            )
            summary = f"rank {rank} of job {job} never {joined}{in_text}"
            advice = _DEADLOCK_ADVICE
            if there is not None:
                details["rank_op"] = there.op
                details["rank_seq"] = there.seq
                details["rank_pg"] = there.pg
        elif (job, rank) in self._gone:
            reason = "process_gone"
            summary = f"rank {rank} of job {job} has exited and never {joined}"
            advice = _SILENT_ADVICE
        elif report is None:
            reason = "no_report"
            summary = f"rank {rank} of job {job} has not reported and never {joined}"
            advice = _SILENT_ADVICE
        elif now - report.ts_unix_s > self._timeout_s:
            reason = "stopped_reporting"
            silent_s = now - report.ts_unix_s
            details["last_report_age_s"] = silent_s
            summary = (
                f"rank {rank} of job {job} stopped reporting {silent_s:.1f} s ago and never "
                f"{joined}"
            )
            advice = _SILENT_ADVICE
        elif own is not None and own.seq < seq:
            reason = "stuck_in_older_op"
            details["rank_seq"] = own.seq
            details["rank_op"] = own.op
            summary = f"rank {rank} of job {job} is stuck in {own.op} #{own.seq} and never {joined}"
            advice = _OLDER_ADVICE
        else:
            reason = "never_joined"
            summary = f"rank {rank} of job {job} never {joined}"
        if reason != "deadlock":
            summary += waits.behind(victims, waiting)
        details["reason"] = reason
        return Finding(
            kind="hang",
            labels={"job": job, "rank": str(rank), "op": op, "pg": pg},
            value=block.age_s,
            score=block.age_s / self._timeout_s,
            summary=summary,
            since_unix_s=0.0,
            recommendation=advice.format(rank=rank, waiting=who),
            severity="critical",
            details=details,
        )

    def _all_stuck(self, job: str, block: Block, waits: Waits) -> Finding:
        """The finding for ``block`` that every member entered (no rank at fault)."""
        waiting = block.waiting
        victims = waits.victims(waiting)
        if len(waiting) == 2:
            who = f"ranks {waiting[0]} and {waiting[1]}"
        else:
            who = f"all {len(waiting)} ranks"
        if block.members is None or (block.pg == DEFAULT_PG and block.known):
            joined = "every rank joined"
            who += f" of job {job}"
        elif block.known:
            joined = f"every member of pg {block.pg} joined"
            who = f"{ranks_text(waiting)} of job {job}"
        else:
            joined = "every rank seen on it joined (its members were not reported)"
            who = f"{ranks_text(waiting)} of job {job}"
        summary = (
            f"{who} have been in {block.op} #{block.seq} on pg {block.pg} for "
            f"{block.age_s:.1f} s: {joined}, the collective itself is stuck"
        )
        summary += waits.behind(victims, waiting)
        details: dict[str, object] = {
            "waiting_ranks": waiting,
            "seq": block.seq,
            "age_s": block.age_s,
            "reason": "all_stuck",
            "victims": victims,
        }
        if block.members is not None:
            details["members"] = block.members
        return Finding(
            kind="hang",
            labels={"job": job, "op": block.op, "pg": block.pg},
            value=block.age_s,
            score=block.age_s / self._timeout_s,
            summary=summary,
            since_unix_s=0.0,
            recommendation=_ALL_STUCK_ADVICE,
            severity="critical",
            details=details,
        )


def _held_by_open(blocks: list[Block], closed: Collection[int]) -> list[Block]:
    """``blocks`` without the ranks that closed among their missing: a rank that finished
    holds nothing up. A block that only closed ranks are missing from is left out (what
    a closed rank does since is unknown); one that every member is in stays."""
    if not closed:
        return blocks
    out = []
    for block in blocks:
        missing = [r for r in block.missing if r not in closed]
        if len(missing) == len(block.missing):
            out.append(block)
        elif missing:
            out.append(dataclasses.replace(block, missing=missing))
    return out
