"""The probe's single DDP comm hook: times every bucket and runs the current codec.

DDP accepts one comm hook per module, so this one dispatches. With no codec
(``none``) it is a plain all-reduce, bit-identical to DDP's built-in
reduction; otherwise it hands the bucket to the codec object the
reconfiguration swapped in (``set_codec``), whose per-bucket state is reset
whenever DDP's bucket layout changes. It is registered only while a codec runs
or bucket timing was asked for (see ``reconfig.py`` for why).

This module deliberately does not use ``from __future__ import annotations``:
DDP's ``register_comm_hook`` inspects the hook's annotations as real objects.
"""

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torshmon.probe.events import BucketEvent, CollectiveEvent, StepEvents
from torshmon.probe.inflight import InflightTable
from torshmon.probe.timing import DeviceClock
from torshmon.ratelog import LogLimiter

if TYPE_CHECKING:
    from torshmon.probe.codecs import Codec, CodecStats

log = logging.getLogger(__name__)


class DispatchingCommHook:
    """Reduces each gradient bucket and records (index, bytes, parameters, times).

    Runs on the autograd thread; the completion callback runs on the backend's
    communication thread. Bookkeeping failures are logged once and never stop
    the reduction itself. ``set_codec`` and ``reset_buckets`` are called
    between steps only.
    """

    def __init__(
        self,
        process_group: Any,
        pg_label: str,
        inflight: InflightTable,
        events: Callable[[], StepEvents],
    ) -> None:
        self.process_group = process_group
        self._pg_label = pg_label
        self._group_size = int(process_group.size())
        # DDP's built-in reduction multiplies by 1/world (not divides): mirror it
        # so results stay bit-identical with and without the probe.
        self._scale = 1.0 / self._group_size
        self._inflight = inflight
        self._events = events
        self._layout: dict[int, tuple[int, int]] = {}  # index -> (bytes, parameters)
        self._codec: Codec | None = None
        self._failure_log = LogLimiter()
        self.enabled = True
        self.measure_error = False  # set per step by the monitor (sampled)
        #: times plain all-reduce buckets on the device where the group runs there
        #: (NCCL's own Work timing); codec buckets, several collectives each, keep the
        #: host's launch-to-completion time
        self.device_clock: DeviceClock | None = None
        self._backend_name: str | None = None

    def register(self, ddp_module: Any) -> None:
        """Register on a DDP module (possible once per module, before backward)."""
        ddp_module.register_comm_hook(None, self.__call__)

    def set_codec(self, codec: "Codec | None") -> None:
        """Use ``codec`` from the next bucket on (None: plain all-reduce)."""
        self._codec = codec

    def reset_buckets(self) -> None:
        """Forget the bucket layout and codec state (DDP rebuilt its buckets)."""
        self._layout.clear()
        if self._codec is not None:
            self._codec.reset()

    def __call__(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        # After close() the codec keeps running (only recording stops): ranks
        # that close at different steps must still reduce the same way.
        codec = self._codec
        if codec is None:
            buffer.mul_(self._scale)
            work = self.process_group.allreduce([buffer])
            future = work.get_future()
            if not self.enabled:
                return future.then(_first_tensor)
            try:
                clock = self.device_clock
                device = None if clock is None else clock.after_async(self._backend(), work)
                on_done = self._record(bucket, buffer, "none", device)
            except Exception:
                self._note_failure()
                return future.then(_first_tensor)
            return future.then(on_done)
        on_coded: Callable[[torch.futures.Future[Any]], torch.Tensor] = _first_tensor
        if self.enabled:
            try:
                on_coded = self._record(bucket, buffer, codec.name)
            except Exception:
                self._note_failure()
        # A codec failure is raised, never replaced by a plain all-reduce on this
        # rank alone: peers running the codec would wait forever.
        coded = codec.reduce(bucket.index(), buffer, measure_error=self.measure_error)
        return coded.then(on_coded)

    def _backend(self) -> str:
        backend = self._backend_name
        if backend is None:
            backend = self._backend_name = str(dist.get_backend(self.process_group))
        return backend

    def _record(
        self, bucket: dist.GradBucket, buffer: torch.Tensor, codec: str, device: Any = None
    ) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
        launch = time.perf_counter_ns()
        events = self._events()
        index = bucket.index()
        size = buffer.numel() * buffer.element_size()
        known = self._layout.get(index)
        if known is None or known[0] != size:
            if known is not None:
                # DDP rebuilt its buckets (it does after the first step): codec
                # state keyed by bucket index no longer fits.
                self.reset_buckets()
            known = self._layout[index] = (size, len(bucket.parameters()))
        parameters = known[1]
        dtype = str(buffer.dtype)[6:]
        # A codec runs its own collectives (all_gather, several all-reduces):
        # tracked in flight under one bounded name, not counted as an all_reduce.
        op = "all_reduce" if codec == "none" else f"bucket_{codec}"
        token = self._inflight.begin(self._pg_label, op, size)
        pg, group_size = self._pg_label, self._group_size

        def on_done(future: torch.futures.Future[Any]) -> torch.Tensor:
            done = time.perf_counter_ns()
            try:
                value = future.value()
            except Exception as exc:
                self._inflight.fail(token, exc)  # DDP raises it from backward
                raise
            self._inflight.end(token)
            if codec != "none":
                tensor, stats = value
                events.buckets.append(
                    _codec_event(index, size, parameters, launch, done, codec, stats)
                )
                return tensor
            events.buckets.append(
                BucketEvent(index, size, parameters, launch, done, codec, size, device=device)
            )
            events.collectives.append(
                CollectiveEvent(
                    "all_reduce", pg, group_size, dtype, size, launch, done, False, device=device
                )
            )
            return value[0]

        return on_done

    def _note_failure(self) -> None:
        if self._failure_log.allow():
            log.warning("torshmon: bucket timing failed; buckets run unmonitored", exc_info=True)


def _codec_event(
    index: int,
    size: int,
    parameters: int,
    launch: int,
    done: int,
    codec: str,
    stats: "CodecStats",
) -> BucketEvent:
    return BucketEvent(
        index,
        size,
        parameters,
        launch,
        done,
        codec,
        stats.wire_bytes,
        stats.encode_s,
        stats.decode_s,
        stats.relative_error,
    )


def _first_tensor(future: torch.futures.Future[Any]) -> torch.Tensor:
    result: torch.Tensor = future.value()[0]
    return result
