"""Gloo ranks in real network namespaces over real tbf-shaped veth links."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from torshmon import linkshape
from torshmon.launch import RankError, run_ranks
from torshmon.linkshape import (
    LinkShaper,
    LinkShapingError,
    LinkShapingUnavailable,
    available,
    parse_rate,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 60
SHAPED_RATE = "200mbit"  # low enough that unshaped veth speed is far away, fast to measure
ALL_REDUCE_BYTES = 8_000_000  # about 0.33 s per all_reduce at 200 Mbit/s


@pytest.fixture(scope="module")
def shaping() -> None:
    ok, reason = available()
    if not ok:
        pytest.skip(reason)


def _our_netns(prefix: str) -> list[str]:
    names = os.listdir(linkshape.NETNS_DIR) if os.path.isdir(linkshape.NETNS_DIR) else []
    return [name for name in names if name.startswith(prefix)]


def _host_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in out.stdout.splitlines())


def _qdisc(netns: str, ifname: str) -> str:
    command = ["tc", "-n", netns, "qdisc", "show", "dev", ifname]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


# -- rank targets ---------------------------------------------------------------------------


def _sum_ranks(rank: int, world: int) -> tuple[float, int, list[str]]:
    import torch
    import torch.distributed as dist

    value = torch.full((1000,), float(rank + 1))
    dist.all_reduce(value)
    interfaces = sorted(name for _, name in socket.if_nameindex())
    return float(value[0]), os.stat("/proc/self/ns/net").st_ino, interfaces


def _time_all_reduce(tensor: Any, reps: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return times


def _unshaped_then_shaped(
    rank: int, world: int, nbytes: int, ready: Any, shaped: Any
) -> tuple[list[float], list[float], float]:
    """Time all_reduces, let the parent shape the links, time them again."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    unshaped = _time_all_reduce(tensor, 3)
    dist.barrier()
    if rank == 0:
        ready.set()
    if not shaped.wait(timeout=TIMEOUT_S):
        raise TimeoutError("the parent never shaped the links")
    shaped_times = _time_all_reduce(tensor, 2)
    return unshaped, shaped_times, float(tensor[0])


def _slowest_per_rep(results: list[list[float]]) -> list[float]:
    """A collective ends when its slowest rank does."""
    return [max(times) for times in zip(*results, strict=True)]


# -- jobs in namespaces ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_all_reduce_inside_their_namespaces(shaping: None, world_size: int) -> None:
    with LinkShaper(world_size, rate="1gbit") as shaper:
        results = shaper.run_ranks(_sum_ranks, timeout_s=TIMEOUT_S)
        namespace_inodes = [
            os.stat(os.path.join(linkshape.NETNS_DIR, name)).st_ino for name in shaper.netns_names
        ]
    expected = world_size * (world_size + 1) / 2
    assert [value for value, _, _ in results] == [expected] * world_size
    assert [inode for _, inode, _ in results] == namespace_inodes
    assert all(interfaces == ["eth0", "lo"] for _, _, interfaces in results)


def test_all_reduce_takes_as_long_as_the_rate_predicts(shaping: None) -> None:
    world_size = 2
    ctx = mp.get_context("spawn")
    ready, shaped = ctx.Event(), ctx.Event()
    with LinkShaper(world_size, rate=None) as shaper, ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            shaper.run_ranks,
            _unshaped_then_shaped,
            ALL_REDUCE_BYTES,
            ready,
            shaped,
            timeout_s=TIMEOUT_S,
        )
        if ready.wait(timeout=TIMEOUT_S):
            shaper.set_rate(SHAPED_RATE)  # while the ranks run, connections open
            shaped.set()
        results = job.result()
    unshaped_s = statistics.median(_slowest_per_rep([r[0] for r in results]))
    shaped_s = statistics.median(_slowest_per_rep([r[1] for r in results]))
    # Ring all_reduce sends 2*(n-1)/n of the tensor from every rank.
    payload_bits = 2 * (world_size - 1) / world_size * ALL_REDUCE_BYTES * 8
    achieved = payload_bits / shaped_s / parse_rate(SHAPED_RATE)
    assert 0.5 <= achieved <= 1.2, f"{achieved:.2f}x the rate ({shaped_s * 1e3:.0f} ms)"
    assert shaped_s > 4 * unshaped_s, f"shaped {shaped_s:.3f} s, unshaped {unshaped_s:.3f} s"
    assert [r[2] for r in results] == [world_size**6] * world_size


