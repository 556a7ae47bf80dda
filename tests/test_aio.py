"""torshmon.aio: waiting for an event without losing a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

from torshmon.aio import wait_event


async def _plain(event: asyncio.Event, timeout_s: float) -> bool:
    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    return False


async def _cancelled_as_the_event_is_set(wait: Callable[..., Awaitable[bool]]) -> bool:
    """A loop waiting on an event is cancelled in the same loop turn as the event is
    set: whether the task ended cancelled within 1 s (not after its 60 s timeout)."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(event, 60.0)
            event.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)  # the task waits on the event
    event.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1.0)
    stopped = task.cancelled()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return stopped


async def test_a_cancellation_that_meets_the_event_is_not_lost() -> None:
    assert await _cancelled_as_the_event_is_set(wait_event)


async def test_plain_wait_for_loses_it_before_python_3_12() -> None:
    """Why wait_event exists: the same race with asyncio.wait_for (rewritten in 3.12)."""
    lost = not await _cancelled_as_the_event_is_set(_plain)
    assert lost == (sys.version_info < (3, 12))


async def test_it_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0)
    assert await wait_event(event, 0.0)  # already set
