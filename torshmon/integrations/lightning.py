"""torshmon in a Lightning ``Trainer``: ``Trainer(..., callbacks=[TorshmonCallback()])``.

One torshmon step per optimizer step: it begins with the first micro-batch
(``on_train_batch_start``) and ends after the batch whose optimizer stepped
(``on_before_optimizer_step``, then ``on_train_batch_end``), so with
``accumulate_grad_batches`` the micro-batches are inside it; validation, checkpoints and
logging run outside steps (validation counts as ``eval_s``). The probe attaches to
``trainer.strategy.model`` (the DDP module the strategy built; FSDP: collectives and
steps only). Needs the ``lightning`` extra.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.data import extract_batch_size

from torshmon.integrations._common import attach_to, checked_options, job_name
from torshmon.probe.monitor import Monitor, NullMonitor

__all__ = ["TorshmonCallback"]

#: the name of the logger Lightning makes where the job gives none
_DEFAULT_LOGGER_NAME = "lightning_logs"


class TorshmonCallback(pl.Callback):  # type: ignore[misc]
    """Monitors the Trainer's fit with torshmon.

    ``job``: the job's name (default ``$TORSHMON_JOB``, else the logger's name, else
    the LightningModule's class name); ``options``: ``torshmon.attach``'s, checked
    here (TypeError for one it has not). The step's loss is what
    ``training_step`` returned for its micro-batches (as Lightning scales them for
    accumulation, summed), its batch size this rank's samples in them. ``monitor`` is
    the Monitor while fitting.
    """

    def __init__(self, job: str | None = None, **options: Any) -> None:
        self._job = job
        self._options = checked_options(options)  # a typo fails here, not when training begins
        self.monitor: Monitor | NullMonitor | None = None
        self._open = False  # a step begun, its optimizer step not yet over
        self._losses: list[Any] = []
        self._samples: int | None = 0
        self._stepped = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run_name = getattr(trainer.logger, "name", None)
        if not run_name or run_name == _DEFAULT_LOGGER_NAME:
            run_name = type(pl_module).__name__  # a name every job shares names none
        job = job_name(self._job, run_name, os.environ)
        self.monitor = attach_to(trainer.strategy.model, pl_module, job, self._options)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None:
            return
        if not self._open:
            self.monitor.begin_step()
            self._open, self._losses, self._samples, self._stepped = True, [], 0, False
        try:
            size = extract_batch_size(batch)
        except Exception:  # a batch Lightning cannot size either: no throughput
            self._samples = None
        else:
            self._samples = None if self._samples is None else self._samples + size

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._stepped = True

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.monitor is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and hasattr(loss, "detach"):
            self._losses.append(loss.detach())
        if not self._stepped:
            return  # a micro-batch: the step goes on
        total = None
        for value in self._losses:
            total = value if total is None else total + value
        if total is not None and not pl_module.automatic_optimization:
            total = total / len(self._losses)  # unscaled: their mean
        self._open = False
        self.monitor.end_step(total, batch_size=self._samples or None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
