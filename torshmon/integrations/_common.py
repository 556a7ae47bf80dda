"""What the integrations share: the job's name, which module to attach, and a step
opened and closed from two hooks of a framework's loop. Framework-free."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from torshmon.probe.api import attach_with
from torshmon.probe.monitor import Monitor, NullMonitor
from torshmon.probe.settings import default_job_name, load_probe_settings
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


def is_ddp(module: Any) -> bool:
    """Whether ``module`` is a DistributedDataParallel wrapper (what attach times)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def attach_to(
    wrapped: Any, unwrapped: Any, job: str, options: Mapping[str, Any]
) -> Monitor | NullMonitor:
    """Attach to the framework's wrapped module: DDP is timed; any other wrapper (FSDP,
    a module left unwrapped) gets collectives only. Both modules' forward passes
    outside steps count as evaluation. ``options`` are ``torshmon.attach``'s keywords,
    read as it reads them (``torshmon.probe.settings``)."""
    settings = load_probe_settings({**options, "job": job})
    module = wrapped if is_ddp(wrapped) else None
    if module is None and wrapped is not None and os.environ.get("WORLD_SIZE", "1") != "1":
        log.info(
            "torshmon: %s is not DistributedDataParallel: collectives and steps only",
            type(wrapped).__name__,
        )
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
