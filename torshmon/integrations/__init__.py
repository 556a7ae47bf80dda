"""One-line integrations with the trainers people use: each opens a torshmon step per
optimizer step of the framework's own loop, on the module it wrapped in DDP or FSDP.

- ``torshmon.integrations.huggingface.TorshmonCallback``: a ``transformers.TrainerCallback``
  (``Trainer(..., callbacks=[TorshmonCallback()])``);
- ``torshmon.integrations.lightning.TorshmonCallback``: a ``lightning.pytorch.Callback``
  (``Trainer(..., callbacks=[TorshmonCallback()])``);
- ``torshmon.integrations.accelerate.watch``: an Accelerate loop
  (``watch(accelerator, model)`` with the model ``accelerator.prepare`` returned).

Each framework is an optional extra (``pip install 'torshmon[huggingface]'``, ...),
imported only by its own module: importing this package imports none of them.
"""

from __future__ import annotations
