"""Entering a named network namespace (``ip netns``), which a rank process does first.

Apart from ``linkshape`` (which makes the namespaces) so that ``launch`` can put a rank
into one without importing the shaper, and the shaper can launch ranks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Final

#: Where ``ip netns`` keeps its named namespaces.
NETNS_DIR: Final = "/var/run/netns"
_CLONE_NEWNET: Final = 0x40000000


def enter_netns(name: str) -> None:
    """Move the calling thread into the named network namespace (``ip netns`` name).

    Call it before opening any socket: a socket stays in the namespace it was
    made in. Threads started afterwards inherit the namespace, threads started
    before do not. Raises OSError if the namespace does not exist or setns fails.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name!r}: {os.strerror(errno)}")
    finally:
        os.close(fd)


__all__ = ["NETNS_DIR", "enter_netns"]
