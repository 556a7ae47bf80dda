"""torshmon in an Accelerate loop: ``watched = watch(accelerator, model)`` with the model
``accelerator.prepare`` returned.

Accelerate has no step callbacks (its trackers see only what the loop logs), so the
loop's own events delimit steps: a step begins at the first training forward pass of
the prepared model after the previous optimizer step (grad enabled, module in training
mode) and ends when the optimizer steps (``register_step_post_hook``; under
``accelerator.accumulate`` that is the last micro-batch's). Forward passes in eval mode
or under ``no_grad`` count as evaluation (``eval_s``). The loss is the mean of those
passed to ``accelerator.backward`` in the step, the batch size the samples the step's
forward passes took (the first tensor argument's first dimension). Needs the
``accelerate`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from torshmon.integrations._common import (
    attach_to,
    checked_options,
    job_name,
    micro_batch_loss,
)
from torshmon.probe.monitor import Monitor, NullMonitor

__all__ = ["AccelerateWatch", "watch"]


def watch(
    accelerator: Any,
    model: Any,
    optimizer: Any = None,
    *,
    job: str | None = None,
    **options: Any,
) -> AccelerateWatch:
    """Monitor the loop of ``accelerator`` with torshmon.

    ``model``: the one ``accelerator.prepare`` returned (its DDP wrapper: Accelerate
    keeps only the unwrapped module); ``optimizer``: the prepared one whose step ends a
    step (default: every optimizer ``accelerator.prepare`` returned); ``job``: the job's
    name (default ``$TORSHMON_JOB``, else the name of the accelerator's
    ``project_dir``, else torchrun's run id); ``options``: ``torshmon.attach``'s, checked
    here (TypeError for one it has not).
    """
    options = checked_options(options)  # before anything is hooked
    optimizers = [optimizer] if optimizer is not None else list(accelerator._optimizers)
    project_dir = getattr(accelerator.project_configuration, "project_dir", None)
    run_name = os.path.basename(os.path.normpath(project_dir)) if project_dir else None
    name = job_name(job, run_name, os.environ)
    monitor = attach_to(model, accelerator.unwrap_model(model), name, options)
    return AccelerateWatch(accelerator, model, optimizers, monitor)


class AccelerateWatch:
    """The hooks ``watch`` put on an Accelerate loop; ``monitor`` is the Monitor.
    ``close()`` removes them and closes the monitor (also at interpreter exit)."""

    def __init__(
        self, accelerator: Any, model: Any, optimizers: list[Any], monitor: Monitor | NullMonitor
    ) -> None:
        self.monitor = monitor
        self._accelerator = accelerator
        self._open = False
        self._losses: list[Any] = []
        self._samples: int | None = 0
        # First: the step must be open before the probe's own pre-hook times the forward.
        self._handles = [
            model.register_forward_pre_hook(self._on_forward, prepend=True, with_kwargs=True)
        ]
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)  # AcceleratedOptimizer wraps the torch one
            self._handles.append(inner.register_step_post_hook(self._on_optimizer_step))
        self._backward: Callable[..., Any] = accelerator.backward
        accelerator.backward = self._on_backward

    def close(self) -> None:
        """Remove the hooks and close the monitor. Safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._accelerator.__dict__.get("backward") == self._on_backward:
            del self._accelerator.backward
        self.monitor.close()

    def _on_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation: the probe's own hooks count it
        if not self._open:
            self.monitor.begin_step()
            self._open, self._losses, self._samples = True, [], 0
        size = _batch_size(args, kwargs)
        self._samples = None if size is None or self._samples is None else self._samples + size

    def _on_backward(self, loss: Any, **kwargs: Any) -> Any:
        if self._open and hasattr(loss, "detach"):
            self._losses.append(loss.detach())
        return self._backward(loss, **kwargs)

    def _on_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._open:
            return  # a second optimizer of the same step
        self._open = False
        self.monitor.end_step(micro_batch_loss(self._losses), batch_size=self._samples or None)


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first dimension of the forward pass's first tensor argument, if any."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None
