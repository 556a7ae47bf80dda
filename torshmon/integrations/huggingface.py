"""torshmon in a Hugging Face ``Trainer``: ``Trainer(..., callbacks=[TorshmonCallback()])``.

One torshmon step per optimizer step (``on_step_begin`` to ``on_step_end``: with gradient
accumulation the micro-batches are inside it); logging, evaluation and checkpoints run
after ``on_step_end``, outside steps, and the Trainer's evaluation of the unwrapped model
counts as ``eval_s``, not input wait. The probe attaches to ``trainer.model_wrapped``
(the DDP module Accelerate built; FSDP: collectives and steps only). The step's loss is
what ``Trainer.training_step`` returned for its micro-batches (no callback is handed
the loss: ``on_log`` sees the mean over ranks and logging steps, after the step). Needs
the ``huggingface`` extra (transformers).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from torshmon.integrations._common import attach_to, checked_options, job_name
from torshmon.probe.monitor import Monitor, NullMonitor

log = logging.getLogger(__name__)

__all__ = ["TorshmonCallback"]


class TorshmonCallback(TrainerCallback):  # type: ignore[misc]
    """Monitors the Trainer's run with torshmon.

    ``job``: the job's name (default ``$TORSHMON_JOB``, else ``args.run_name``, else
    torchrun's run id); ``trainer``: the Trainer, where the callback is added before the
    Trainer exists it is found when training begins; ``options``: ``torshmon.attach``'s, checked
    here (TypeError for one it has not).
    The step's loss is the sum of what ``training_step`` returned for its micro-batches
    (each divided by their count: their mean), as the Trainer sums them for its own
    logging; its batch size is this rank's samples (per-device batch size times the
    micro-batches). ``monitor`` is the Monitor while training runs.
    """

    def __init__(self, job: str | None = None, *, trainer: Any = None, **options: Any) -> None:
        self._job = job
        self._trainer = trainer
        self._options = checked_options(options)  # a typo fails here, not when training begins
        self.monitor: Monitor | NullMonitor | None = None
        self._losses: list[Any] = []  # what training_step returned in the open step

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        trainer = self._trainer if self._trainer is not None else _calling_trainer()
        self._trainer = trainer
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        if trainer is None:
            log.warning("torshmon: the Trainer was not found; DDP's buckets go untimed")
        if trainer is not None and "training_step" not in vars(trainer):
            trainer.training_step = _LossTap(trainer.training_step, self._losses)
        if self.monitor is not None:  # a second train() call: the same monitor goes on
            return
        job = job_name(self._job, args.run_name, os.environ)
        self.monitor = attach_to(wrapped, model, job, self._options)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._losses.clear()
        if self.monitor is None:
            return
        micro_batches = getattr(
            self._trainer, "current_gradient_accumulation_steps", args.gradient_accumulation_steps
        )
        self.monitor.begin_step(batch_size=args.per_device_train_batch_size * micro_batches)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is None:
            return
        loss = None
        for value in self._losses:  # each a tensor of the Trainer's: summed anew
            loss = value if loss is None else loss + value
        self._losses.clear()
        self.monitor.end_step(loss)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer = self._trainer
        if trainer is not None and isinstance(vars(trainer).get("training_step"), _LossTap):
            del trainer.training_step  # the class's own again
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class _LossTap:
    """``Trainer.training_step`` as the Trainer calls it, each loss it returns (this
    rank's, detached, divided by the micro-batches) also kept for the step."""

    def __init__(self, training_step: Any, losses: list[Any]) -> None:
        self._training_step = training_step
        self._losses = losses

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        loss = self._training_step(*args, **kwargs)
        if hasattr(loss, "detach"):
            self._losses.append(loss.detach())
        return loss


def _calling_trainer() -> Any:
    """The Trainer whose loop runs this callback: its hooks hand callbacks the
    unwrapped model only, and the DDP module is the Trainer's ``model_wrapped``."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None
