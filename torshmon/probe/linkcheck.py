"""Pairwise link checks: every pair of ranks exchanges a block of bytes, timed.

On a slow link every rank's collectives slow down alike (a ring all-reduce runs at
the pace of its slowest link), so per-rank timings cannot say whose link is slow.
An active test can: ranks are paired in a round-robin tournament (the circle
method), and in each round each pair sends ``size_bytes`` each way at once. A pair
is only as fast as the slower of its two links, so the rank whose pairs are all
slow is the one at fault (the aggregator decides, see
``torshmon.aggregator.core.linkcheck``).

Ranks that share a host (one network address) talk over loopback or shared memory,
not over the host's NIC, so their pairs say nothing of it; worse, a rank's best
pair is then its same-host partner, which hides a slow NIC. The check is therefore
run per host (``schedule``): first one representative per host (its lowest rank)
against the other hosts' representatives, alone on the NIC, then every pair within
each host, all hosts at once. With one rank per host the first part is the whole
tournament; with all ranks on one host the second is. Each rank learns the hosts
(``host_key``) once, through one all-gather on the side group.

The check runs on the probe's side gloo group (the one the config consensus uses),
at a step boundary agreed through that consensus, so every rank runs the same
rounds in the same order and gloo's point-to-point tags never cross. Each pair first
swaps one byte, so that a peer still busy in its previous round is not counted as
link time.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from torshmon.probe.runqueue import ProcessRunQueue

#: Bytes each rank of a pair sends (and receives) by default: about 9 ms per round
#: at 1 Gbit/s, 1-2 ms over unshaped local veths, 90 ms at 100 Mbit/s. Rounds run
#: one after another (``rounds``: 3 at 3 ranks, 7 at 8), each at the pace of its pair.
DEFAULT_SIZE_BYTES: Final = 2**20
MIN_SIZE_BYTES: Final = 4 * 2**10
MAX_SIZE_BYTES: Final = 64 * 2**20
MAX_REPEATS: Final = 16
#: Tags of the side group's point-to-point messages (gloo matches on peer and tag).
_SYNC_TAG: Final = 7001
_DATA_TAG: Final = 7002


@dataclass(frozen=True, slots=True)
class LinkCheckRequest:
    """A check every rank runs: its ``id``, the bytes each rank of a pair sends, and how
    many times each pair exchanges them (the fastest counts: TCP may need an exchange
    to open its window again after a congested spell)."""

    id: str
    size_bytes: int = DEFAULT_SIZE_BYTES
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.id or len(self.id) > 64:
            raise ValueError(f"link check id must be 1..64 characters, got {self.id!r}")
        if not MIN_SIZE_BYTES <= self.size_bytes <= MAX_SIZE_BYTES:
            raise ValueError(
                f"size_bytes must be in {MIN_SIZE_BYTES}..{MAX_SIZE_BYTES}, got {self.size_bytes}"
            )
        if not 1 <= self.repeats <= MAX_REPEATS:
            raise ValueError(f"repeats must be in 1..{MAX_REPEATS}, got {self.repeats}")


@dataclass(frozen=True, slots=True)
class PeerTiming:
    """What this rank measured with one peer: bytes sent each way, seconds, and how long
    this process's threads waited for a CPU during that exchange (summed over threads;
    None where Linux's schedstat is not readable)."""

    peer: int
    size_bytes: int
    duration_s: float
    cpu_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class LinkCheckDone:
    """A finished check on this rank: at which step, how long it held the rank, timings."""

    request: LinkCheckRequest
    step: int
    duration_s: float
    peers: tuple[PeerTiming, ...]
    host: str = ""


