"""``torshmon run -- COMMAND...``: run a launcher (torchrun) with the probe attached to
its training processes, the script unmodified (docs/zero-code.md).

Imports no torch: the command becomes COMMAND (``exec``), its environment the caller's
plus ``TORSHMON_AUTO=1`` and the bootstrap directory first on ``PYTHONPATH``, which
torchrun hands to every rank. There ``torshmon.probe.autoattach`` does the rest.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

#: the directory whose ``sitecustomize`` installs the automatic attach
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "probe" / "_bootstrap"


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the switch on and the bootstrap first on PYTHONPATH (once)."""
    out = dict(env)
    out["TORSHMON_AUTO"] = "1"
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(BOOTSTRAP_DIR), *(p for p in paths if Path(p).resolve() != BOOTSTRAP_DIR)]
    out["PYTHONPATH"] = os.pathsep.join(paths)
    return out


def resolve(command: Sequence[str]) -> list[str]:
    """The command with its leading ``--`` dropped; ValueError with a one-line reason
    where there is none or its program cannot be found."""
    words = list(command[1:] if command and command[0] == "--" else command)
    if not words:
        raise ValueError("no command given: torshmon run -- torchrun ... train.py")
    program = shutil.which(words[0])
    if program is None:
        raise ValueError(f"{words[0]!r} is not a program found on PATH")
    return [program, *words[1:]]


def exec_command(words: Sequence[str]) -> None:
    """Become ``words`` (resolved by ``resolve``) with the child environment; returns
    only where ``exec`` fails (OSError)."""
    os.execve(words[0], list(words), child_env(os.environ))
