"""torshmon's zero-code bootstrap (``torshmon run``, or ``$TORSHMON_AUTO=1`` with this
directory on PYTHONPATH).

Python imports ``sitecustomize`` at start-up from the first directory on ``sys.path`` that
has one. This one imports neither torch nor torshmon's probe: where ``$TORSHMON_AUTO`` is
set it adds an import hook that, once ``torch`` has finished importing, calls
``torshmon.probe.autoattach.install()``. A process that never imports torch (torchrun's
own helpers, a data-prep subprocess) pays one ``find_spec`` per import. Then it runs the
``sitecustomize`` this one hides, if the environment has one. It also sizes torch's
Flight Recorder for the probe (``_small_flight_recorder``). Any failure is one line
on stderr: the job runs on unwatched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_OFF = ("", "0", "false", "no", "off")
#: ``torshmon.probe.flightrec.BUFFER_ENVS`` and ``ddpcomm.DEFAULT_BUFFER_ENTRIES`` (this
#: module imports nothing of torshmon's: a test holds them equal)
_FR_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FR_ENTRIES = "256"


def _say(what: str, exc: BaseException) -> None:
    sys.stderr.write(f"torshmon: {what} ({type(exc).__name__}: {exc}); monitoring is off\n")


def _after_torch() -> None:
    try:
        from torshmon.probe import autoattach

        autoattach.install()
    except Exception as exc:  # the job comes first
        _say("could not prepare the automatic attach", exc)


def _small_flight_recorder() -> None:
    """A Flight Recorder small enough for the probe to read DDP's all-reduces from
    (``torshmon.probe.ddpcomm``), where the job sizes it in neither variable: torch reads
    the size once, as the first process group starts, long before the probe attaches."""
    if not any(name in os.environ for name in _FR_ENVS):
        os.environ[_FR_ENVS[0]] = _FR_ENTRIES


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps ``torch``'s loader so that ``_after_torch`` runs once
    ``import torch`` has completed, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if spec is None or exec_module is None:
            return spec

        def exec_then_install(module: Any) -> None:
            exec_module(module)
            _after_torch()

        setattr(loader, "exec_module", exec_then_install)  # noqa: B010 (mypy: a method)
        return spec


def _chain_hidden_sitecustomize() -> None:
    """The ``sitecustomize`` later on ``sys.path`` (a distribution's own), run as Python
    would have run it."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("TORSHMON_AUTO", "").strip().lower() not in _OFF:
    _small_flight_recorder()
    try:
        if "torch" in sys.modules:
            _after_torch()
        else:
            sys.meta_path.insert(0, _TorchImportHook())
    except Exception as exc:
        _say("could not install the import hook", exc)
try:
    _chain_hidden_sitecustomize()
except Exception as exc:
    sys.stderr.write(f"torshmon: the environment's sitecustomize failed ({exc})\n")
