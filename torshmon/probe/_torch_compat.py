"""The one place the probe touches private torch APIs, each with a fallback.

Checked against torch 2.4 to 2.13. Every helper degrades to "not available"
(returns False / None) rather than raising into the training loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def queue_backward_end_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward pass ends, after DDP's own
    finalisation (which waits for every bucket). Call only inside a backward pass.

    DDP queues its finalisation when the last bucket is launched, later than our
    first hook call, and the engine runs final callbacks in order, including ones
    queued while running them: so we queue a callback that queues ``callback``.
    Returns False where the autograd engine does not offer final callbacks.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False

    def requeue() -> None:
        try:
            queue(callback)
        except RuntimeError:
            log.debug("torshmon: could not re-queue the backward-end callback", exc_info=True)

    try:
        queue(requeue)
    except RuntimeError:
        return False
    return True


def ddp_logging_data(module: Any) -> dict[str, object] | None:
    """DDP's own runtime statistics (``_get_ddp_logging_data``), or None."""
    getter = getattr(module, "_get_ddp_logging_data", None)
    if getter is None:
        return None
    try:
        return dict(getter())
    except Exception:
        log.debug("torshmon: DDP logging data unavailable", exc_info=True)
        return None
