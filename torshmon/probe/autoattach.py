"""The probe on an unmodified script: ``torshmon run -- torchrun ... train.py``, or
``$TORSHMON_AUTO=1`` with the bootstrap directory on PYTHONPATH (docs/zero-code.md).

``install()`` runs once torch has imported (the bootstrap's ``sitecustomize``). It
touches nothing the script sees until the script trains:

- every ``DistributedDataParallel`` built afterwards gets one forward pre-hook, run
  before any other. At the first training forward pass (grad enabled, module in
  training mode) of a distributed job, the probe attaches to that module, as
  ``torshmon.attach(ddp)`` would, unless the script attached one itself by then. The
  script's own ``attach`` and ``mon.step()`` always win: ``torshmon.attach`` closes the
  automatic monitor, if any, and this module stays out of the way from then on. At
  every training forward pass with no step open, a step begins, its batch size the
  first dimension of the first tensor argument;
- one global optimizer step post-hook ends the open step. An optimizer step with no
  DDP forward pass before it (FSDP, a model DDP does not wrap) attaches the probe to
  collectives only at the first one, and each later one ends a step and begins the
  next: a step is then optimizer step to optimizer step.

A zero-code step has no loss (no hook hands it over) and, on a job without DDP, no
forward/backward split and no input wait (the step begins as the previous one ended).
Anything failing here logs one warning and switches the automatic attach off: the job
trains on.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from torshmon.probe import api as _api_module
from torshmon.probe.api import attach, attach_with
from torshmon.probe.collectives import CollectiveTracer
from torshmon.probe.monitor import Monitor, NullMonitor
from torshmon.probe.settings import ProbeSettings, load_probe_settings

log = logging.getLogger(__name__)

#: The switch the bootstrap reads (``torshmon run`` sets it for its children).
AUTO_ENV = "TORSHMON_AUTO"
#: This directory's ``_bootstrap``: first on the children's PYTHONPATH.
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


class _State:
    """The process's automatic attach: the monitor once attached, whether it is off."""

    def __init__(self) -> None:
        self.installed = False
        self.off = False
        self.monitor: Monitor | NullMonitor | None = None
        #: a DDP forward pass began the open step (else steps run optimizer to optimizer)
        self.forward_delimited = False
        self.ddp_init: Any = None
        self.optimizer_handle: Any = None
        #: loaded once, at install: a bad variable is told at start-up, not mid-run
        self.settings: ProbeSettings | None = None


_state = _State()


def install() -> None:
    """Load the probe's settings from the environment, wrap
    ``DistributedDataParallel.__init__`` and add the global optimizer hook.
    Idempotent; attaches nothing yet. SettingsError for a bad ``TORSHMON_*`` variable,
    before anything is installed (the bootstrap says so in one line; the job trains
    unwatched)."""
    if _state.installed:
        return
    _state.settings = load_probe_settings({})
    _state.installed = True
    _state.optimizer_handle = register_optimizer_step_post_hook(_on_optimizer_step)
    original = DistributedDataParallel.__init__

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not _state.off:
            self.register_forward_pre_hook(_on_ddp_forward, prepend=True, with_kwargs=True)

    _state.ddp_init = original
    DistributedDataParallel.__init__ = ddp_init
    # The script's own torshmon.attach (resolved through this module at call time):
    # the automatic monitor, if attached already, closes first and stands aside.
    _api_module.attach = _script_attach


def uninstall() -> None:
    """Undo ``install`` and close the monitor it attached (tests)."""
    global _state
    if _state.ddp_init is not None:
        DistributedDataParallel.__init__ = _state.ddp_init
        _api_module.attach = attach
    if _state.optimizer_handle is not None:
        _state.optimizer_handle.remove()
    if _state.monitor is not None:
        _state.monitor.close()
    _state = _State()


def monitor() -> Monitor | NullMonitor | None:
    """The monitor the automatic attach made, None before (or without) one."""
    return _state.monitor


def _switch_off(what: str, exc: BaseException) -> None:
    _state.off = True
    log.warning(
        "torshmon: automatic attach %s failed (%s: %s); monitoring is off",
        what,
        type(exc).__name__,
        exc,
    )


def _script_attach(module: Any = None, **options: Any) -> Monitor | NullMonitor:
    """``torshmon.attach`` while the automatic attach is installed: the script's own
    monitor wins, after any the automatic attach made is closed."""
    _state.off = True
    mon = _state.monitor
    if mon is not None:
        _state.monitor = None
        log.info("torshmon: the script attaches the probe itself; the automatic one closes")
        mon.close()
    return attach(module, **options)


_script_attach.__doc__ = (_script_attach.__doc__ or "") + "\n\n" + (attach.__doc__ or "")


def _script_attached() -> bool:
    """The script attached a monitor of its own: it delimits its steps."""
    return CollectiveTracer._installed is not None


def _attach(module: Any) -> Monitor | NullMonitor | None:
    if _script_attached():
        log.info("torshmon: the script attached the probe itself; automatic attach stands aside")
        _state.off = True
        return None
    if _state.settings is None:
        return None  # uninstalled meanwhile
    mon = attach_with(module, _state.settings)
    _state.monitor = mon
    log.info(
        "torshmon: attached automatically to %s (job %s)",
        type(module).__name__,
        mon.job if isinstance(mon, Monitor) else "-",
    )
    return mon


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else None
    return None


def _on_ddp_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if _state.off or not (module.training and torch.is_grad_enabled()):
        return
    try:
        mon = _state.monitor
        if mon is None:
            if not (dist.is_available() and dist.is_initialized()):
                return
            mon = _attach(module)
            if mon is None:
                return
        if isinstance(mon, Monitor) and mon._open is None:
            mon.begin_step(batch_size=_batch_size(args, kwargs))
            _state.forward_delimited = True
    except Exception as exc:
        _switch_off("at the forward pass", exc)


def _on_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if _state.off:
        return
    try:
        mon = _state.monitor
        if mon is None:
            if not (dist.is_available() and dist.is_initialized()):
                return
            # No DDP forward pass came first: collectives only, optimizer to optimizer.
            mon = _attach(None)
            if isinstance(mon, Monitor):
                mon.begin_step()
            return
        if not isinstance(mon, Monitor) or mon._open is None:
            return
        mon.end_step()
        if not _state.forward_delimited:
            mon.begin_step()
        else:
            _state.forward_delimited = False
            # the next training forward pass begins the next step
    except Exception as exc:
        _switch_off("at the optimizer step", exc)
