"""The one place the probe touches private torch APIs, each with a fallback.

Checked against torch 2.4 to 2.13. Every helper degrades to "not available"
(returns False / None) rather than raising into the training loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


class BackwardEndCallback:
    """Runs one callback when each backward pass it is queued in ends, after DDP's own
    finalisation (which waits for every bucket). ``queue`` only inside a backward pass.

    DDP queues its finalisation when the last bucket is launched, later than our
    first hook call, and the engine runs final callbacks in order, including ones
    queued while running them: so ``queue`` queues a callback that queues ``callback``.
    The engine's entry point and both callables are made once: a step pays for the
    two queue calls only.
    """

    __slots__ = ("_callback", "_queue")

    def __init__(self, callback: Callable[[], None]) -> None:
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        self._queue: Callable[[Callable[[], None]], None] | None = getattr(
            engine, "queue_callback", None
        )
        self._callback = callback

    def queue(self) -> bool:
        """Queue the callback; False where the autograd engine does not offer final
        callbacks, or refused it."""
        if self._queue is None:
            return False
        try:
            self._queue(self._requeue)
        except RuntimeError:
            return False
        return True

    def _requeue(self) -> None:
        try:
            self._queue(self._callback)  # type: ignore[misc]  # not None: queue() ran
        except RuntimeError:
            log.debug("torshmon: could not re-queue the backward-end callback", exc_info=True)


def ddp_logging_data(module: Any) -> dict[str, object] | None:
    """DDP's own runtime statistics (``_get_ddp_logging_data``), or None."""
    getter = getattr(module, "_get_ddp_logging_data", None)
    if getter is None:
        return None
    try:
        return dict(getter())
    except Exception:
        log.debug("torshmon: DDP logging data unavailable", exc_info=True)
        return None


#: torch versions whose DDP internals ``rebuild_reducer`` follows (DDP.__setstate__ and
#: ``_BucketCapacityConfig``), checked by tests; elsewhere cap changes are refused.
_REBUILD_VERSIONS = ((2, 13), (2, 13))


