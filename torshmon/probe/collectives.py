"""Timing of every ``torch.distributed`` collective, by wrapping the real functions.

``CollectiveTracer.install()`` replaces the collective functions in
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (so torch's own
helpers such as ``all_gather_object`` are seen too) with thin wrappers;
``uninstall()`` puts the originals back. The functional collectives (DTensor,
tensor parallelism, compiled code), which call the ProcessGroup from C++, are
recorded at the dispatcher (``functional.py``). Code that imported a function by name
before ``install()`` keeps the unwrapped one: attach before the training loop.
(torch compares some of these functions by identity, e.g. ``P2POp(dist.isend, ...)``;
both sides see the wrapper while it is installed.)

The wrappers never change what a collective does: if describing the call fails
they log once and call the original untouched.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from torshmon.probe.events import CollectiveEvent, StepEvents
from torshmon.probe.functional import FunctionalTracer
from torshmon.probe.inflight import InflightTable
from torshmon.probe.timing import DeviceClock
from torshmon.ratelog import LogLimiter

log = logging.getLogger(__name__)

# (size_bytes, dtype, group, async_op, peer) of a call, from the call's own arguments.
_Described = tuple[int, "torch.dtype | None", Any, bool, "int | None"]


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _sum_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# One describer per op, with the op's own signature (torch 2.13): calling it with
# the caller's arguments is the cheapest correct way to find each argument.
def _all_reduce(tensor, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, async_op, None


def _all_gather(tensor_list, tensor, group=None, async_op=False):  # type: ignore[no-untyped-def]
    return _sum_nbytes(tensor_list), tensor.dtype, group, async_op, None


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):  # type: ignore[no-untyped-def]
    return _nbytes(output_tensor), input_tensor.dtype, group, async_op, None


def _all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):  # type: ignore[no-untyped-def]
    size = sum(_sum_nbytes(outputs) for outputs in output_tensor_lists)
    dtype = input_tensor_list[0].dtype if input_tensor_list else None
    return size, dtype, group, async_op, None


def _all_reduce_coalesced(tensors, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
    dtype = tensors[0].dtype if tensors else None
    return _sum_nbytes(tensors), dtype, group, async_op, None


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, async_op, None


def _reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, async_op, None


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
    return _sum_nbytes(input_list), output.dtype, group, async_op, None


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):  # type: ignore[no-untyped-def]
    return _nbytes(input), input.dtype, group, async_op, None


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):  # type: ignore[no-untyped-def]
    dtype = input_tensor_list[0].dtype if input_tensor_list else None
    return _sum_nbytes(input_tensor_list), dtype, group, async_op, None


def _all_to_all_single(  # type: ignore[no-untyped-def]
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
):
    return _nbytes(input), input.dtype, group, async_op, None


def _barrier(group=None, async_op=False, device_ids=None, timeout=None):  # type: ignore[no-untyped-def]
    return 0, None, group, async_op, None


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, async_op, None


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, async_op, None


def _peer(peer: int | None, group: Any, group_peer: int | None) -> int | None:
    """The peer's global rank: in-flight reports pair ops by global ranks, and
    ``batch_isend_irecv`` passes the peer's rank in the group (``group_dst``/``group_src``)."""
    if peer is not None or group_peer is None or group is None:
        return peer if peer is not None else group_peer
    return int(dist.get_global_rank(group, group_peer))


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, False, _peer(dst, group, group_dst)


def _recv(tensor, src=None, group=None, tag=0, group_src=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, False, _peer(src, group, group_src)


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, True, _peer(dst, group, group_dst)


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):  # type: ignore[no-untyped-def]
    return _nbytes(tensor), tensor.dtype, group, True, _peer(src, group, group_src)


DESCRIBERS: dict[str, Callable[..., _Described]] = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce_coalesced,
    "all_gather": _all_gather,
    "all_gather_coalesced": _all_gather_coalesced,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_single": _all_gather_into_tensor,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "reduce_scatter_single": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "barrier": _barrier,
    "gather": _gather,
    "scatter": _scatter,
    "send": _send,
    "recv": _recv,
    "isend": _isend,
    "irecv": _irecv,
}

_POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv"})
_ORIGINAL_ATTR = "__torshmon_original__"

# torch implements some collectives with others (send with isend, recv with
# irecv): only the outermost call on a thread is recorded.
_nesting = threading.local()


class _TimedWork(dist.Work):  # type: ignore[misc]
    """A Work that records its completion; for backends whose Work has no future.

    gloo's send/recv Works raise on ``get_future()``, so completion is observed
    when the caller waits on (or polls) the Work.
    """

    def __init__(self, inner: dist.Work, on_done: Callable[[BaseException | None], None]) -> None:
        super().__init__()
        self._inner = inner
        self._on_done: Callable[[BaseException | None], None] | None = on_done

    def _finish(self, error: BaseException | None = None) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(error)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            done = bool(self._inner.wait(timeout))
        except Exception as exc:
            self._finish(exc)
            raise
        self._finish()
        return done

    def is_completed(self) -> bool:
        done = bool(self._inner.is_completed())
        if done:
            self._finish()
        return done

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> list[torch.Tensor]:
        return list(self._inner.result())

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._inner.get_future()


def _error_of(future: torch.futures.Future[Any]) -> BaseException | None:
    """What a completed future failed with; None if it holds a value (``value()`` on a
    completed future neither blocks nor synchronises a device)."""
    try:
        future.value()
    except Exception as exc:
        return exc
    return None


