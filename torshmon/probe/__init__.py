"""The in-process probe: runs inside every training process."""

from torshmon.probe.monitor import Monitor, StepScope, attach

__all__ = ["Monitor", "StepScope", "attach"]
