"""A launch's run id, the same on every rank of it, found at ``attach``.

The probe's ``run_id`` setting (``torshmon.probe.settings``): torchrun's
``$TORCHELASTIC_RUN_ID`` where it names one (its ``--rdzv-id``, a fresh id per launch
under ``--standalone``; "none" when neither was given), else ``$TORSHMON_RUN_ID`` (or
the ``run_id`` keyword, which comes first), else one rank 0 makes and the others
read from the process group's own rendezvous store (no collective on the job's
groups). Rank 0 writes it under a key of that store; a rank that cannot read it within
``timeout_s`` (a store that the launcher does not share, a rank 0 that attached late)
falls back to an id derived from the rendezvous address, the same on every rank of one
launch at one port.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any, Final

log = logging.getLogger(__name__)

#: The rendezvous store's key under which rank 0 leaves the run id it made.
STORE_KEY: Final = "torshmon/run_id"
#: The longest run id kept; a launcher's longer one is cut to it.
RUN_ID_MAX_CHARS: Final = 64


def env_run_id(env: Mapping[str, str]) -> str | None:
    """The run id the launcher gave, or None."""
    torchrun = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if torchrun and torchrun != "none":
        return torchrun[:RUN_ID_MAX_CHARS]
    own = env.get("TORSHMON_RUN_ID", "").strip()
    return own[:RUN_ID_MAX_CHARS] or None


def agreed_run_id(rank: int, store: Any, timeout_s: float = 30.0, attempt: str = "0") -> str:
    """Rank 0's fresh id, shared through ``store`` (a ``torch.distributed.Store``).
    ``attempt``: torchrun's restart count; its agent's store outlives a restart, so each
    attempt has its own key (no rank reads the previous attempt's id)."""
    key = f"{STORE_KEY}/{attempt}"
    if rank == 0:
        made = uuid.uuid4().hex[:16]
        store.set(key, made)
        return made
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return bytes(store.get(key)).decode()[:RUN_ID_MAX_CHARS]


def run_id_at_attach(rank: int, given: str | None, env: Mapping[str, str] | None = None) -> str:
    """This launch's run id: ``given`` (the probe's ``run_id`` setting, which read the
    launcher's variables), else agreed through the rendezvous store (torchrun's restart
    count and rendezvous address read from ``env``); never raises."""
    if given is not None:
        return given
    env = os.environ if env is None else env
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return agreed_run_id(rank, _get_default_store(), attempt=attempt)
    except Exception:  # the job comes first: any failure falls back
        log.warning("torshmon: no shared run id from the rendezvous store", exc_info=True)
    where = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return "port-" + hashlib.sha256(where.encode()).hexdigest()[:12]