def test_rank_outside_a_namespace_fails_clearly(shaping: None) -> None:
    with pytest.raises(RankError, match="no-such-netns"):
        run_ranks(_sum_ranks, 2, timeout_s=TIMEOUT_S, netns=["no-such-netns-0", "no-such-netns-1"])


def test_run_ranks_wants_one_namespace_per_rank() -> None:
    with pytest.raises(ValueError, match="one name per rank"):
        run_ranks(_sum_ranks, 2, netns=["only-one"])


# -- set_rate -------------------------------------------------------------------------------


def test_set_rate_shapes_both_ends_of_one_rank_or_all(shaping: None) -> None:
    with LinkShaper(3, rate=None) as shaper:
        hub = shaper.hub_netns
        assert "tbf" not in _qdisc(shaper.links[1].netns, "eth0")
        shaper.set_rate("100mbit", rank=1)
        assert "rate 100Mbit" in _qdisc(shaper.links[1].netns, "eth0")
        assert "rate 100Mbit" in _qdisc(hub, "r1")
        assert "tbf" not in _qdisc(shaper.links[0].netns, "eth0") + _qdisc(hub, "r0")
        assert shaper.rates_bps == (None, 100_000_000, None)
        shaper.set_rate("1gbit")
        assert all("rate 1Gbit" in _qdisc(hub, f"r{rank}") for rank in range(3))
        shaper.set_rate(None, rank=2)
        assert "tbf" not in _qdisc(shaper.links[2].netns, "eth0") + _qdisc(hub, "r2")
        assert list(shaper.rates_bps) == [1_000_000_000, 1_000_000_000, None]
        with pytest.raises(ValueError, match=r"rank must be in 0\.\.2"):
            shaper.set_rate("1gbit", rank=3)


# -- cleanup --------------------------------------------------------------------------------


def test_namespaces_and_links_are_gone_after_exit(shaping: None) -> None:
    links_before = _host_links()
    with LinkShaper(3) as shaper:
        assert len(_our_netns(shaper.prefix)) == 4  # three ranks and the hub
    assert _our_netns(shaper.prefix) == []
    assert _host_links() == links_before
    shaper.close()  # twice is safe


def test_cleanup_runs_when_the_body_raises(shaping: None) -> None:
    links_before = _host_links()
    with pytest.raises(RuntimeError, match="boom"), LinkShaper(2) as shaper:
        raise RuntimeError("boom")
    assert _our_netns(shaper.prefix) == []
    assert _host_links() == links_before


def test_cleanup_runs_when_setup_fails(shaping: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_tc(*args: str) -> None:
        raise LinkShapingError("tc: simulated failure")

    monkeypatch.setattr(linkshape, "_tc", broken_tc)
    shaper = LinkShaper(2, rate="1gbit")
    with pytest.raises(LinkShapingError, match="simulated"):
        shaper.start()
    assert _our_netns(shaper.prefix) == []


def test_leftovers_of_a_dead_process_are_removed(shaping: None) -> None:
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1  # no process can have it
    leftover = f"{linkshape.NAME_PREFIX}-{dead_pid}-0-r0"
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    try:
        with LinkShaper(2, rate=None):
            assert _our_netns(leftover) == []
    finally:
        if _our_netns(leftover):
            subprocess.run(["ip", "netns", "del", leftover], check=False)


# -- availability and rates -----------------------------------------------------------------


def test_missing_privileges_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linkshape, "_effective_capabilities", lambda: 0)
    ok, reason = available()
    assert not ok
    assert "CAP_NET_ADMIN" in reason
    with pytest.raises(LinkShapingUnavailable, match="need root with CAP_NET_ADMIN"):
        LinkShaper(2).start()


def test_missing_iproute2_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    ok, reason = available()
    assert not ok
    assert "iproute2" in reason


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1gbit", 10**9),
        ("200mbit", 200 * 10**6),
        ("500kbit", 500_000),
        ("1.5Gbit", 1_500_000_000),
        (" 64 bit ", 64),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gbps", "1 GB", "fast", "", "-1gbit", "gbit", "1e9bit"])
def test_parse_rate_names_the_bad_value_and_the_units(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid link rate .*bit, kbit, mbit, gbit, tbit"):
        parse_rate(text)


def test_parse_rate_refuses_zero() -> None:
    with pytest.raises(ValueError, match="at least 8bit"):
        parse_rate("0mbit")
