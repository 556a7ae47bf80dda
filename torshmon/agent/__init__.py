"""The per-node agent side of the probe protocol."""

from torshmon.agent.receiver import ProbeReceiver, ThreadedReceiver, read_messages

__all__ = ["ProbeReceiver", "ThreadedReceiver", "read_messages"]
