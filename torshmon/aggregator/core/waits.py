"""Who waits for whom among a job's hung ops: the hang detector's wait graph.

``HangDetector`` (``hang``) turns in-flight reports into ``Block``s: ops ranks have
been held in past the timeout, with the members that are not in them. ``Waits`` reads
the graph they form: a rank missing from a blocked op is its cause (a culprit) unless
it is itself held in another blocked op (a victim: the chain goes on from there) or
is in flight elsewhere for less than the timeout (pending); blocked ops that wait only
on each other's ranks are a deadlock. Pure; one ``Waits`` per evaluation.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

DEFAULT_PG: Final = "default"


@dataclass(frozen=True, slots=True)
class Entry:
    """A fresh rank's op at evaluation time."""

    rank: int
    seq: int
    op: str
    age_s: float


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """An op ranks have been held in past the timeout: ``waiting`` are in it, ``missing``
    are not (empty: every member is in it, so the op itself is stuck). ``members``: the
    group's ranks, None for a point-to-point op (between ``waiting[0]`` and
    ``missing[0]``); ``known``: whether they were reported rather than seen."""

    pg: str
    op: str
    seq: int
    waiting: list[int]
    missing: list[int]
    age_s: float
    youngest_s: float
    members: list[int] | None = None
    known: bool = True


def pair_blocks(pairs: Mapping[tuple[str, int, int], Entry], timeout: float) -> list[Block]:
    """Point-to-point ops held past ``timeout``: rank r's op #k with peer p matches p's
    op #k with peer r, and only those two ranks are compared."""
    blocks = []
    for (pg, rank, peer), entry in sorted(pairs.items()):
        if entry.age_s <= timeout:
            continue
        partner = pairs.get((pg, peer, rank))
        if partner is not None and partner.seq == entry.seq:
            if partner.age_s > timeout and rank < peer:
                ages = (entry.age_s, partner.age_s)
                blocks.append(
                    Block(pg, entry.op, entry.seq, [rank, peer], [], max(ages), min(ages))
                )
            continue
        if partner is not None and partner.seq > entry.seq:
            continue  # this rank is the one behind: its peer's op names it
        blocks.append(Block(pg, entry.op, entry.seq, [rank], [peer], entry.age_s, entry.age_s))
    return blocks


class Waits:
    """Who waits for whom among a job's blocked ops, at one evaluation.

    A rank missing from a blocked op is its cause (a culprit) unless it is itself held
    in another blocked op (a victim: the chain goes on from there) or is in flight
    elsewhere for less than the timeout (pending: its own wait is judged once it has
    lasted). Blocked ops that wait only on each other's ranks are a deadlock.
    """

    def __init__(
        self,
        blocks: list[Block],
        groups: Mapping[str, Mapping[int, Entry]],
        pairs: Mapping[tuple[str, int, int], Entry],
        timeout: float,
        young: Sequence[Block] = (),
    ) -> None:
        """``young``: ops ranks wait in for less than ``timeout`` (only for victims)."""
        self.blocks = blocks
        self.timeout = timeout
        self._groups = groups
        self._pairs = pairs
        self.waits_in: dict[int, list[Block]] = {}
        self._held_up: dict[int, set[int]] = {}
        for block in blocks:
            for rank in block.waiting:
                self.waits_in.setdefault(rank, []).append(block)
            for rank in block.missing:
                self._held_up.setdefault(rank, set()).update(block.waiting)
        # Where each waiting rank is, for the findings' text: a blocked op first.
        self._where: dict[int, Block] = {}
        for block in [*blocks, *young]:
            for rank in block.waiting:
                self._where.setdefault(rank, block)
        for block in young:
            for rank in block.missing:
                self._held_up.setdefault(rank, set()).update(block.waiting)
        self._busy = {e.rank for entries in groups.values() for e in entries.values()}
        self._busy.update(rank for _pg, rank, _peer in pairs)

    def own(self, block: Block, rank: int) -> Entry | None:
        """``rank``'s own op on ``block``'s group (with its peer for point-to-point)."""
        if block.members is None:
            return self._pairs.get((block.pg, rank, block.waiting[0]))
        return self._groups.get(block.pg, {}).get(rank)

    def role(self, block: Block, rank: int) -> str:
        """ "culprit", "victim" or "pending" for a rank missing from ``block``."""
        own = self.own(block, rank)
        if own is not None and own.seq != block.seq:
            return "culprit"  # behind on an older op of the group, or skipped this one
        if rank in self.waits_in:
            return "victim"
        if rank in self._busy:
            return "pending"  # in flight elsewhere, not yet for long
        return "culprit"

    def deadlocked(self) -> list[Block]:
        """Blocked ops from which no chain of waits reaches a cause: their ranks wait
        in a cycle (collectives issued in different orders on different ranks)."""
        leads: dict[int, bool] = {}
        for i, block in enumerate(self.blocks):
            leads[i] = not block.missing or any(
                self.role(block, rank) != "victim" for rank in block.missing
            )
        index = {id(block): i for i, block in enumerate(self.blocks)}
        changed = True
        while changed:
            changed = False
            for i, block in enumerate(self.blocks):
                if leads[i]:
                    continue
                if any(
                    leads[index[id(there)]]
                    for rank in block.missing
                    for there in self.waits_in.get(rank, ())
                ):
                    leads[i] = changed = True
        return [block for i, block in enumerate(self.blocks) if not leads[i]]

    def behind(self, victims: list[int], direct: list[int]) -> str:
        """ "; ranks 0, 1 wait behind it in <op>", for the ``victims`` not among the
        ``direct`` waiters, by the op they wait in; "" if none."""
        by_op: dict[str, list[int]] = {}
        for rank in victims:
            if rank not in direct and rank in self._where:
                by_op.setdefault(op_text(self._where[rank]), []).append(rank)
        return "".join(
            f"; {ranks_text(ranks)} wait{'s' if len(ranks) == 1 else ''} behind it in {where}"
            for where, ranks in by_op.items()
        )

    def victims(self, causes: list[int], exclude: Collection[int] = ()) -> list[int]:
        """Every rank held up, directly or through others, by the ranks ``causes``
        (but those of ``exclude``)."""
        seen = set(causes) | set(exclude)
        frontier = list(causes)
        out: set[int] = set()
        while frontier:
            rank = frontier.pop()
            for waiter in self._held_up.get(rank, ()):
                if waiter not in seen:
                    seen.add(waiter)
                    out.add(waiter)
                    frontier.append(waiter)
        return sorted(out)


def op_text(block: Block) -> str:
    return f"{block.op} #{block.seq} on pg {block.pg}"


def members_text(block: Block) -> str:
    """ " (members: ranks 0, 1)" for a known group other than the world, else ""."""
    if block.members is None or block.pg == DEFAULT_PG or not block.known:
        return ""
    return f" (members: {ranks_text(block.members)})"


def ranks_text(ranks: list[int]) -> str:
    """'rank 0' or 'ranks 0, 2, 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)
