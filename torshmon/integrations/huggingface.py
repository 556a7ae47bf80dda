"""torshmon in a Hugging Face ``Trainer``: ``Trainer(..., callbacks=[TorshmonCallback()])``.

One torshmon step per optimizer step (``on_step_begin`` to ``on_step_end``: with gradient
accumulation the micro-batches are inside it); logging, evaluation and checkpoints run
after ``on_step_end``, outside steps, and the Trainer's evaluation of the unwrapped model
counts as ``eval_s``, not input wait. The probe attaches to ``trainer.model_wrapped``
(the DDP module Accelerate built; FSDP: collectives and steps only). Needs the
``huggingface`` extra (transformers).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from torshmon.integrations._common import attach_to, job_name
from torshmon.probe.monitor import Monitor, NullMonitor

log = logging.getLogger(__name__)

__all__ = ["TorshmonCallback"]


class TorshmonCallback(TrainerCallback):  # type: ignore[misc]
    """Monitors the Trainer's run with torshmon.

    ``job``: the job's name (default ``$TORSHMON_JOB``, else ``args.run_name``, else
    torchrun's run id); ``trainer``: the Trainer, where the callback is added before the
    Trainer exists it is found when training begins; ``options``: ``torshmon.attach``'s.
    The step's loss is the mean of its micro-batches' losses as the Trainer sums them
    for its own logging; its batch size is this rank's samples (per-device batch size
    times the micro-batches). ``monitor`` is the Monitor while training runs.
    """

    def __init__(self, job: str | None = None, *, trainer: Any = None, **options: Any) -> None:
        self._job = job
        self._trainer = trainer
        self._options = options
        self.monitor: Monitor | NullMonitor | None = None
        self._loss_before: Any = None

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
        if self.monitor is not None:  # a second train() call: the same monitor goes on
            return
        job = job_name(self._job, args.run_name, os.environ)
        self.monitor = attach_to(wrapped, model, job, self._options)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is None:
            return
        self._loss_before = _summed_loss(self._trainer)
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
        summed, before = _summed_loss(self._trainer), self._loss_before
        if summed is not None and before is not None:
            loss = summed - before  # a new tensor: the Trainer's own is left as it is
        self._loss_before = None
        self.monitor.end_step(loss)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


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


def _summed_loss(trainer: Any) -> Any:
    """A copy of the losses the Trainer has summed since it last logged (its
    ``_tr_loss``: the micro-batch losses, each divided by their count), or None."""
    summed = getattr(trainer, "_tr_loss", None)
    clone = getattr(summed, "clone", None)
    return clone() if clone is not None else None
