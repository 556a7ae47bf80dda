"""torshmon: watch distributed PyTorch training while it runs.

``torshmon.attach(ddp_model, job=...)`` starts the probe in a training process.
The probe (and torch) load on first use, so the daemons that import other parts
of the package do not pay for importing torch, nor need it installed: torch comes
with the ``torch`` extra (``pip install 'torshmon[torch]'``) on training hosts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torshmon.version import __version__

if TYPE_CHECKING:
    from torshmon.probe import CommConfig, ConfigError, Monitor, NullMonitor, StepScope, attach

__all__ = [
    "CommConfig",
    "ConfigError",
    "Monitor",
    "NullMonitor",
    "StepScope",
    "__version__",
    "attach",
]


def __getattr__(name: str) -> Any:
    if name in ("CommConfig", "ConfigError", "Monitor", "NullMonitor", "StepScope", "attach"):
        from torshmon import probe

        return getattr(probe, name)
    raise AttributeError(f"module 'torshmon' has no attribute {name!r}")