def rounds(world_size: int) -> list[list[tuple[int, int]]]:
    """The round-robin tournament over ``world_size`` ranks (circle method).

    Every pair meets exactly once; in each round a rank is in at most one pair (with
    an odd world size one rank sits each round out). ``world_size - 1`` rounds for
    an even world size, ``world_size`` for an odd one (none for a single rank).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    players: list[int | None] = list(range(world_size))
    if world_size % 2:
        players.append(None)  # the bye
    n = len(players)
    out = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        if pairs:
            out.append(sorted(pairs))
        # Keep the first player fixed, rotate the others by one.
        players = [players[0], players[-1], *players[1:-1]]
    return out


def schedule(hosts: Sequence[str]) -> list[list[tuple[int, int]]]:
    """The rounds of a check over ranks on ``hosts`` (one key per rank, ``host_key``).

    First the hosts' representatives (each host's lowest rank) in a tournament over
    hosts, then each host's own tournament, every host's round ``i`` in one round.
    Every pair of representatives and every pair of ranks sharing a host meets once;
    a rank is in at most one pair per round. With every rank on its own host, or
    all on one, this is ``rounds(len(hosts))``.
    """
    members: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        members.setdefault(host, []).append(rank)
    groups = list(members.values())  # in order of their lowest rank
    out = []
    for pairs in rounds(len(groups)) if len(groups) > 1 else []:
        out.append(sorted((groups[a][0], groups[b][0]) for a, b in pairs))
    within = [[[(g[a], g[b]) for a, b in r] for r in rounds(len(g))] for g in groups]
    for i in range(max((len(w) for w in within), default=0)):
        out.append(sorted(pair for w in within if i < len(w) for pair in w[i]))
    return out


def host_key() -> str:
    """What ranks sharing this host (and its NIC) have in common: the address this
    process reaches ``MASTER_ADDR`` from (no packet is sent), or without one the
    hostname. Ranks in separate network namespaces of one machine count apart."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "29500")
    if addr:
        try:
            family, kind, _, _, target = socket.getaddrinfo(addr, int(port), 0, socket.SOCK_DGRAM)[
                0
            ]
            with socket.socket(family, kind) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0])
        except (OSError, ValueError, IndexError):
            pass
    return socket.gethostname()[:64]


#: Bytes of one rank's string in ``gather_strings``: a length byte and up to 255 bytes.
_STRING_SLOT = 256


def gather_strings(group: Any, value: str) -> list[str]:
    """Every rank's ``value`` (UTF-8, at most 255 bytes kept), in group-rank order: one
    all-gather on ``group`` (a gloo backend; collective). ``all_gather_object`` would need
    a group in torch's registry, which the side group is not."""
    data = value.encode()[: _STRING_SLOT - 1]
    mine = torch.zeros(_STRING_SLOT, dtype=torch.uint8)
    mine[0] = len(data)
    if data:
        mine[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = [torch.zeros(_STRING_SLOT, dtype=torch.uint8) for _ in range(group.size())]
    group.allgather([slots], [mine]).wait()
    return [bytes(slot[1 : 1 + int(slot[0])].tolist()).decode(errors="replace") for slot in slots]


def run_link_check(
    group: Any,
    rank: int,
    world_size: int,
    size_bytes: int,
    repeats: int = 1,
    hosts: Sequence[str] | None = None,
) -> list[PeerTiming]:
    """Run the check's rounds on ``group`` (a gloo ProcessGroup spanning the job); each
    pair exchanges ``repeats`` times and the fastest exchange is its timing.

    ``hosts``: each rank's ``host_key`` (None: every rank on its own host, the plain
    tournament); see ``schedule``. Collective: every rank must call it with the same
    arguments. Blocks until this rank's rounds are done; raises whatever gloo raises
    for a broken group.

    Each timing carries the run-queue delay of this process's threads during the
    exchange that counted: a host whose CPUs are busy holds up gloo's threads, and the
    exchange is then slow with the link as fast as ever.
    """
    ping = torch.zeros(1, dtype=torch.uint8)
    pong = torch.zeros(1, dtype=torch.uint8)
    send = torch.zeros(size_bytes, dtype=torch.uint8)
    recv = torch.empty(size_bytes, dtype=torch.uint8)
    timings = []
    plan = schedule(hosts) if hosts is not None else rounds(world_size)
    # Every read lists the threads again: gloo's may have started since the last.
    cpu_wait = ProcessRunQueue(refresh_every=1)
    try:
        for pairs in plan:
            peer = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
            if peer is None:
                continue
            _exchange(group, peer, ping, pong, _SYNC_TAG)
            best, best_wait = float("inf"), None
            for _ in range(repeats):
                waited = cpu_wait.read_ns()
                start = time.perf_counter()
                _exchange(group, peer, send, recv, _DATA_TAG)
                took = time.perf_counter() - start
                if took < best:
                    after = cpu_wait.read_ns()
                    best = took
                    best_wait = None
                    if waited is not None and after is not None:
                        best_wait = (after - waited) / 1e9
            timings.append(PeerTiming(peer, size_bytes, best, best_wait))
    finally:
        cpu_wait.close()
    return timings


def _exchange(group: Any, peer: int, out: torch.Tensor, into: torch.Tensor, tag: int) -> None:
    # Both posted before either is waited for: each side sends while it receives.
    sent = group.send([out], peer, tag)
    received = group.recv([into], peer, tag)
    sent.wait()
    received.wait()
