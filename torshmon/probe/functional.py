"""Timing of the functional collectives (``torch.ops._c10d_functional``).

DTensor, tensor parallelism, FSDP2's gradient clipping and compiled code
(``torch.compile``) communicate through these ops. They call the C++
ProcessGroup directly, so the Python wrappers of ``collectives.py`` never see
them; and the ProcessGroup has no completion hook on gloo (torch 2.13 offers
``_register_on_completion_hook`` on NCCL only, without sizes or dtypes). The
dispatcher is where every caller of these ops passes: Python's
``_functional_collectives``, DTensor's own dispatch (which runs below autograd,
so a kernel on the Autograd or ADInplaceOrView key misses it), and the code
Inductor generates. ``FunctionalTracer`` registers a Python kernel on the
``BackendSelect`` key, the last key before the real kernel, that notes the
launch and redispatches to the real kernel unchanged. Completion is observed
in ``wait_tensor`` (every caller waits on an output before using it).

Only the functional ops are hooked, never the ``c10d::`` ops beneath
``dist.all_reduce`` and DDP's Reducer: a Python kernel there would take the GIL
once per DDP bucket (about 0.3 ms per bucket on CPU gloo), and those calls are
already recorded. Tracing (fake or functional tensors under ``torch.compile``)
passes through unrecorded: only calls on real tensors run a collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed import distributed_c10d as c10d

from torshmon.probe.events import CollectiveEvent, StepEvents
from torshmon.probe.inflight import InflightTable
from torshmon.ratelog import LogLimiter

log = logging.getLogger(__name__)

# (op name as torch.distributed calls it, size_bytes, dtype, group name or object)
_Described = tuple[str, int, "torch.dtype", Any]

#: Tensors that run a real collective; tensor subclasses (FakeTensor and
#: FunctionalTensor while torch.compile traces) do not.
_REAL_TENSORS = (torch.Tensor, torch.nn.Parameter)

#: Launches not yet waited for, beyond which the oldest are forgotten (an
#: output nobody waits on must not grow memory without bound).
MAX_PENDING = 4096


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


# One describer per op, with the op's own schema (torch 2.13); sizes follow
# the same conventions as collectives.py, so both paths aggregate together.
def _all_reduce(input, reduce_op, group_name):  # type: ignore[no-untyped-def]
    return "all_reduce", _nbytes(input), input.dtype, group_name


def _all_reduce_coalesced(inputs, reduce_op, group_name):  # type: ignore[no-untyped-def]
    size = sum(_nbytes(t) for t in inputs)
    return "all_reduce_coalesced", size, inputs[0].dtype, group_name


def _all_gather(input, group_size, group_name, *, out=None):  # type: ignore[no-untyped-def]
    return "all_gather_into_tensor", _nbytes(input) * group_size, input.dtype, group_name


def _all_gather_coalesced(inputs, group_size, group_name):  # type: ignore[no-untyped-def]
    size = sum(_nbytes(t) for t in inputs) * group_size
    return "all_gather_into_tensor_coalesced", size, inputs[0].dtype, group_name


def _reduce_scatter(input, reduce_op, group_size, group_name, *, out=None):  # type: ignore[no-untyped-def]
    return "reduce_scatter_tensor", _nbytes(input), input.dtype, group_name


def _reduce_scatter_coalesced(inputs, reduce_op, group_size, group_name):  # type: ignore[no-untyped-def]
    size = sum(_nbytes(t) for t in inputs)
    return "reduce_scatter_tensor_coalesced", size, inputs[0].dtype, group_name


def _all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):  # type: ignore[no-untyped-def]
    return "all_to_all_single", _nbytes(input), input.dtype, group_name


def _broadcast(input, src, group_name):  # type: ignore[no-untyped-def]
    return "broadcast", _nbytes(input), input.dtype, group_name


DESCRIBERS: dict[str, Callable[..., _Described]] = {
    "all_reduce": _all_reduce,
    "all_reduce_": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_reduce_coalesced_": _all_reduce_coalesced,
    "all_gather_into_tensor": _all_gather,
    "all_gather_into_tensor_out": _all_gather,
    "all_gather_into_tensor_coalesced": _all_gather_coalesced,
    "reduce_scatter_tensor": _reduce_scatter,
    "reduce_scatter_tensor_out": _reduce_scatter,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_coalesced,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
    "broadcast_": _broadcast,
}


class _Launch(NamedTuple):
    op: str
    pg: str
    group_size: int
    dtype: str
    size_bytes: int
    start_ns: int
    # The storages of its outputs (a coalesced op returns several): the waits see
    # aliases of the outputs (DTensor wraps them for autograd), never the same
    # objects; torch's own work registry matches a wait to its work by storage too.
    keys: tuple[int, ...]


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


class FunctionalTracer:
    """Records functional collectives as ``CollectiveEvent``s of the current step.

    ``group_info`` gives (label, size) of a ProcessGroup, as the collective
    wrappers label it. A launch is timed to the end of the first
    ``wait_tensor`` on one of its outputs, and shows in flight while a caller
    waits on it (where a rank is stuck in a hang); ``wait_ns`` is the time the
    caller was blocked in that wait. A launch nobody waits on is never
    recorded. Thread safety: the hot path uses dict item set and pop only
    (atomic under the GIL).
    """

    def __init__(
        self,
        inflight: InflightTable,
        events: Callable[[], StepEvents],
        group_info: Callable[[Any], tuple[str, int]],
    ) -> None:
        self._inflight = inflight
        self._events = events
        self._group_info = group_info
        self._groups: dict[str, tuple[str, int]] = {}
        self._pending: dict[int, _Launch] = {}
        self._library: torch.library.Library | None = None
        self._failure_log = LogLimiter()  # once per op

    def install(self) -> None:
        """Register the kernels; ops this torch lacks are skipped."""
        library = torch.library.Library("_c10d_functional", "IMPL")
        namespace = torch.ops._c10d_functional
        below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        try:
            for name, describe in DESCRIBERS.items():
                packet = getattr(namespace, name, None)
                if packet is None:
                    continue
                kernel = self._launch_kernel(name, packet.default, describe, below)
                library.impl(name, kernel, "BackendSelect", with_keyset=True)
            wait = self._wait_kernel(namespace.wait_tensor.default, below)
            library.impl("wait_tensor", wait, "BackendSelect", with_keyset=True)
        except BaseException:
            library._destroy()
            raise
        self._library = library

    def uninstall(self) -> None:
        """Remove the kernels; safe to call twice."""
        library, self._library = self._library, None
        if library is not None:
            library._destroy()
        self._pending.clear()

    # -- kernels ----------------------------------------------------------------------
    def _launch_kernel(
        self,
        name: str,
        op: torch._ops.OpOverload,
        describe: Callable[..., _Described],
        below: torch._C.DispatchKeySet,
    ) -> Callable[..., Any]:
        def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
            first = args[0]
            if isinstance(first, (list, tuple)):
                first = first[0] if first else None
            if type(first) not in _REAL_TENSORS or first.is_meta:
                return op.redispatch(keyset & below, *args, **kwargs)
            start = time.perf_counter_ns()
            result = op.redispatch(keyset & below, *args, **kwargs)
            try:
                kind, size, dtype, group_name = describe(*args, **kwargs)
                pg, group_size = self._group(group_name)
                outputs = result if isinstance(result, (list, tuple)) else [result]
                keys = tuple(_storage_key(t) for t in outputs)
                launch = _Launch(kind, pg, group_size, str(dtype)[6:], size, start, keys)
                if len(self._pending) >= MAX_PENDING:
                    self._pending.pop(next(iter(self._pending)), None)
                for key in keys:
                    self._pending[key] = launch
            except Exception:
                self._note_failure(name)
            return result

        return kernel

    def _wait_kernel(
        self, op: torch._ops.OpOverload, below: torch._C.DispatchKeySet
    ) -> Callable[..., Any]:
        def kernel(keyset: torch._C.DispatchKeySet, tensor: Any) -> Any:
            launch = None
            if self._pending and type(tensor) in _REAL_TENSORS:
                try:
                    launch = self._pending.pop(_storage_key(tensor), None)
                except Exception:
                    self._note_failure("wait_tensor")
            if launch is None:
                return op.redispatch(keyset & below, tensor)
            for key in launch.keys:
                self._pending.pop(key, None)
            token = self._inflight.begin(launch.pg, launch.op, launch.size_bytes)
            wait_start = time.perf_counter_ns()
            try:
                result = op.redispatch(keyset & below, tensor)
            except Exception as exc:
                self._inflight.fail(token, exc)
                raise
            finally:
                self._inflight.end(token)  # no-op after fail
            end = time.perf_counter_ns()
            event = CollectiveEvent(
                launch.op,
                launch.pg,
                launch.group_size,
                launch.dtype,
                launch.size_bytes,
                launch.start_ns,
                end,
                False,
                end - wait_start,
            )
            self._events().collectives.append(event)
            return result

        return kernel

    # -- bookkeeping ------------------------------------------------------------------
    def _group(self, group_name: Any) -> tuple[str, int]:
        if not isinstance(group_name, str):
            return self._group_info(group_name)  # a ProcessGroup object
        info = self._groups.get(group_name)
        if info is None:
            info = self._group_info(c10d._resolve_process_group(group_name))
            self._groups[group_name] = info
        return info

    def _note_failure(self, op: str) -> None:
        if self._failure_log.allow(op):
            log.warning(
                "torshmon: could not time functional %s calls; they run unmonitored",
                op,
                exc_info=True,
            )