def reducer_rebuild_unavailable(module: Any) -> str | None:
    """Why the Reducer of ``module`` cannot be rebuilt in place here, or None if it can."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    low, high = _REBUILD_VERSIONS
    if not low <= version <= high:
        return (
            f"changing the bucket cap of a running job is checked on torch "
            f"{low[0]}.{low[1]}-{high[0]}.{high[1]}, this is torch {torch.__version__}"
        )
    needed = (
        "_ddp_init_helper",
        "_build_params_for_reducer",
        "_build_debug_param_to_name_mapping",
        "_bucket_config",
    )
    missing = [name for name in needed if not hasattr(module, name)]
    if missing:
        return f"this DDP lacks {', '.join(missing)}"
    if getattr(module, "_use_python_reducer", False):
        return "DDP's Python reducer (compiled autograd) cannot be rebuilt in place"
    if getattr(module, "bucket_bytes_cap_list", None):
        return "the job set per-bucket caps (bucket_cap_mb_list)"
    return None


def first_bucket_cap_bytes(module: Any) -> int:
    """DDP's cap for its first (last-computed) bucket; the bucket cap where unknown."""
    config = getattr(module, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", None)
    return int(first) if first is not None else int(module.bucket_bytes_cap)


@dataclass(frozen=True, slots=True)
class JobCommHook:
    """A comm hook the job registered on its DDP module before torshmon attached.

    ``builtin`` is the ``dist.BuiltinCommHookType`` of a C++ hook
    (``_register_builtin_comm_hook``), which holds no state and can be registered
    again on a rebuilt Reducer; None for a Python hook, whose state (PowerSGD's
    error feedback, per-bucket buffers) may depend on the bucket layout.
    """

    name: str
    builtin: Any = None


def job_comm_hook(module: Any) -> JobCommHook | None:
    """The comm hook the job registered on this DDP module, or None.

    Python hooks are listed in ``DDP._comm_hooks``; a built-in C++ hook leaves no
    trace but the name DDP logs for it (``comm_hook`` in its logging data, e.g.
    ``BuiltinCommHookType.FP16_COMPRESS``). A hook whose kind cannot be told is
    reported as a Python hook: it is kept, and never carried across a rebuild.
    """
    import torch.distributed as dist

    hooks = getattr(module, "_comm_hooks", None)
    if hooks:
        names = [str(getattr(hook, "__qualname__", hook)) for hook, _state in hooks]
        return JobCommHook(", ".join(names))
    data = ddp_logging_data(module)
    name = str(data.get("comm_hook") or "") if data is not None else ""
    if not name:
        return None
    prefix, _, member = name.rpartition(".")
    builtin = None
    if prefix == "BuiltinCommHookType":
        builtin = getattr(dist.BuiltinCommHookType, member, None)
    return JobCommHook(name, builtin)


def rebuild_reducer(
    module: Any,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int,
    hook: Callable[..., Any] | None,
    builtin_hook: Any = None,
) -> None:
    """Replace ``module``'s Reducer by one that buckets at ``bucket_cap_bytes``
    (``first_bucket_cap_bytes`` for the bucket of the last-computed gradients),
    reducing through ``hook``, or through the job's built-in C++ hook
    ``builtin_hook`` (a ``dist.BuiltinCommHookType``), or through DDP's own C++
    path when both are None. A new Reducer has no hook: one the job registered
    is lost unless passed here again.

    Follows what DDP itself does in ``__setstate__``: the parameters, the
    optimizer and the module object stay the same. Like a new DDP, the new
    Reducer reduces the first step in one bucket and then rebuilds its buckets
    in the real gradient order at the new cap. ``hook`` is registered on the
    new Reducer. Call between steps only (never inside backward).
    Raises RuntimeError (with the reason) where ``reducer_rebuild_unavailable``.
    """
    import dataclasses

    import torch.distributed as dist

    reason = reducer_rebuild_unavailable(module)
    if reason is not None:
        raise RuntimeError(reason)
    if hook is not None and builtin_hook is not None:
        raise ValueError("a Reducer takes one comm hook: pass hook or builtin_hook")
    module._bucket_config = dataclasses.replace(
        module._bucket_config,
        bucket_bytes_cap=bucket_cap_bytes,
        first_bucket_bytes_cap=first_bucket_cap_bytes,
    )
    module.bucket_bytes_cap = bucket_cap_bytes
    module.bucket_bytes_cap_default = first_bucket_cap_bytes < bucket_cap_bytes
    parameters, expect_sparse_gradient = module._build_params_for_reducer()
    param_to_name_mapping = module._build_debug_param_to_name_mapping(parameters)
    module._ddp_init_helper(
        parameters, expect_sparse_gradient, param_to_name_mapping, module.static_graph
    )
    if module.static_graph:
        module.reducer._set_static_graph()
        module.logger._set_static_graph()
    if hook is not None:
        module.logger._set_comm_hook_name(getattr(hook, "__qualname__", "torshmon"))
        dist._register_comm_hook(module.reducer, None, hook)
    elif builtin_hook is not None:
        # As DDP._register_builtin_comm_hook does (it also names it in the logs,
        # which is how job_comm_hook finds it again).
        module.logger._set_comm_hook_name(str(builtin_hook))
        dist._register_builtin_comm_hook(module.reducer, builtin_hook)


def process_groups() -> list[tuple[Any, list[int]]] | None:
    """Every process group this rank belongs to, with its members' global ranks in
    group-rank order; None where torch's registry of groups cannot be read.

    torch records each group it creates (``init_process_group``, ``new_group``,
    ``new_subgroups``, DeviceMesh, ``split_group``) in ``_world.pg_group_ranks``, so
    groups created before attach, or through a reference to torch's functions taken
    before it, are found here too. A rank outside a ``new_group`` gets a placeholder
    (``GroupMember.NON_GROUP_MEMBER``), which is skipped. Safe from any thread: the
    table is copied in one call under the GIL.
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        table = dict(c10d._world.pg_group_ranks)
        kind = c10d.ProcessGroup
    except (AttributeError, ImportError, RuntimeError):
        return None
    out = []
    for pg, ranks in table.items():
        if isinstance(pg, kind) and isinstance(ranks, dict):
            out.append((pg, [g for g, _ in sorted(ranks.items(), key=lambda item: item[1])]))
    return out


def process_group_count() -> int | None:
    """How many groups torch's registry holds (``process_groups`` lists them); None
    where it cannot be read. A dictionary's length: cheap enough for every send."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return len(c10d._world.pg_group_ranks)
    except (AttributeError, ImportError, RuntimeError, TypeError):
        return None


# Numbers the side groups a process builds: every rank builds the same ones in the same
# order (attach is collective), so the same number names the same group's store keys.
_side_groups = itertools.count()


def side_group() -> Any:
    """A gloo process group over the whole job for torshmon's own exchanges (the config
    consensus, link checks). Collective: every rank calls it, at attach, in the same order.

    Where the job's default group has a gloo backend (a gloo job, or
    ``cpu:gloo,cuda:nccl``), the group is a ``ProcessGroupGloo`` built on that backend's
    transport device (``options._devices``), with one worker thread: a gloo device's
    network loop thread wakes every 10 ms, so a group with its own device cost each rank
    a thread waking 100 times a second (1.8 context switches and 25 us of CPU a step of
    ``benchmarks/overhead.py``'s 40-bucket model) besides two idle workers. It is built
    outside torch's registry of groups: it is not the job's, so the job's later groups
    keep the names they would have without torshmon and the hang detector's list of the
    job's groups leaves it out. Elsewhere (NCCL alone; a torch without these attributes)
    it is ``new_group(backend="gloo")``, with a device of its own. Every rank takes the
    same branch: it depends on the default group's backend only.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
        if not isinstance(backend, dist.ProcessGroupGloo):
            raise TypeError(type(backend).__name__)
        devices = list(backend.options._devices)
        if not devices:
            raise ValueError("the job's gloo backend has no device")
        options = dist.ProcessGroupGloo._Options()
        options._devices = devices
        options._threads = 1
        options._timeout = backend.options._timeout
        store = c10d._get_default_store()
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:
        log.debug("torshmon: side group on a device of its own: %s", exc)
        return dist.new_group(backend="gloo")
    prefix = f"torshmon/side-group/{next(_side_groups)}/"
    return dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), dist.get_rank(), dist.get_world_size(), options
    )


def release_side_group(group: Any) -> None:
    """Let a ``side_group`` go: its worker thread ends (and a ``new_group``'s loop)."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroupGloo):
        group.shutdown()
    else:
        dist.destroy_process_group(group)