class CollectiveTracer:
    """Installs the collective wrappers and routes their events to a step.

    ``events`` is read on every call: the monitor swaps in a fresh ``StepEvents``
    at each step boundary. Only one tracer may be installed per process.
    """

    _installed: CollectiveTracer | None = None

    def __init__(self, inflight: InflightTable, events: Callable[[], StepEvents]) -> None:
        self._inflight = inflight
        self._events = events
        self._groups: dict[Any, tuple[str, int]] = {}
        self._default_group: Any = None
        self._failure_log = LogLimiter()  # once per op
        #: times collectives on the device where their backend runs there (NCCL)
        self.device_clock: DeviceClock | None = None
        #: the training thread's run-queue delay so far (``RunQueueClock.read_ns``): read
        #: around blocking collectives, whose wake-up delay is communication wait
        self.runqueue: Callable[[], int | None] | None = None
        self._backends: dict[Any, str] = {}
        # The functional collectives (DTensor, TP, compiled code) bypass the Python
        # functions wrapped here; they are recorded at the dispatcher instead.
        self._functional = FunctionalTracer(inflight, events, self.group_info)

    # -- installation -----------------------------------------------------------------
    def install(self) -> None:
        """Wrap the collectives; RuntimeError if another tracer is installed."""
        if CollectiveTracer._installed is not None:
            raise RuntimeError(
                "torshmon is already attached in this process; close() the first monitor"
            )
        self._default_group = c10d._get_default_group()
        for name, describe in DESCRIBERS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue  # an op this torch version does not have
            wrapper = self._wrap(name, original, describe)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
        try:
            self._functional.install()
        except Exception:
            log.warning("torshmon: functional collectives run unmonitored", exc_info=True)
        CollectiveTracer._installed = self

    def uninstall(self) -> None:
        """Restore the original functions; safe to call twice."""
        if CollectiveTracer._installed is not self:
            return
        self._functional.uninstall()
        for name in DESCRIBERS:
            for module in (c10d, dist):
                current = getattr(module, name, None)
                original = getattr(current, _ORIGINAL_ATTR, None)
                if original is not None:
                    setattr(module, name, original)
        CollectiveTracer._installed = None

    # -- recording --------------------------------------------------------------------
    def group_info(self, group: Any) -> tuple[str, int]:
        """(label, size) of a process group; ``None`` means the default group."""
        info = self._groups.get(group)
        if info is None:
            pg = self._default_group if group is None else group
            label = "default" if pg is self._default_group else str(pg.group_name)
            info = (label, int(pg.size()))
            self._groups[group] = info
        return info

    def backend(self, group: Any) -> str:
        """The backend name of a process group (``nccl``, ``gloo``), cached."""
        backend = self._backends.get(group)
        if backend is None:
            try:
                backend = str(dist.get_backend(group))
            except (RuntimeError, ValueError):
                backend = "unknown"
            self._backends[group] = backend
        return backend

    def _wrap(
        self, name: str, original: Callable[..., Any], describe: Callable[..., _Described]
    ) -> Callable[..., Any]:
        inflight = self._inflight
        point_to_point = name in _POINT_TO_POINT

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(_nesting, "inside", False):
                return original(*args, **kwargs)
            try:
                size, dtype, group, async_op, peer = describe(*args, **kwargs)
                pg, group_size = self.group_info(group)
                token = inflight.begin(pg, name, size, peer if point_to_point else None)
            except Exception:
                self._note_failure(name)
                return original(*args, **kwargs)
            dtype_name = str(dtype)[6:] if dtype is not None else "none"
            clock, backend, device_start = self.device_clock, "", None
            if clock is not None:
                backend = self.backend(group)
                if not async_op:
                    device_start = clock.before(backend)
            runqueue = self.runqueue
            queued = None if runqueue is None or async_op else runqueue()
            start = time.perf_counter_ns()
            _nesting.inside = True
            try:
                result = original(*args, **kwargs)
            except Exception as exc:
                inflight.fail(token, exc)  # a timeout, a lost peer: counted
                raise
            except BaseException:
                inflight.end(token)
                raise
            finally:
                _nesting.inside = False
            if async_op and result is not None:
                device = None if clock is None else clock.after_async(backend, result)
                return self._track_async(
                    result, token, name, pg, group_size, dtype_name, size, start, device
                )
            end = time.perf_counter_ns()
            inflight.end(token)
            cpu_wait_ns = 0
            if queued is not None and runqueue is not None:
                now = runqueue()
                cpu_wait_ns = 0 if now is None else max(0, now - queued)
            device = (
                clock.after_blocking(device_start)
                if clock is not None and device_start is not None
                else None
            )
            event = CollectiveEvent(
                name,
                pg,
                group_size,
                dtype_name,
                size,
                start,
                end,
                True,
                device=device,
                cpu_wait_ns=cpu_wait_ns,
            )
            self._events().collectives.append(event)
            return result

        setattr(wrapper, _ORIGINAL_ATTR, original)
        return wrapper

    def _track_async(
        self,
        work: Any,
        token: int,
        op: str,
        pg: str,
        group_size: int,
        dtype: str,
        size: int,
        start: int,
        device: Any = None,
    ) -> Any:
        def done(error: BaseException | None = None) -> None:
            if error is not None:
                self._inflight.fail(token, error)
                return
            self._inflight.end(token)
            end = time.perf_counter_ns()
            event = CollectiveEvent(
                op, pg, group_size, dtype, size, start, end, False, device=device
            )
            self._events().collectives.append(event)

        if op not in _POINT_TO_POINT:
            try:
                work.get_future().add_done_callback(lambda fut: done(_error_of(fut)))
                return work
            except RuntimeError:
                pass  # this backend's Work has no future: observe completion on wait()
        try:
            return _TimedWork(work, done)
        except Exception:
            self._note_failure(op)
            self._inflight.end(token)
            return work

    def _note_failure(self, op: str) -> None:
        if self._failure_log.allow(op):
            log.warning(
                "torshmon: could not time %s calls; they run unmonitored", op, exc_info=True
            )
