"""Raw events of one training step, appended from any thread.

The hot path only appends tuples (atomic under the GIL); turning them into wire
records happens on the shipper thread (see ``summary.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torshmon.wire import AppliedConfig, ConfigRejection


class CollectiveEvent(NamedTuple):
    """One collective call. ``blocking`` is True when the caller waited for it
    whole; otherwise ``wait_ns`` is how long the caller was blocked waiting on it
    (functional collectives' ``wait_tensor``), where known. ``device``: its device
    timing still to be read (``torshmon.probe.timing``), None where the host's clock
    times it (gloo) or once read into ``end_ns``. ``cpu_wait_ns``: the calling
    thread's run-queue delay during a blocking call (its wake-up on a busy node), 0
    where not read. ``timed``: False where nothing timed it (a DDP bucket all-reduce
    the Flight Recorder saw on gloo: enqueued at ``start_ns``, ``end_ns`` the same)."""

    op: str
    pg: str
    group_size: int
    dtype: str
    size_bytes: int
    start_ns: int
    end_ns: int
    blocking: bool
    wait_ns: int = 0
    device: Any = None
    cpu_wait_ns: int = 0
    timed: bool = True


class BucketEvent(NamedTuple):
    """One DDP bucket reduced by the comm hook (launch and completion times).
    ``device``: its device timing still to be read (a plain all-reduce on NCCL), as
    ``CollectiveEvent``'s."""

    bucket_index: int
    size_bytes: int
    parameters: int
    launch_ns: int
    done_ns: int
    codec: str
    wire_bytes: int
    encode_s: float = 0.0
    decode_s: float = 0.0
    relative_error: float | None = None
    device: Any = None


@dataclass(slots=True)
class StepEvents:
    """Everything recorded between two step boundaries (perf_counter_ns times)."""

    collectives: list[CollectiveEvent] = field(default_factory=list)
    buckets: list[BucketEvent] = field(default_factory=list)
    forward_start_ns: int | None = None
    forward_end_ns: int | None = None
    last_grad_ns: int | None = None
    backward_end_ns: int | None = None
    #: the training thread's run-queue delay (runqueue.py) at ``last_grad_ns`` and at
    #: ``backward_end_ns``: what it waited for a CPU while DDP's reduction was awaited
    last_grad_runqueue_ns: int | None = None
    backward_end_runqueue_ns: int | None = None
    backward_hooked: bool = False
    #: the step's CUDA events on the training stream (``timing.StepMarks``), on NCCL
    marks: Any = None


class RawStep(NamedTuple):
    """A finished step as the training thread hands it to the shipper.

    A named tuple, which the training thread builds in one call (``tuple.__new__``,
    fields in this order): a 17-field dataclass's ``__init__`` cost it several us a
    step in the training loop, where the step's compute has evicted the caches."""

    step: int
    start_ns: int
    end_ns: int
    end_unix_ns: int
    batch_size: int | None
    loss: object
    events: StepEvents
    ddp_logging: dict[str, object] | None
    input_wait_ns: int | None = None
    #: of the time before the step (see ``StepRecord``): evaluation forward passes, and
    #: collectives outside them
    eval_ns: int | None = None
    between_steps_comm_ns: int | None = None
    #: the training thread's run-queue delay during the whole step (runqueue.py); the
    #: summary leaves out what fell in its communication waits; None off Linux
    cpu_wait_ns: int | None = None
    #: run-queue delay of all the process's threads from the step's start to its end
    process_cpu_wait_ns: int | None = None
    config_version: int = 0
    applied_config: AppliedConfig | None = None
    #: a tuple where none (the summary makes its record's list)
    config_rejections: Sequence[ConfigRejection] = ()
    #: (allocated, reserved, peak) CUDA bytes at the step's end; None off CUDA
    gpu_memory: tuple[int, int, int] | None = None
