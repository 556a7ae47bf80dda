"""The per-node agent side of the probe protocol."""

from torshmon.agent.receiver import ProbeReceiver

__all__ = ["ProbeReceiver"]
