"""The probe's single DDP comm hook: times every bucket and runs the current codec.

DDP accepts one comm hook per module, so this one dispatches; for now the only
codec is ``none`` (plain all-reduce, bit-identical to DDP's built-in reduction).

This module deliberately does not use ``from __future__ import annotations``:
DDP's ``register_comm_hook`` inspects the hook's annotations as real objects.
"""

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torshmon.probe import _torch_compat
from torshmon.probe.events import BucketEvent, CollectiveEvent, StepEvents
from torshmon.probe.inflight import InflightTable

log = logging.getLogger(__name__)


class DispatchingCommHook:
    """Reduces each gradient bucket and records (index, bytes, parameters, times).

    Runs on the autograd thread; the completion callback runs on the backend's
    communication thread. Bookkeeping failures are logged once and never stop
    the reduction itself.
    """

    def __init__(
        self,
        process_group: Any,
        pg_label: str,
        inflight: InflightTable,
        events: Callable[[], StepEvents],
    ) -> None:
        self._pg = process_group
        self._pg_label = pg_label
        self._group_size = int(process_group.size())
        # DDP's built-in reduction multiplies by 1/world (not divides): mirror it
        # so results stay bit-identical with and without the probe.
        self._scale = 1.0 / self._group_size
        self._inflight = inflight
        self._events = events
        self._params: dict[tuple[int, int], int] = {}
        self._failed = False
        self.codec = "none"
        self.enabled = True

    def register(self, ddp_module: Any) -> None:
        """Register on a DDP module (possible once per module, before backward)."""
        ddp_module.register_comm_hook(None, self.__call__)

    def reset_buckets(self) -> None:
        """Forget per-bucket state; call whenever DDP rebuilds its buckets."""
        self._params.clear()

    def __call__(
        self, state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.mul_(self._scale)
        future = self._pg.allreduce([buffer]).get_future()
        if not self.enabled:
            return future.then(_first_tensor)
        try:
            on_done = self._record(bucket, buffer)
        except Exception:
            self._note_failure()
            return future.then(_first_tensor)
        return future.then(on_done)

    def _record(
        self, bucket: dist.GradBucket, buffer: torch.Tensor
    ) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
        launch = time.perf_counter_ns()
        events = self._events()
        if not events.backward_hooked:
            events.backward_hooked = True
            _torch_compat.queue_backward_end_callback(lambda: _mark_backward_end(events))
        index = bucket.index()
        size = buffer.numel() * buffer.element_size()
        parameters = self._params.get((index, size))
        if parameters is None:
            parameters = self._params[(index, size)] = len(bucket.parameters())
        dtype = str(buffer.dtype)[6:]
        token = self._inflight.begin(self._pg_label, "all_reduce", size)
        codec, pg, group_size = self.codec, self._pg_label, self._group_size

        def on_done(future: torch.futures.Future[Any]) -> torch.Tensor:
            done = time.perf_counter_ns()
            self._inflight.end(token)
            events.buckets.append(BucketEvent(index, size, parameters, launch, done, codec))
            events.collectives.append(
                CollectiveEvent("all_reduce", pg, group_size, dtype, size, launch, done, False)
            )
            return _first_tensor(future)

        return on_done

    def _note_failure(self) -> None:
        if not self._failed:
            self._failed = True
            log.warning("torshmon: bucket timing failed; buckets run unmonitored", exc_info=True)


def _first_tensor(future: torch.futures.Future[Any]) -> torch.Tensor:
    result: torch.Tensor = future.value()[0]
    return result


def _mark_backward_end(events: StepEvents) -> None:
    events.backward_end_ns = time.perf_counter_ns()
