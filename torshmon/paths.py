"""Default locations shared by the probe and the agent."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/torshmon``, else a per-user folder under the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "torshmon"
    return Path(tempfile.gettempdir()) / f"torshmon-{os.getuid()}"


def default_agent_socket() -> str:
    """The agent's Unix socket: ``$TORSHMON_AGENT_SOCKET`` or ``<runtime dir>/agent.sock``."""
    return os.environ.get("TORSHMON_AGENT_SOCKET") or str(runtime_dir() / "agent.sock")
