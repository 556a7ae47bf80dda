"""The in-process probe: runs inside every training process.

``Monitor``, ``attach`` and ``StepScope`` load torch, so they are imported on first
use; ``CommConfig`` and ``ConfigError`` are torch-free. The codec catalogue lives
in ``torshmon.catalogue``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torshmon.probe.config import CommConfig, ConfigError

if TYPE_CHECKING:
    from torshmon.probe.codecs import CODECS
    from torshmon.probe.monitor import Monitor, StepScope, attach

__all__ = ["CODECS", "CommConfig", "ConfigError", "Monitor", "StepScope", "attach"]

_LAZY = {
    "CODECS": "torshmon.probe.codecs",
    "Monitor": "torshmon.probe.monitor",
    "StepScope": "torshmon.probe.monitor",
    "attach": "torshmon.probe.monitor",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torshmon.probe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
