"""Run local gloo ranks over rate-limited network links (Linux namespaces + ``tc tbf``).

Each rank gets its own network namespace with one interface, ``eth0``, joined to
a Linux bridge that lives in a separate "hub" namespace::

    rank 0 ns: eth0 10.213.0.1 ─veth─ r0 ┐
    rank 1 ns: eth0 10.213.0.2 ─veth─ r1 ├─ br0  (hub ns)
    rank 2 ns: eth0 10.213.0.3 ─veth─ r2 ┘
                                  br0 10.213.255.254  (``hub_address``)

Every world size, two ranks included, uses the bridge: one code path, and the
same hop count whatever the world size, so 2- and 3-rank timings compare. The
bridge costs one software hop, which is small next to any rate worth shaping to.
The bridge has an address of its own, ``hub_address``: a service run in the hub
namespace (an aggregator every node's agent reports to) is reachable from every
rank's namespace over links that are never shaped.
Nothing is created in the host's own namespace, so harnesses running at the same
time never collide on interface names or addresses, and deleting the namespaces
removes every link.

Shaping puts a ``tbf`` qdisc on both ends of a rank's veth: the rank-side end
limits what the rank sends, the hub-side end what it receives. Each rank thus
sees a full-duplex link of the given rate, like a NIC on a switch port.

Usage::

    with LinkShaper(world_size=2, rate="1gbit") as shaper:
        shaper.run_ranks(fn, *args, timeout_s=60)   # launch.run_ranks in the namespaces
        shaper.set_rate("100mbit", rank=1)   # one slow link, while ranks run
        shaper.set_rate(None)                # unshaped

API: :class:`LinkShaper` (``start``/``close`` or ``with``; ``links``, a
:class:`RankLink` per rank; ``netns_names``, ``master_addr``, ``rank_env(rank)``,
``set_rate(rate, rank=None)``, ``rates_bps``); :func:`parse_rate` (``"1gbit"`` to
bits/s); :func:`available` (``(ok, reason)``, for tests to skip on);
:func:`enter_netns` (what a rank process calls before it opens any socket;
``run_ranks(netns=...)`` does this); :func:`remove_leftovers`.

Needs Linux, root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (``ip``,
``tc``); otherwise LinkShapingUnavailable names what is missing. Names carry the
creating pid, so concurrent runs never collide, and a shaper first removes what
crashed runs left behind. Not thread-safe: one thread drives a shaper.

Gloo gets about 0.95x the set rate (2 ranks, 8-32 MB all_reduce: 951 Mbit/s of
payload at 1gbit, 191 at 200mbit, unshaped 5-7 Gbit/s on a 2-core machine); the
rest is TCP/IP headers, which tbf counts as a real link does. Rates near the
unshaped speed of the veths (CPU bound) shape nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torshmon.netns import NETNS_DIR, enter_netns

__all__ = [
    "LinkShaper",
    "LinkShapingError",
    "LinkShapingUnavailable",
    "RankLink",
    "available",
    "enter_netns",
    "parse_rate",
    "remove_leftovers",
]

log = logging.getLogger(__name__)

NAME_PREFIX = "torshmon-ls"
RANK_IFNAME = "eth0"
_SUBNET = "10.213"
#: The bridge's own address, in the hub namespace; above every rank's (_MAX_RANKS).
HUB_ADDRESS = f"{_SUBNET}.255.254"
_MAX_RANKS = 250 * 256
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
# A whole 64 KiB GSO super-packet must fit in the bucket, or tbf splits it in
# software on every send: with a 16 KiB bucket gloo got 0.58x of 1 Gbit/s, with
# 96 KiB or more 0.95x.
_MIN_BURST_BYTES = 96 * 1024
_COMMAND_TIMEOUT_S = 30.0
_instances = itertools.count()

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*", re.IGNORECASE)


class LinkShapingError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message names the command and its output."""


class LinkShapingUnavailable(LinkShapingError):
    """This machine cannot run namespaced ranks; the message names what is missing."""


@dataclass(frozen=True, slots=True)
class RankLink:
    """Where one rank lives: its namespace, its interface there, and its IPv4 address."""

    rank: int
    netns: str
    ifname: str
    address: str


def parse_rate(text: str) -> int:
    """Parse a link rate such as ``"1gbit"``, ``"200mbit"``, ``"1.5gbit"`` into bits/s.

    Units are tc's bit units with SI prefixes (``bit``, ``kbit``, ``mbit``, ``gbit``,
    ``tbit``), case-insensitive. Byte units (tc's ``mbps`` means megabytes/s) are
    refused as too easy to misread. Raises ValueError naming the bad text.
    """
    allowed = ", ".join(_RATE_UNITS)
    match = _RATE_RE.fullmatch(text)
    if match is None or match.group(2).lower() not in _RATE_UNITS:
        raise ValueError(
            f"invalid link rate {text!r}: expected a number and one of {allowed} "
            "(bits per second, SI prefixes), e.g. '1gbit' or '200mbit'"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])
    if bits < 8:
        raise ValueError(f"invalid link rate {text!r}: must be at least 8bit")
    return bits


