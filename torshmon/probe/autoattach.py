"""The probe on an unmodified script: ``torshmon run -- torchrun ... train.py``, or
``$TORSHMON_AUTO=1`` with the bootstrap directory on PYTHONPATH (docs/zero-code.md).

``install()`` runs once torch has imported (the bootstrap's ``sitecustomize``). It
touches nothing the script sees until the script trains:

- every ``DistributedDataParallel`` built afterwards, and every module FSDP2's
  ``fully_shard`` returns (once ``torch.distributed.fsdp`` has imported: the wrapper
  replaces the package's ``fully_shard``, where scripts import it from), gets one
  forward pre-hook, run before any other (before FSDP's all-gather). At the first
  training forward pass (grad enabled, module in training mode) of a distributed job,
  the probe attaches: to the DDP module, as ``torshmon.attach(ddp)`` would; for FSDP2,
  as ``torshmon.attach(None)`` with the module watched for evaluation passes. Unless
  the script attached one itself by then: its own ``attach`` and ``mon.step()`` always
  win (``torshmon.attach`` closes the automatic monitor, if any, and this module stays
  out of the way from then on). At every training forward pass with no step open, a
  step begins, its batch size the first dimension of the first tensor argument;
- one global optimizer step post-hook ends the open step. An optimizer step with no
  such forward pass before it (FSDP1, a model nothing wraps) attaches the probe to
  collectives only at the first one, and each later one ends a step and begins the
  next: a step is then optimizer step to optimizer step.

A zero-code step has no loss (no hook hands it over); under FSDP2 no forward/backward
split (the probe times those through DDP's hooks); on a job with neither, no input wait
either (the step begins as the previous one ended).
Anything failing here logs one warning and switches the automatic attach off: the job
trains on.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
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
#: the package scripts import ``fully_shard`` from, and the modules that re-export it
FSDP_PACKAGE = "torch.distributed.fsdp"
_FSDP_NAMESPACES = (FSDP_PACKAGE, "torch.distributed.fsdp._fully_shard")


class _State:
    """The process's automatic attach: the monitor once attached, whether it is off."""

    def __init__(self) -> None:
        self.installed = False
        self.off = False
        self.monitor: Monitor | NullMonitor | None = None
        #: a forward pass began the open step (else steps run optimizer to optimizer)
        self.forward_delimited = False
        self.ddp_init: Any = None
        self.optimizer_handle: Any = None
        #: loaded once, at install: a bad variable is told at start-up, not mid-run
        self.settings: ProbeSettings | None = None
        #: FSDP2's own ``fully_shard`` while the wrapper stands in for it
        self.fully_shard: Any = None
        self.fsdp_finder: _AfterImport | None = None


_state = _State()


def install() -> None:
    """Load the probe's settings from the environment, wrap
    ``DistributedDataParallel.__init__`` (and FSDP2's ``fully_shard`` once its package
    has imported) and add the global optimizer hook. Idempotent; attaches nothing yet
    and imports no FSDP (a second or more of imports). SettingsError for a bad
    ``TORSHMON_*`` variable, before anything is installed (the bootstrap says so in one
    line; the job trains unwatched)."""
    if _state.installed:
        return
    _state.settings = load_probe_settings({})
    _state.installed = True
    _state.optimizer_handle = register_optimizer_step_post_hook(_on_optimizer_step)
    original = DistributedDataParallel.__init__

    def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not _state.off:
            self.register_forward_pre_hook(_on_forward, prepend=True, with_kwargs=True)

    _state.ddp_init = original
    DistributedDataParallel.__init__ = ddp_init
    _state.fsdp_finder = _AfterImport(FSDP_PACKAGE, _wrap_fully_shard)
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
    if _state.fsdp_finder is not None:
        _state.fsdp_finder.remove()
    if _state.fully_shard is not None:
        _set_fully_shard(_state.fully_shard)
    if _state.monitor is not None:
        _state.monitor.close()
    _state = _State()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs ``then(module)`` once module ``name`` has finished
    importing (at once where it has already), then leaves ``sys.meta_path``."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self._name = name
        self._then = then
        if name in sys.modules:
            _call_safely(then, sys.modules[name])
        else:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or exec_module is None:
            return spec
        then = self._then

        def exec_then(module: Any) -> None:
            exec_module(module)
            _call_safely(then, module)

        setattr(loader, "exec_module", exec_then)  # noqa: B010 (mypy: a method)
        return spec


def _call_safely(then: Callable[[Any], None], module: Any) -> None:
    try:
        then(module)
    except Exception as exc:  # the script's import goes on
        _switch_off(f"after importing {module.__name__}", exc)


def _wrap_fully_shard(package: Any) -> None:
    """Stand a wrapper in for ``fully_shard`` where scripts import it from: each module
    it returns gets the forward pre-hook DDP modules get."""
    original = package.fully_shard

    @functools.wraps(original)  # keeps ``fully_shard.state``, FSDP's own accessor
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(module, *args, **kwargs)
        if not _state.off:
            try:
                for each in result if isinstance(result, list) else [result]:
                    each.register_forward_pre_hook(_on_forward, prepend=True, with_kwargs=True)
            except Exception as exc:
                _switch_off("at fully_shard", exc)
        return result

    _state.fully_shard = original
    _set_fully_shard(fully_shard)


def _set_fully_shard(function: Any) -> None:
    for name in _FSDP_NAMESPACES:
        namespace = sys.modules.get(name)
        if namespace is not None and hasattr(namespace, "fully_shard"):
            namespace.__dict__["fully_shard"] = function


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
    """Attach to ``module``: a DDP module is timed; any other (FSDP2's) gets
    collectives and steps, its forward passes outside steps counted as evaluation."""
    if _script_attached():
        log.info("torshmon: the script attached the probe itself; automatic attach stands aside")
        _state.off = True
        return None
    if _state.settings is None:
        return None  # uninstalled meanwhile
    ddp = isinstance(module, DistributedDataParallel)
    mon = attach_with(module if ddp else None, _state.settings)
    if module is not None and not ddp:
        mon.watch_forward(module)
    _state.monitor = mon
    log.info(
        "torshmon: attached automatically to %s%s (job %s)",
        type(module).__name__,
        "" if ddp or module is None else ": collectives and steps only",
        mon.job if isinstance(mon, Monitor) else "-",
    )
    return mon


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else None
    return None


def _on_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A DDP or FSDP2 module's forward pre-hook: a training pass with no step open
    begins one (the first attaches the probe); nested FSDP2 modules find it open."""
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
            # No DDP or FSDP2 forward pass came first: collectives only, optimizer to optimizer.
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
