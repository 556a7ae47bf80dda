"""``torshmon.attach``: load the probe's settings once, then start a Monitor with them
(or a NullMonitor in a process that is no rank of a distributed job)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from torshmon.probe.monitor import Monitor, NullMonitor
from torshmon.probe.settings import ProbeSettings, load_probe_settings

__all__ = ["attach", "attach_with", "is_distributed"]

log = logging.getLogger(__name__)


def attach(
    module: Any = None,
    *,
    job: str | None = None,
    agent_socket: str | None = None,
    node: str | None = None,
    agent_user: str | None = None,
    run_id: str | None = None,
    local_rank: int | None = None,
    flush_interval_s: float | None = None,
    max_buffered_steps: int | None = None,
    ddp_stats_every: int | None = None,
    sync_every: int | None = None,
    error_sample_every: int | None = None,
    bucket_timing: bool | None = None,
    fast_lane: bool | None = None,
    cpu_wait: bool | None = None,
) -> Monitor | NullMonitor:
    """Start monitoring this rank.

    ``module`` is the DistributedDataParallel module (or None to watch collectives
    only). Each keyword is a probe setting (docs/configuration.md lists them with
    their defaults, what they allow and their variables): one not given (None) is
    read from its ``TORSHMON_*`` variable, else it takes its default. So an operator
    can set one for every rank under torchrun, the script unchanged, and the script's
    own word wins.

    Every rank must call ``attach`` (it creates a gloo group for the consensus) and
    ``step`` equally often. In a process that is no rank of a distributed job
    (torch.distributed not initialised and ``$WORLD_SIZE`` unset or 1) it logs one
    line and returns a ``NullMonitor``: the same API, measuring nothing.

    The settings are checked first, in every process: TypeError for a keyword of the
    wrong type (``fast_lane="off"``) or one the probe has not; ValueError
    (``torshmon.settings.SettingsError``) naming the keyword, or the variable, for a
    value out of range or a variable that says no such value. Then RuntimeError if
    torch.distributed is not initialized in a rank of a distributed job (attach came
    before ``init_process_group``) or a monitor is already attached in this process,
    TypeError for a module that is not DDP.
    """
    settings = load_probe_settings(
        {
            "job": job,
            "agent_socket": agent_socket,
            "node": node,
            "agent_user": agent_user,
            "run_id": run_id,
            "local_rank": local_rank,
            "flush_interval_s": flush_interval_s,
            "max_buffered_steps": max_buffered_steps,
            "ddp_stats_every": ddp_stats_every,
            "sync_every": sync_every,
            "error_sample_every": error_sample_every,
            "bucket_timing": bucket_timing,
            "fast_lane": fast_lane,
            "cpu_wait": cpu_wait,
        }
    )
    return attach_with(module, settings)


def attach_with(module: Any, settings: ProbeSettings) -> Monitor | NullMonitor:
    """``attach`` with settings already loaded (the zero-code attach, the integrations)."""
    if not is_distributed(os.environ):
        log.info("torshmon: not a distributed run (no process group): monitoring is off")
        return NullMonitor(settings.job)
    return Monitor(module, settings=settings)


def is_distributed(env: Mapping[str, str]) -> bool:
    """Whether this process belongs to a distributed job: torch.distributed is
    initialised, or the launcher said it is one of several ranks (``$WORLD_SIZE``)."""
    if dist.is_available() and dist.is_initialized():
        return True
    try:
        return int(env.get("WORLD_SIZE") or 1) > 1
    except ValueError:
        return False
