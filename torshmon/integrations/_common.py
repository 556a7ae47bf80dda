"""What the integrations share: the job's name, which module to attach, and a step
opened and closed from two hooks of a framework's loop. Framework-free."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from torshmon.probe.api import attach_with, is_distributed
from torshmon.probe.monitor import Monitor, NullMonitor
from torshmon.probe.settings import check_keywords, default_job_name, load_probe_settings
from torshmon.wire import NAME_MAX_CHARS

log = logging.getLogger(__name__)


def job_name(explicit: str | None, run_name: object, env: Mapping[str, str]) -> str:
    """The job's name: the one given, else ``$TORSHMON_JOB``, else the framework's run
    name, else torchrun's run id, else ``default`` (cut to what the wire takes)."""
    if explicit:
        return explicit
    if env.get("TORSHMON_JOB"):
        return env["TORSHMON_JOB"]
    if isinstance(run_name, str) and run_name.strip():
        return run_name.strip()[:NAME_MAX_CHARS]
    return default_job_name(env)


def checked_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``torshmon.attach``'s keywords given to an integration, checked when it is built,
    not when training begins: TypeError for one the probe has not (``fast_lanee=True``)
    or of the wrong type, SettingsError for one out of range. The variables are read
    when the monitor attaches."""
    check_keywords(options)
    return dict(options)


def is_ddp(module: Any) -> bool:
    """Whether ``module`` is a DistributedDataParallel wrapper (what attach times)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def wrapper_of(module: Any) -> str:
    """What the framework wrapped ``module`` in: ``DDP``, ``FSDP2`` (``fully_shard`` on
    it or on a module inside it, as Lightning's ``ModelParallelStrategy`` does), ``FSDP``
    (``FullyShardedDataParallel``), else ``""``. Imports no FSDP: where the package
    never imported, nothing was sharded."""
    if module is None:
        return ""
    if is_ddp(module):
        return "DDP"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return ""
    for each in module.modules():
        if isinstance(each, fsdp.FSDPModule):
            return "FSDP2"
        if isinstance(each, fsdp.FullyShardedDataParallel):
            return "FSDP"
    return ""


def attach_to(
    wrapped: Any, unwrapped: Any, job: str, options: Mapping[str, Any]
) -> Monitor | NullMonitor:
    """Attach to the framework's wrapped module: DDP is timed; any other wrapper (FSDP,
    a module left unwrapped) gets collectives only. Both modules' forward passes
    outside steps count as evaluation. ``options`` are ``torshmon.attach``'s keywords,
    read as it reads them (``torshmon.probe.settings``)."""
    settings = load_probe_settings({**options, "job": job})
    wrapper = wrapper_of(wrapped)
    module = wrapped if wrapper == "DDP" else None
    if module is None and wrapped is not None and is_distributed(os.environ):
        # the probe times forward, backward and buckets through DDP's hooks only
        name = type(wrapped).__name__
        if wrapper:
            log.info("torshmon: %s in %s: collectives and steps only", wrapper, name)
        else:
            log.info("torshmon: %s is not DDP: collectives and steps only", name)
    monitor = attach_with(module, settings)
    for candidate in (wrapped, unwrapped):
        if candidate is not None:
            monitor.watch_forward(candidate)
    return monitor


def micro_batch_loss(losses: list[Any]) -> Any:
    """The mean of a step's micro-batch losses (detached tensors or floats), None
    for none. Tensors stay on their device: the shipper reads them later."""
    if not losses:
        return None
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total / len(losses) if len(losses) > 1 else total
