"""The monitor of a process that is not part of a distributed job: the API, no probe."""

from __future__ import annotations

from typing import Any

from torshmon.probe.scope import StepScope


class NullMonitor:
    """What ``attach`` returns in a process that is not part of a distributed job: the
    Monitor's API, measuring and sending nothing (steps are counted)."""

    rank = 0
    world_size = 1
    config = None
    dropped_records_total = 0

    def __init__(self, job: str) -> None:
        self.job = job
        self._step = 0
        self._open: StepScope | None = None

    def step(self, batch_size: int | None = None, loss: object = None) -> StepScope:
        """A scope that only counts the step."""
        return StepScope(self, batch_size, loss)

    def begin_step(self, batch_size: int | None = None) -> StepScope:
        """As ``Monitor.begin_step``; measures nothing."""
        scope = StepScope(self, batch_size, None)
        self._begin(scope)
        return scope

    def end_step(self, loss: object = None, *, batch_size: int | None = None) -> None:
        """As ``Monitor.end_step``; measures nothing."""
        if self._open is not None:
            self._end(self._open, failed=False)

    def watch_forward(self, module: Any) -> None:
        """Nothing to watch."""

    def request_config(self, **_config: Any) -> int:
        """No job to reconfigure: RuntimeError, as a Monitor without DDP raises."""
        raise RuntimeError("live reconfiguration needs a distributed job (torshmon is off)")

    @property
    def steps(self) -> int:
        """Steps completed so far."""
        return self._step

    def close(self, timeout_s: float = 5.0) -> None:
        """Nothing to close."""

    def __enter__(self) -> NullMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _begin(self, scope: StepScope) -> None:
        self._open = scope

    def _end(self, scope: StepScope, *, failed: bool) -> None:
        if scope is self._open:
            self._open = None
            self._step += 0 if failed else 1
