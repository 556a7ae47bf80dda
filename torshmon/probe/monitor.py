"""The in-process monitor: ``attach``, ``step``, ``close``.

Telemetry never breaks training: configuration mistakes raise at ``attach``;
anything that fails later is logged once and skipped.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from multiprocessing import util as mp_util
from typing import Any

import torch
import torch.distributed as dist

from torshmon.probe import _torch_compat, ddpcomm
from torshmon.probe.collectives import CollectiveTracer
from torshmon.probe.commands import CommandDesk
from torshmon.probe.commhook import DispatchingCommHook
from torshmon.probe.config import CommConfig
from torshmon.probe.events import RawStep, StepEvents
from torshmon.probe.evidence import EvidenceCapture
from torshmon.probe.fastlane import FastLane
from torshmon.probe.gpu import cuda_memory
from torshmon.probe.groups import GroupRegistry
from torshmon.probe.inflight import InflightTable
from torshmon.probe.nullmonitor import NullMonitor
from torshmon.probe.reconfig import Reconfigurator
from torshmon.probe.runid import run_id_at_attach
from torshmon.probe.runqueue import ProcessRunQueue, RunQueueClock
from torshmon.probe.scope import StepScope
from torshmon.probe.settings import ProbeSettings
from torshmon.probe.shipper import Ending, Shipper, StepOutbox, trusted_agent_uids
from torshmon.probe.timing import DeviceClock, StepMarks
from torshmon.ratelog import LogLimiter
from torshmon.version import __version__
from torshmon.wire import (
    SCHEMA_VERSION,
    AppliedConfig,
    Command,
    ConfigRejection,
    Hello,
)

__all__ = ["Monitor", "NullMonitor", "StepScope"]

log = logging.getLogger(__name__)

#: Steps during which every parameter's gradient is watched to find the last one;
#: DDP's statistics are sampled then too (it has rebuilt its buckets by then).
_GRAD_CALIBRATION_STEPS = 3

#: A step that starts within this long of the previous scope's exit (a loop with no data
#: loader wait between steps) takes that step's end readings of the run-queue clocks as
#: its start's: one read of each a step, not two. The delay between those readings and
#: the next start (torshmon's end-of-step work and at most this long) moves to the next
#: step; none is lost.
_REUSE_END_READINGS_NS = 200_000

_new_tuple = tuple.__new__


class Monitor:
    """Watches one rank of a distributed job: collectives, DDP buckets, steps.

    Create with ``torshmon.attach``. Not thread-safe for ``step``: call it from
    the training thread. ``close()`` is idempotent.
    """

    def __init__(self, module: Any = None, *, settings: ProbeSettings) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed is not initialized: call init_process_group() "
                "before torshmon.attach()"
            )
        if module is not None and not isinstance(module, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                "torshmon.attach() takes a DistributedDataParallel module or None, "
                f"got {type(module).__name__}"
            )
        # Checked where they were loaded (probe.settings); this reads no variable itself.
        self.settings = settings
        self.job = settings.job
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.agent_socket = settings.agent_socket
        self._module = module
        self._ddp_stats_every = settings.ddp_stats_every
        self._sync_every = settings.sync_every
        self._error_sample_every = settings.error_sample_every
        self._bucket_timing = settings.bucket_timing
        self._reconfig: Reconfigurator | None = None
        self._events = StepEvents()
        self._step = 0
        self._step_start_ns = 0
        self._in_step = False
        self._open: StepScope | None = None  # the step begun and not yet ended
        # When the previous step scope was left: the time to this step's start is split
        # into evaluation (forward passes outside steps, first start to last end; depth
        # counts a pass's nested watched modules), collectives outside it, input wait.
        self._last_exit_ns: int | None = None
        self._eval_first_ns: int | None = None
        self._eval_last_ns: int | None = None
        self._eval_depth = 0
        self._watched: set[int] = set()
        self._input_wait_ns: int | None = None
        self._eval_ns: int | None = None
        self._between_comm_ns: int | None = None
        # The training thread's run-queue delay at the step's start (runqueue.py).
        self._runqueue = RunQueueClock()
        self._runqueue_start_ns: int | None = None
        # All the process's threads' (runqueue.ProcessRunQueue), at the step's start.
        # It reads the training thread's file too: at a step's ends it stands for the
        # thread clock (one file fewer a step).
        self._process_runqueue = ProcessRunQueue()
        self._process_runqueue.watch(threading.get_native_id())
        self._training_thread = threading.get_ident()
        if not settings.cpu_wait:
            # Closed clocks read None, touching no file: cpu_wait_s and
            # process_cpu_wait_s go unreported, as off Linux.
            self._runqueue.close()
            self._process_runqueue.close()
        self._process_runqueue_start_ns: int | None = None
        # Both clocks as read at the previous step's end.
        self._runqueue_end_ns: int | None = None
        self._process_runqueue_end_ns: int | None = None
        self._closed = False
        self._failure_log = LogLimiter()  # once per kind of record
        self._inflight = InflightTable()
        self._tracer = CollectiveTracer(self._inflight, self._current_events)
        # Bound to the attaching thread, the training thread, before any other reads it.
        if self._runqueue.read_ns() is not None:
            self._tracer.runqueue = self._runqueue.read_ns
        # NCCL enqueues and returns: its collectives are timed on the GPU (probe.timing).
        self._tracer.device_clock = DeviceClock.for_torch()
        #: the clock that marks each step on the training stream (NCCL jobs only)
        self._step_clock: DeviceClock | None = None
        clock = self._tracer.device_clock
        if clock is not None and clock.on_device(str(dist.get_backend())):
            self._step_clock = clock
        self._hook: DispatchingCommHook | None = None
        self._handles: list[Any] = []
        self._grad_hooks: dict[int, Any] = {}
        self._last_grad_param: int | None = None
        self._ddp_pg_label = "default"
        self._tracer.install()
        if module is not None:
            try:
                self._instrument_ddp(module)
            except BaseException:
                self._tracer.uninstall()
                self._remove_hooks()
                raise
        self._outbox = StepOutbox(settings.max_buffered_steps)
        self._shipper = Shipper(
            socket_path=self.agent_socket,
            hello=self._hello(),
            outbox=self._outbox,
            inflight=self._inflight,
            flush_interval_s=settings.flush_interval_s,
            max_buffered_steps=settings.max_buffered_steps,
            on_commands=self._on_commands,
            fast_lane=FastLane(enabled=settings.fast_lane),
            trusted_uids=trusted_agent_uids(settings.agent_uid()),
            groups=GroupRegistry(dist.group.WORLD, self.world_size),
        )
        self._evidence = EvidenceCapture(self.rank, self._shipper.evidence.put)
        self._commands = CommandDesk(
            job=self.job,
            rank=self.rank,
            shipper=self._shipper,
            evidence=self._evidence,
            reconfig=self._reconfig,
            request_config=self.request_config,
            current_step=lambda: self._step,
        )
        self._shipper.start(
            ddpcomm.for_module(module, self._ddp_pg_label, hooked=settings.bucket_timing)
        )
        if self._shipper.native_id is not None:
            # The shipper's wait for a CPU (it runs at a lower priority) holds no step back.
            self._process_runqueue.leave_out(self._shipper.native_id)
        atexit.register(self._close_at_exit)
        # A multiprocessing child started by fork leaves through os._exit, past atexit;
        # its finalizers run (``util._exit_function``) as the target returns.
        self._exit_finalizer = mp_util.Finalize(None, self._close_at_exit, exitpriority=0)

    # -- public API -------------------------------------------------------------------
    def step(self, batch_size: int | None = None, loss: object = None) -> StepScope:
        """A scope around one step; ``batch_size`` gives throughput, ``loss`` may be set later."""
        return StepScope(self, batch_size, loss)

    def begin_step(self, batch_size: int | None = None) -> StepScope:
        """Begin a step where a ``with`` block cannot span it (a trainer's hooks).

        A step still open (an exception between ``begin_step`` and ``end_step``) is
        dropped, unrecorded, with one warning: the new one begins regardless.
        """
        scope = StepScope(self, batch_size, None)
        self._begin(scope)
        return scope

    def end_step(self, loss: object = None, *, batch_size: int | None = None) -> None:
        """End the open step; ``loss`` and ``batch_size``, where given, are its own.
        Without an open step it does nothing (one warning)."""
        scope = self._open
        if scope is None:
            if self._failure_log.allow("end_step"):
                log.warning("torshmon: end_step() with no step begun; ignored")
            return
        if loss is not None:
            scope.loss = loss
        if batch_size is not None:
            scope.batch_size = batch_size
        self._end(scope, failed=False)

    def watch_forward(self, module: Any) -> None:
        """Count ``module``'s forward passes outside steps as evaluation (``eval_s``),
        not input wait. The attached DDP module and the one it wraps are watched
        already; a trainer evaluating another module of the job names it here."""
        if id(module) in self._watched or self._closed:
            return
        self._watched.add(id(module))
        self._handles.append(module.register_forward_pre_hook(self._on_watched_forward_start))
        self._handles.append(
            module.register_forward_hook(self._on_watched_forward_end, always_call=True)
        )

    def request_config(
        self,
        *,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
        codec: str | None = None,
        codec_params: Mapping[str, object] | None = None,
    ) -> int:
        """Ask for a new DDP bucket cap and/or gradient codec (rank 0 only).

        ``bucket_cap_mb`` alone sets both caps, as ``DDP(bucket_cap_mb=...)`` does;
        torch's default layout is ``bucket_cap_mb=25, first_bucket_cap_mb=1``.
        Validated at once: ConfigError names the bad field and nothing changes.
        All ranks apply it together at the next sync step (every ``sync_every``
        steps); the step records report it. Returns the config's version.
        Codecs: none, fp16, bf16, powersgd (rank), topk (ratio), int8.
        """
        if self._reconfig is None:
            raise RuntimeError(
                "live reconfiguration needs a DDP module whose process group spans the whole job"
            )
        return self._reconfig.request(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            codec=codec,
            codec_params=codec_params,
        ).version

    @property
    def config(self) -> CommConfig | None:
        """The communication config in force (None without live reconfiguration)."""
        return None if self._reconfig is None else self._reconfig.current

    @property
    def steps(self) -> int:
        """Steps completed so far."""
        return self._step

    @property
    def dropped_records_total(self) -> int:
        """Step records dropped because the agent was absent or slow."""
        return self._shipper.dropped_records_total

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop monitoring, flush what the agent can take within ``timeout_s``.

        Restores the original collectives; the comm hook stays registered (DDP
        cannot unregister it) but becomes a plain all-reduce. Safe to call twice.
        The last batch says the rank closed, with the collectives run since its last
        step: its peers' hang checks never wait for it from then on.
        """
        self._close(timeout_s, "close")

    def _close_at_exit(self) -> None:
        """close() at the process's exit, for a job that never called it."""
        self._close(5.0, "exit")

    def _close(self, timeout_s: float, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._exit_finalizer.cancel()
        # What ran after the last step (a final evaluation's gathers) belongs to no
        # step: it goes with the closing mark, filed under the step that never ended.
        events, self._events = self._events, StepEvents()
        ending = Ending(self._step + 1, time.time_ns(), reason, events)
        if self._reconfig is not None:
            self._reconfig.close()
        self._tracer.uninstall()
        if self._hook is not None:
            self._hook.enabled = False
        self._remove_hooks()
        self._evidence.close()
        self._runqueue.close()
        self._process_runqueue.close()
        self._shipper.close(timeout_s, ending)

    def _remove_hooks(self) -> None:
        for handle in [*self._handles, *self._grad_hooks.values()]:
            handle.remove()
        self._handles.clear()
        self._grad_hooks.clear()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------
    def _current_events(self) -> StepEvents:
        return self._events

    def _instrument_ddp(self, module: Any) -> None:
        self._ddp_pg_label, _ = self._tracer.group_info(module.process_group)
        self._handles.append(module.register_forward_pre_hook(self._on_forward_start))
        self._handles.append(module.register_forward_hook(self._on_forward_end, always_call=True))
        # Trainers evaluate the module DDP wraps, past DDP's forward.
        self._watched.add(id(module))
        self.watch_forward(module.module)
        # The backward pass whose end is queued: its step's events and in-flight token.
        self._backward_pending: tuple[StepEvents, int] | None = None
        self._backward_end = _torch_compat.BackwardEndCallback(self._on_backward_end)
        # Runs on the autograd thread: when the last gradient is ready, backward
        # compute is over; what DDP still waits for after that is communication.
        # Every parameter is watched for the first steps, then only the one whose
        # gradient came last (each hook takes the GIL once per step).
        self._grad_hooks = {
            id(param): param.register_post_accumulate_grad_hook(self._on_grad)
            for param in module.parameters()
            if param.requires_grad
        }
        hook = DispatchingCommHook(
            module.process_group, self._ddp_pg_label, self._inflight, self._current_events
        )
        hook.device_clock = self._tracer.device_clock
        job_hook = _torch_compat.job_comm_hook(module)
        if job_hook is not None:
            # The job's hook stays (torshmon's would replace it and change results):
            # buckets go untimed, and a config that would drop or replace it is refused.
            log.warning(
                "torshmon: the job has its own comm hook (%s): buckets untimed; %s",
                job_hook.name,
                "no codec changes" if job_hook.builtin is not None else "no retuning",
            )
        elif self._bucket_timing:
            hook.register(module)
        self._hook = hook
        if dist.get_world_size(module.process_group) == self.world_size:
            self._reconfig = Reconfigurator(
                module,
                hook,
                sync_every=self._sync_every,
                hook_always=self._bucket_timing and job_hook is None,
                job_hook=job_hook,
            )
        else:
            # The side group is built collectively over the whole job; with DDP on
            # a subgroup we cannot know every rank attaches.
            log.warning("torshmon: DDP on a subgroup: live reconfiguration is off")

    def _on_grad(self, param: Any) -> None:
        if not self._in_step:
            return  # a backward pass outside mon.step() belongs to no step
        events = self._events
        events.last_grad_ns = time.perf_counter_ns()
        events.last_grad_runqueue_ns = self._runqueue.read_ns()
        self._last_grad_param = id(param)
        if self._step_clock is not None and events.marks is not None:
            events.marks.last_grad = self._step_clock.mark()
        if not events.backward_hooked:
            events.backward_hooked = True
            # DDP reduces in C++, unseen by the collective wrappers: a rank stuck
            # waiting for its peers' gradients shows this op in flight until
            # backward returns, which is how a hang inside DDP is attributed.
            token = self._inflight.begin(self._ddp_pg_label, "ddp_reduce", 0)
            # Backward passes on the training thread run one at a time: the pass's
            # end takes what its last gradient left here.
            self._backward_pending = (events, token)
            if not self._backward_end.queue():
                self._backward_pending = None
                self._inflight.end(token)

    def _on_backward_end(self) -> None:
        pending, self._backward_pending = self._backward_pending, None
        if pending is None:
            return
        events, token = pending
        events.backward_end_ns = time.perf_counter_ns()
        # The step's next backward pass (gradient accumulation: a micro-batch each)
        # queues its own end: DDP's reduction ends with the last one.
        events.backward_hooked = False
        events.backward_end_runqueue_ns = self._runqueue.read_ns()
        if self._step_clock is not None and events.marks is not None:
            events.marks.backward_end = self._step_clock.mark()
        self._inflight.end(token)

    def _on_forward_start(self, _module: Any, _args: Any) -> None:
        if not self._in_step:
            # An eval pass (or any forward outside mon.step()): not a training
            # step's forward, and the time it takes is not input wait.
            self._eval_enter()
            return
        events = self._events
        if events.forward_start_ns is None:
            events.forward_start_ns = time.perf_counter_ns()

    def _on_forward_end(self, _module: Any, _args: Any, _output: Any) -> None:
        if self._in_step:
            self._events.forward_end_ns = time.perf_counter_ns()
        else:
            self._eval_exit()

    def _on_watched_forward_start(self, _module: Any, _args: Any) -> None:
        if not self._in_step:
            self._eval_enter()

    def _on_watched_forward_end(self, _module: Any, _args: Any, _output: Any) -> None:
        if not self._in_step:
            self._eval_exit()

    def _eval_enter(self) -> None:
        if self._eval_depth == 0 and self._eval_first_ns is None:
            self._eval_first_ns = time.perf_counter_ns()
        self._eval_depth += 1

    def _eval_exit(self) -> None:
        if self._eval_depth > 0:
            self._eval_depth -= 1
            if self._eval_depth == 0:
                self._eval_last_ns = time.perf_counter_ns()

    def _hello(self) -> Hello:
        return Hello(
            v=SCHEMA_VERSION,
            session=uuid.uuid4().hex,
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.rank if self.settings.local_rank is None else self.settings.local_rank,
            node=self.settings.node,
            pid=os.getpid(),
            backend=str(dist.get_backend()),
            torch_version=str(torch.__version__),
            probe_version=__version__,
            # Once, at attach: the launch's id, as every rank of it has it.
            run_id=run_id_at_attach(self.rank, self.settings.run_id),
            attached_unix_ns=time.time_ns(),
        )

    def _begin(self, scope: StepScope) -> None:
        open_scope = self._open
        if open_scope is not None:
            # Its end never came (an exception a trainer caught, a hook that did not
            # run): what it measured is unknown, so it is dropped, not a step recorded.
            if self._failure_log.allow("abandoned"):
                log.warning(
                    "torshmon: a step began while step %d was open; the open one is dropped",
                    self._step + 1,
                )
            self._end(open_scope, failed=True)
        self._open = scope
        self._enter_step()

    def _end(self, scope: StepScope, *, failed: bool) -> None:
        if scope is not self._open:
            return  # dropped when a later step began
        self._open = None
        self._exit_step(scope, failed=failed)

    def _enter_step(self) -> None:
        self._evidence.step_started()
        self._step_start_ns = start_ns = time.perf_counter_ns()
        last_exit, self._last_exit_ns = self._last_exit_ns, None
        if last_exit is not None and start_ns - last_exit < _REUSE_END_READINGS_NS:
            # Straight on from the previous step (no input wait to speak of): what the
            # clocks said at its end is what they say now, and a step reads each once.
            # Measured from the scope's exit, after torshmon's own end-of-step work: from
            # the readings, a step with the config broadcast (0.2-0.5 ms) never came this
            # close, nor did one preempted on the way (27 % of a 40-bucket DDP job's).
            self._runqueue_start_ns = self._runqueue_end_ns
            self._process_runqueue_start_ns = self._process_runqueue_end_ns
        else:
            self._process_runqueue_start_ns = self._process_runqueue.read_ns()
            self._runqueue_start_ns = self._thread_runqueue_ns()
        self._split_gap(last_exit, start_ns)
        if self._step_clock is not None:
            self._events.marks = StepMarks(self._step_clock.mark())
        self._in_step = True

    def _split_gap(self, last_exit: int | None, start_ns: int) -> None:
        """Split the time since the previous step into evaluation, collectives outside
        it and input wait (the rest)."""
        first, last = self._eval_first_ns, self._eval_last_ns
        if first is not None and (last is None or self._eval_depth > 0):
            last = start_ns  # a pass that raised never ended: up to now
        self._eval_first_ns = self._eval_last_ns = None
        self._eval_depth = 0
        if last_exit is None:
            self._input_wait_ns = self._eval_ns = self._between_comm_ns = None
            return
        window = (first, last) if first is not None and last is not None else None
        eval_ns = 0 if window is None else max(0, window[1] - max(window[0], last_exit))
        comm_ns = 0
        for e in self._events.collectives:
            in_eval = window is not None and window[0] <= e.start_ns <= window[1]
            if e.start_ns >= last_exit and not in_eval:  # not torshmon's end-of-step work
                comm_ns += e.end_ns - e.start_ns if e.blocking else e.wait_ns
        self._eval_ns, self._between_comm_ns = eval_ns, comm_ns
        self._input_wait_ns = max(0, start_ns - last_exit - eval_ns - comm_ns)

    def _thread_runqueue_ns(self) -> int | None:
        """The training thread's run-queue delay as the process clock's read just now
        read it, else from its own clock."""
        now = self._process_runqueue.watched_ns
        if now is None or threading.get_ident() != self._training_thread:
            return self._runqueue.read_ns()  # None on another thread
        return now

    def _exit_step(self, scope: StepScope, *, failed: bool) -> None:
        end_ns = time.perf_counter_ns()
        process_clock = self._process_runqueue
        process_started = self._process_runqueue_start_ns
        process_now = self._process_runqueue_end_ns = process_clock.read_ns()
        # The training thread's delay as the process clock's read just now read it,
        # else from its own clock (None on another thread).
        thread_now = process_clock.watched_ns
        if thread_now is None or threading.get_ident() != self._training_thread:
            thread_now = self._runqueue.read_ns()
        self._runqueue_end_ns = thread_now
        started = self._runqueue_start_ns
        # Cumulative clocks, so never negative; no max() call: each call costs in-situ.
        cpu_wait_ns = None
        if started is not None and thread_now is not None:
            cpu_wait_ns = thread_now - started if thread_now > started else 0
        process_wait_ns = None
        if process_started is not None and process_now is not None:
            process_wait_ns = process_now - process_started if process_now > process_started else 0
        self._in_step = False
        events = self._events
        if self._step_clock is not None and events.marks is not None:
            events.marks.end = self._step_clock.mark()
        self._evidence.step_ended()
        # Everything from here to the next step's end belongs to the next step.
        self._events = StepEvents()
        if failed or self._closed:
            return
        self._step = step = self._step + 1
        if step == _GRAD_CALIBRATION_STEPS:
            self._keep_last_grad_hook()
        # Describe the step that ran before the consensus may rebuild the Reducer.
        ddp_logging = None
        if self._module is not None and (
            step % self._ddp_stats_every == 0 or step == _GRAD_CALIBRATION_STEPS
        ):
            ddp_logging = _torch_compat.ddp_logging_data(self._module)
        reconfig = self._reconfig
        applied: AppliedConfig | None = None
        rejections: Sequence[ConfigRejection] = ()
        if reconfig is None:
            config_version = 0
        else:
            config_version = reconfig.current.version
            if not reconfig.idle_at(step):
                applied, rejections = self._sync_config()
                self._commands.report_link_checks()  # link checks run only in a sync
        if self._hook is not None:
            self._hook.measure_error = (step + 1) % self._error_sample_every == 0
        try:
            # RawStep's fields in order, in one call (its docstring says why).
            self._outbox.put(
                _new_tuple(
                    RawStep,
                    (
                        step,
                        self._step_start_ns,
                        end_ns,
                        time.time_ns(),
                        scope.batch_size,
                        _host_loss(scope.loss),
                        events,
                        ddp_logging,
                        self._input_wait_ns,
                        self._eval_ns,
                        self._between_comm_ns,
                        cpu_wait_ns,
                        process_wait_ns,
                        config_version,
                        applied,
                        rejections,
                        cuda_memory(),
                    ),
                )
            )
        except Exception:
            self._note_failure("step")
        finally:
            # After torshmon's own end-of-step work: that is not the loader's time.
            self._last_exit_ns = time.perf_counter_ns()

    def _on_commands(self, commands: list[Command]) -> None:
        """Commands relayed by the agent (shipper thread): validate and queue them."""
        self._commands.take(commands)

    def _keep_last_grad_hook(self) -> None:
        last = self._last_grad_param
        if last is None or last not in self._grad_hooks:
            return
        for key in [k for k in self._grad_hooks if k != last]:
            self._grad_hooks.pop(key).remove()

    def _sync_config(self) -> tuple[AppliedConfig | None, list[ConfigRejection]]:
        """Join the config consensus at this step boundary (collective on sync steps)."""
        return self._commands.sync(self._step)

    def _note_failure(self, what: str) -> None:
        if self._failure_log.allow(what):
            log.warning("torshmon: recording %s failed; skipping", what, exc_info=True)


def _host_loss(loss: object) -> object:
    """The step's loss as handed to the shipper: a plain CPU tensor's value read now (as
    cheap as detaching it, and the fast lane can judge a float as the step ends), any
    other tensor detached (the autograd graph must not live on), read on the shipper's
    thread later so training never waits on a device; a DTensor is never read here
    (its value may take a collective)."""
    if isinstance(loss, torch.Tensor):
        if type(loss) is torch.Tensor and loss.is_cpu:
            # item() refuses a tensor of more (or fewer) than one element, which is
            # then detached: one call fewer in the common case than asking numel().
            try:
                value = loss.item()
            except RuntimeError:
                return loss.detach()
            return value if type(value) is float else float(value)
        return loss.detach()
    detach = getattr(loss, "detach", None)
    return detach() if detach is not None else loss
