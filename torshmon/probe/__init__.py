"""The in-process probe: runs inside every training process.

The probe needs torch, which torshmon installs only with its ``torch`` extra (the
daemons run without it): where torch is missing, importing the probe raises one
ImportError that says how to install it. ``Monitor``, ``attach`` and ``StepScope``
load torch itself on first use, so importing the package stays cheap. The codec
catalogue lives in ``torshmon.catalogue``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

#: What a user without torch is told; also ``torshmon demo``'s error.
MISSING_TORCH = (
    "torshmon's probe needs PyTorch, which is not installed: "
    "pip install 'torshmon[torch]' (the agent and the aggregator run without it)"
)

# find_spec rather than importing torch: the check costs nothing where torch is there.
if importlib.util.find_spec("torch") is None:
    raise ImportError(MISSING_TORCH, name="torch")

from torshmon.probe.config import CommConfig, ConfigError  # noqa: E402

if TYPE_CHECKING:
    from torshmon.probe.api import attach
    from torshmon.probe.codecs import CODECS
    from torshmon.probe.monitor import Monitor
    from torshmon.probe.nullmonitor import NullMonitor
    from torshmon.probe.scope import StepScope

__all__ = ["CODECS", "CommConfig", "ConfigError", "Monitor", "NullMonitor", "StepScope", "attach"]

_LAZY = {
    "CODECS": "torshmon.probe.codecs",
    "Monitor": "torshmon.probe.monitor",
    "NullMonitor": "torshmon.probe.nullmonitor",
    "StepScope": "torshmon.probe.scope",
    "attach": "torshmon.probe.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torshmon.probe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
