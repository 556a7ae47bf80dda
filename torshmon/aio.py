"""asyncio helpers the daemons share."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s`` seconds.

    ``asyncio.wait_for(event.wait(), timeout)`` before Python 3.12 swallows a
    cancellation that arrives as the event is set: the waiting task goes on as if it
    had not been cancelled, and a loop around it waits out its next timeout while its
    owner awaits it to stop (an aggregator took its full 60 s evaluation interval to
    close that way). ``asyncio.wait`` never swallows one.
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return bool(done)