def available() -> tuple[bool, str]:
    """Whether namespaced, shaped links can be built here, and if not, why.

    Checks the platform, privileges and tools, then builds and removes a tiny
    namespace with a shaped veth (about 50 ms) to catch missing kernel support.
    """
    missing = _missing_prerequisite()
    if missing is not None:
        return False, missing
    name = f"{NAME_PREFIX}-{os.getpid()}-probe{next(_instances)}"
    try:
        _ip("netns", "add", name)
        try:
            _ip("-n", name, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1")
            _tc("-n", name, "qdisc", "add", "dev", "v0", "root", *_tbf_args(10**9, None, 50.0))
        finally:
            _ip("netns", "del", name)
    except LinkShapingError as exc:
        return False, f"link shaping probe failed: {exc}"
    return True, "network namespaces, veth, bridge and tc tbf are usable"


class LinkShaper:
    """Namespaces, veths and tbf qdiscs for ``world_size`` local ranks; a context manager.

    ``rate`` is the per-rank link rate (see :func:`parse_rate`); None leaves the
    links unshaped. ``burst_bytes`` is the tbf bucket (default: 2 ms at the rate,
    at least 96 KiB); ``latency_ms`` bounds how long a packet may wait in the
    qdisc before tbf drops it. Setup and teardown run ``ip``/``tc`` (tens of ms
    each). Raises LinkShapingUnavailable without root or iproute2, and
    LinkShapingError when a command fails.
    """

    def __init__(
        self,
        world_size: int,
        rate: str | None = "1gbit",
        *,
        burst_bytes: int | None = None,
        latency_ms: float = 50.0,
    ) -> None:
        if not 1 <= world_size <= _MAX_RANKS:
            raise ValueError(f"world_size must be in 1..{_MAX_RANKS}, got {world_size}")
        if burst_bytes is not None and burst_bytes < 2048:
            raise ValueError(f"burst_bytes must be >= 2048 (one MTU), got {burst_bytes}")
        if not latency_ms > 0:
            raise ValueError(f"latency_ms must be > 0, got {latency_ms}")
        self.world_size = world_size
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        self._initial_rate_bps = parse_rate(rate) if rate is not None else None
        # Unique per instance and process, so parallel test runs never share names.
        self.prefix = f"{NAME_PREFIX}-{os.getpid()}-{next(_instances)}"
        self.hub_netns = f"{self.prefix}-hub"
        self.links = tuple(
            RankLink(rank, f"{self.prefix}-r{rank}", RANK_IFNAME, _address(rank))
            for rank in range(world_size)
        )
        self._rates_bps: list[int | None] = [None] * world_size
        self._started = False

    @property
    def master_addr(self) -> str:
        """Rank 0's address, reachable from every rank's namespace."""
        return self.links[0].address

    @property
    def hub_address(self) -> str:
        """The bridge's address in ``hub_netns``, reachable from every rank's namespace."""
        return HUB_ADDRESS

    @property
    def netns_names(self) -> list[str]:
        """One namespace name per rank, for ``run_ranks(netns=...)``."""
        return [link.netns for link in self.links]

    @property
    def rates_bps(self) -> tuple[int | None, ...]:
        """The current per-rank link rate in bits/s; None where unshaped."""
        return tuple(self._rates_bps)

    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment for ``rank``: makes gloo use the rank's namespaced interface."""
        return {"GLOO_SOCKET_IFNAME": self.links[rank].ifname}

    def run_ranks(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``launch.run_ranks`` with one rank in each of this shaper's namespaces."""
        from torshmon.launch import run_ranks

        return run_ranks(
            target,
            self.world_size,
            *args,
            netns=self.netns_names,
            rank_env=self.rank_env,
            master_addr=self.master_addr,
            **kwargs,
        )

    def start(self) -> LinkShaper:
        """Create the namespaces, links and qdiscs; undoes everything it made on failure."""
        if self._started:
            raise RuntimeError("LinkShaper already started")
        missing = _missing_prerequisite()
        if missing is not None:
            raise LinkShapingUnavailable(missing)
        remove_leftovers(self.prefix)
        self._started = True
        try:
            self._build()
            if self._initial_rate_bps is not None:
                self._apply(range(self.world_size), self._initial_rate_bps)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace (and with them every link); safe to call twice.

        Attempts every deletion, then raises one LinkShapingError listing all failures.
        """
        if not self._started:
            return
        self._started = False
        self._rates_bps = [None] * self.world_size
        errors = []
        for name in [*self.netns_names, self.hub_netns]:
            if not os.path.exists(os.path.join(NETNS_DIR, name)):
                continue
            try:
                _ip("netns", "del", name)
            except LinkShapingError as exc:
                errors.append(str(exc))
        if errors:
            raise LinkShapingError("cleanup failed:\n" + "\n".join(errors))

    def __enter__(self) -> LinkShaper:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except LinkShapingError:
            if exc is None:
                raise
            # Keep the body's exception as the one the caller sees.
            log.exception("link shaper cleanup failed while handling %r", exc)

    def set_rate(self, rate: str | None, rank: int | None = None) -> None:
        """Change the link rate of one rank (both directions), or of all when ``rank`` is None.

        None removes shaping. Safe while ranks run: tbf is replaced in place, and
        open connections just see a different rate.
        """
        if not self._started:
            raise RuntimeError("LinkShaper is not started")
        if rank is not None and not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        ranks = range(self.world_size) if rank is None else [rank]
        self._apply(ranks, parse_rate(rate) if rate is not None else None)

    def _build(self) -> None:
        _ip("netns", "add", self.hub_netns)
        hub = ("-n", self.hub_netns)
        _ip(*hub, "link", "add", "name", "br0", "type", "bridge")
        _ip(*hub, "addr", "add", f"{HUB_ADDRESS}/16", "dev", "br0")
        _ip(*hub, "link", "set", "br0", "up")
        _ip(*hub, "link", "set", "lo", "up")
        for link in self.links:
            _ip("netns", "add", link.netns)
            peer = _hub_ifname(link.rank)
            _ip(*hub, "link", "add", "name", peer, "type", "veth",
                "peer", "name", link.ifname, "netns", link.netns)  # fmt: skip
            _ip(*hub, "link", "set", peer, "master", "br0", "up")
            here = ("-n", link.netns)
            _ip(*here, "addr", "add", f"{link.address}/16", "dev", link.ifname)
            _ip(*here, "link", "set", link.ifname, "up")
            # A rank reaches its own address through lo, e.g. rank 0 and its TCPStore.
            _ip(*here, "link", "set", "lo", "up")

    def _apply(self, ranks: Sequence[int], rate_bps: int | None) -> None:
        for rank in ranks:
            link = self.links[rank]
            ends = [(link.netns, link.ifname), (self.hub_netns, _hub_ifname(rank))]
            for netns, ifname in ends:
                if rate_bps is not None:
                    tbf = _tbf_args(rate_bps, self.burst_bytes, self.latency_ms)
                    _tc("-n", netns, "qdisc", "replace", "dev", ifname, "root", *tbf)
                elif self._rates_bps[rank] is not None:
                    _tc("-n", netns, "qdisc", "del", "dev", ifname, "root")
            self._rates_bps[rank] = rate_bps


def remove_leftovers(prefix: str = NAME_PREFIX) -> list[str]:
    """Delete namespaces left by crashed shapers; returns the names removed.

    Removes those named with ``prefix`` (ours, if a dead process had our pid)
    and those of any shaper whose process no longer exists. Best effort: a
    namespace that will not go is logged and skipped.
    """
    removed = []
    for name in _list_netns():
        if not (name.startswith(prefix + "-") or _owner_is_dead(name)):
            continue
        try:
            _ip("netns", "del", name)
            removed.append(name)
        except LinkShapingError as exc:
            log.warning("could not remove leftover namespace %s: %s", name, exc)
    if removed:
        log.info("removed %d leftover namespaces: %s", len(removed), ", ".join(removed))
    return removed


def _list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _owner_is_dead(name: str) -> bool:
    match = re.fullmatch(re.escape(NAME_PREFIX) + r"-(\d+)-.*", name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _address(rank: int) -> str:
    host = rank + 1  # 10.213.0.0 is the network's own address
    return f"{_SUBNET}.{host // 256}.{host % 256}"


def _hub_ifname(rank: int) -> str:
    return f"r{rank}"


def _tbf_args(rate_bps: int, burst_bytes: int | None, latency_ms: float) -> list[str]:
    if burst_bytes is None:
        burst_bytes = max(_MIN_BURST_BYTES, rate_bps // 8 // 500)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst_bytes),
            "latency", f"{latency_ms:g}ms"]  # fmt: skip


def _missing_prerequisite() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH: install iproute2 (apt-get install iproute2)"
    capabilities = _effective_capabilities()
    for bit, cap in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")):
        if capabilities is not None and not capabilities >> bit & 1:
            who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
            return f"network namespaces need root with {cap}; running as {who} without it"
    return None


def _effective_capabilities() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return None


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(*args: str) -> None:
    _run(["tc", *args])


def _run(command: list[str]) -> None:
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LinkShapingError(f"{' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        raise LinkShapingError(f"{' '.join(command)} exited with {done.returncode}: {output}")
