"""One training step's scope: what ``mon.step()`` and ``mon.begin_step()`` return."""

from __future__ import annotations

from types import TracebackType
from typing import Protocol


class _StepOwner(Protocol):
    """What a scope tells where it begins and ends (a Monitor or a NullMonitor)."""

    def _begin(self, scope: StepScope) -> None: ...

    def _end(self, scope: StepScope, *, failed: bool) -> None: ...


class StepScope:
    """One training step: ``with mon.step():`` or what ``mon.begin_step()`` returns;
    ``loss`` and ``batch_size`` may be set until it ends."""

    __slots__ = ("_monitor", "batch_size", "loss")

    def __init__(self, monitor: _StepOwner, batch_size: int | None, loss: object) -> None:
        self._monitor = monitor
        self.batch_size = batch_size
        self.loss = loss

    def __enter__(self) -> StepScope:
        self._monitor._begin(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._monitor._end(self, failed=exc_type is not None)
