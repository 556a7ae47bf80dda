"""Run a function on several local gloo ranks, each in its own process.

Used by ``torshmon demo``, the benchmarks and the tests. Ranks are started with
the ``spawn`` method, join one gloo process group, and return plain picklable
results. Any failure or timeout stops every rank; nothing is left running.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    target: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    master_addr: str = "127.0.0.1",
    netns: Sequence[str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Call ``target(rank, world_size, *args)`` in ``world_size`` processes.

    Each process has initialised a process group of ``backend`` (gloo; ``nccl`` puts
    rank r on GPU r) before ``target`` runs and destroys it afterwards. With ``netns``
    (one ``ip netns`` name per rank, e.g. from ``torshmon.linkshape.LinkShaper``) each
    rank enters its network namespace before opening any socket. ``rank_env(rank)`` may
    set ``LOCAL_RANK`` (default: the rank, one node), as torchrun does for ranks spread
    over nodes. Returns the results ordered by rank. Raises RankError if a rank raises,
    dies, or all have not finished in ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if netns is not None and len(netns) != world_size:
        raise ValueError(f"netns needs one name per rank ({world_size}), got {len(netns)}")
    ctx = mp.get_context("spawn")
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        # One node unless ``rank_env`` says otherwise (LOCAL_RANK, as torchrun sets it).
        environ = {"LOCAL_RANK": str(rank), **(env or {})}
        environ.update(rank_env(rank) if rank_env else {})
        environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        rank_netns = netns[rank] if netns is not None else None
        proc = ctx.Process(
            target=_rank_main,
            args=(
                target,
                rank,
                world_size,
                args,
                environ,
                results,
                timeout_s,
                rank_netns,
                backend,
            ),
            name=f"torshmon-rank-{rank}",
        )
        proc.start()
        procs.append(proc)
    try:
        return _collect(procs, results, timeout_s)
    finally:
        _stop(procs)


def _collect(procs: list[Any], results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(out) + len(errors) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if not p.is_alive() and r not in out and r not in errors
            ]
            if dead and results.empty():
                # Give a dying rank's queued result a moment to arrive.
                time.sleep(0.5)
                if results.empty():
                    for r in dead:
                        errors[r] = f"rank {r} exited with code {procs[r].exitcode} and no result"
            if time.monotonic() > deadline:
                missing = [r for r in range(len(procs)) if r not in out and r not in errors]
                errors.update({r: f"rank {r} timed out after {timeout_s:.0f} s" for r in missing})
            continue
        if ok:
            out[rank] = value
        else:
            errors[rank] = value
    if errors:
        raise RankError("\n".join(errors[r] for r in sorted(errors)))
    return [out[r] for r in range(len(procs))]


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=5)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    environ: dict[str, str],
    results: Any,
    timeout_s: float,
    netns: str | None = None,
    backend: str = "gloo",
) -> None:
    if netns is not None:
        # First thing: a socket stays in the namespace it was created in.
        from torshmon.netns import enter_netns

        try:
            enter_netns(netns)
        except OSError:
            results.put((rank, False, f"rank {rank} failed:\n{traceback.format_exc()}"))
            return
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    # Ranks share the machine's cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("TORSHMON_RANK_THREADS", "1")))
    try:
        options: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            options["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **options,
        )
        try:
            value = target(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, f"rank {rank} failed:\n{traceback.format_exc()}"))
