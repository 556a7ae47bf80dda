"""The in-process probe: runs inside every training process."""

from torshmon.probe.codecs import CODECS
from torshmon.probe.config import CommConfig, ConfigError
from torshmon.probe.monitor import Monitor, StepScope, attach

__all__ = ["CODECS", "CommConfig", "ConfigError", "Monitor", "StepScope", "attach"]
