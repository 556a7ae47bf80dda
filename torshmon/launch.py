"""Run a function on several local gloo ranks, each in its own process.

Used by ``torshmon demo``, the benchmarks and the tests. Ranks are started with
the ``spawn`` method, join one gloo process group, and return plain picklable
results. Any failure or timeout stops every rank; nothing is left running.

A fresh interpreter per rank imports torch (and DDP's ``torch._dynamo``) again:
25-30 s a launch on a loaded machine. A process that launches many times (the test
suite) calls ``use_forkserver()`` once: later launches fork their ranks from a
server that imported torch already and start in about a second. The server holds
about 400 MB for the life of the process. Each rank still sees the launching
process's environment of the moment, as under ``spawn``. Where that environment
has changed since the server started in a variable read only as an interpreter
starts (``PYTHON*``, ``LD_*``, ``TORSHMON_AUTO``), or a rank's differs from it in
one torch reads as it imports (``OMP_*``, ``MKL_*``, ``KINETO_*``), the launch uses
``spawn``: a forked rank could not see the change.
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

#: What ``use_forkserver`` preloads by default: torch and what DDP's constructor
#: imports. Not torshmon: its modules may read the environment as they import, and
#: the zero-code probe's import hooks must see the rank's own imports.
TORCH_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
)
#: Variables read as an interpreter starts (``TORSHMON_AUTO``: the zero-code
#: bootstrap's ``sitecustomize``). A spawned rank sees the launching process's
#: values, not those ``run_ranks(env=...)`` sets (they apply after start-up).
_INTERPRETER_PREFIXES = ("PYTHON", "LD_", "TORSHMON_AUTO")
#: Variables torch reads as it imports: a spawned rank sees ``env=`` values too.
_TORCH_PREFIXES = ("OMP_", "MKL_", "KINETO_")


class _Launcher:
    """The start method ``run_ranks`` uses when its caller names none."""

    def __init__(self) -> None:
        self.method = "spawn"
        #: the environment the forkserver started with (None: not started by us yet)
        self.server_environ: dict[str, str] | None = None


_launcher = _Launcher()


class RankError(RuntimeError):
    """One or more ranks failed or timed out; the message carries their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def use_forkserver(preload: Sequence[str] = TORCH_PRELOAD) -> None:
    """Make later ``run_ranks`` calls in this process (without ``start_method``) fork
    their ranks from a server that imported ``preload`` once. Call it before anything
    else in the process starts a forkserver; the server starts at the first launch."""
    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _launcher.method = "forkserver"


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
    start_method: str | None = None,
) -> list[Any]:
    """Call ``target(rank, world_size, *args)`` in ``world_size`` processes.

    Each process has initialised a process group of ``backend`` (gloo; ``nccl`` puts
    rank r on GPU r) before ``target`` runs and destroys it afterwards. With ``netns``
    (one ``ip netns`` name per rank, e.g. from ``torshmon.linkshape.LinkShaper``) each
    rank enters its network namespace before opening any socket. ``rank_env(rank)`` may
    set ``LOCAL_RANK`` (default: the rank, one node), as torchrun does for ranks spread
    over nodes. Returns the results ordered by rank. Raises RankError if a rank raises,
    dies, or all have not finished in ``timeout_s``. ``start_method`` (``spawn``,
    ``forkserver``) overrides the process default (``spawn``, see ``use_forkserver``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if netns is not None and len(netns) != world_size:
        raise ValueError(f"netns needs one name per rank ({world_size}), got {len(netns)}")
    port = free_port()
    environs = []
    for rank in range(world_size):
        # The whole environment, as a spawned rank inherits it: a forked one would
        # otherwise see the forkserver's, from when it started.
        environ = {**os.environ, "LOCAL_RANK": str(rank), **(env or {})}
        # One node unless ``rank_env`` says otherwise (LOCAL_RANK, as torchrun sets it).
        environ.update(rank_env(rank) if rank_env else {})
        environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        environs.append(environ)
    forkserver = _start_method(start_method, environs) == "forkserver"
    ctx = mp.get_context("forkserver") if forkserver else mp.get_context("spawn")
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    procs = []
    for rank, environ in enumerate(environs):
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


def _start_method(requested: str | None, environs: list[dict[str, str]]) -> str:
    if requested not in (None, "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {requested!r}")
    method = requested or _launcher.method
    if method != "forkserver":
        return method
    if _launcher.server_environ is None:
        # The server starts with this launch, from this environment.
        _launcher.server_environ = dict(os.environ)
    server = _launcher.server_environ
    if _some(os.environ, _INTERPRETER_PREFIXES) != _some(server, _INTERPRETER_PREFIXES):
        return "spawn"
    torch_vars = _some(server, _TORCH_PREFIXES)
    if any(_some(environ, _TORCH_PREFIXES) != torch_vars for environ in environs):
        return "spawn"
    return "forkserver"


def _some(environ: Mapping[str, str], prefixes: tuple[str, ...]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(prefixes)}


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
    # Exactly the launching process's environment, as a spawned rank inherits it.
    os.environ.clear()
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
        except BaseException:
            dist.destroy_process_group()
            raise
    except BaseException:
        results.put((rank, False, f"rank {rank} failed:\n{traceback.format_exc()}"))
        return
    # The result first, flushed to the parent, then the group's teardown: gloo's can
    # abort the process once in a while (std::system_error "Resource deadlock avoided",
    # a group's last reference dropped on one of its own threads; seen once in a CI run
    # of a 4-rank job: ranks 1 and 3 died with no result while 0 and 2, whose last
    # collectives needed them, returned theirs), and a rank that finished its work must
    # not lose it to torch's teardown. run_ranks still waits for every rank to exit.
    results.put((rank, True, value))
    results.close()
    results.join_thread()
    try:
        dist.destroy_process_group()
    except Exception:  # the work is delivered; say what went wrong, on stderr
        traceback.print_exc()
