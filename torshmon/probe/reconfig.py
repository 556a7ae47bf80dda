"""Applying a new communication config on every rank at the same step.

Only rank 0 takes requests. Every ``sync_every`` steps, at the end of the
step, all ranks post one broadcast of a small fixed-size buffer from rank 0 on
a separate gloo group (so it never touches NCCL streams); empty means "no
change". The broadcast completes in the background and is read at the end of
the next step, so no rank ever waits for it. A change is then applied in three
phases, so that ranks can never end up on different configs (which would hang
the job):

1. prepare: each rank builds what it needs (codec object, checks) without
   touching DDP;
2. vote: one all-reduce (MIN) of "prepared"; any failure rejects on all ranks;
3. commit: every rank swaps the codec and, if the caps changed or torshmon's
   comm hook must come or go, rebuilds the Reducer, before the next step.

With codec ``none`` (and bucket timing off) the job reduces through DDP's own
C++ path: a Python comm hook costs about 0.3 ms per bucket on CPU gloo (the
GIL passes between threads three times per bucket), so it is installed only
while a codec needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torshmon.probe import _torch_compat
from torshmon.probe.codecs import Codec, make_codec
from torshmon.probe.commhook import DispatchingCommHook
from torshmon.probe.config import MIB, CommConfig, ConfigError, next_config

log = logging.getLogger(__name__)

#: Size of the broadcast buffer: a 4-byte length, then the config as JSON.
PAYLOAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Applied:
    """A config every rank applied; it governs steps from ``effective_step`` on."""

    config: CommConfig
    effective_step: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A config no rank applied, and why."""

    version: int
    reason: str


class Reconfigurator:
    """Owns the job's current CommConfig and the consensus that changes it.

    ``request`` may be called from any thread of rank 0; ``sync`` must be
    called by every rank at the end of every step (it is collective on sync
    steps) and ``close`` by every rank once.
    """

    def __init__(
        self,
        module: Any,
        hook: DispatchingCommHook,
        *,
        sync_every: int = 10,
        hook_always: bool = False,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self._module = module
        self._hook = hook
        self._sync_every = sync_every
        self._hook_always = hook_always
        self._hook_installed = hook_always
        # Collective: every rank creates it at attach, in the same order.
        self._group = dist.new_group(backend="gloo")
        self._rank = self._group.rank()
        self._rebuild_unavailable = _torch_compat.reducer_rebuild_unavailable(module)
        self._lock = threading.Lock()
        self._pending: CommConfig | None = None
        self._posted: tuple[Any, torch.Tensor] | None = None
        self._rejections: list[Rejected] = []
        self.current = CommConfig(
            version=0,
            bucket_cap_mb=module.bucket_bytes_cap / MIB,
            first_bucket_cap_mb=_torch_compat.first_bucket_cap_bytes(module) / MIB,
        )
        self._latest = self.current

    def request(
        self,
        *,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
        codec: str | None = None,
        codec_params: Mapping[str, object] | None = None,
    ) -> CommConfig:
        """Validate a change and queue it for the next sync step (rank 0 only).

        The change applies to the latest requested config. Raises ConfigError
        naming the bad field (the job keeps its config), or RuntimeError on any
        rank but 0. A later request replaces a queued one.
        """
        if self._rank != 0:
            raise RuntimeError("only rank 0 takes configuration requests")
        with self._lock:
            try:
                config = next_config(
                    self._latest,
                    bucket_cap_mb=bucket_cap_mb,
                    first_bucket_cap_mb=first_bucket_cap_mb,
                    codec=codec,
                    codec_params=codec_params,
                )
                self._check_applicable(config)
            except ConfigError as exc:
                self._rejections.append(Rejected(self._latest.version + 1, str(exc)))
                raise
            self._pending = self._latest = config
        return config

    def take_rejections(self) -> list[Rejected]:
        """Rejections of requests made on this rank since the last call."""
        if not self._rejections:
            return []
        with self._lock:
            out, self._rejections = self._rejections, []
        return out

    def sync(self, step: int) -> Applied | Rejected | None:
        """End-of-step consensus: apply what the last sync step carried, post the next."""
        outcome = None
        config = self._receive()
        if config is not None:
            outcome = self._apply(config, step)
        if step % self._sync_every == 0:
            self._post()
        return outcome

    def close(self) -> None:
        """Finish a posted exchange (every rank posted it, so it completes)."""
        self._receive()

    # -- the exchange -----------------------------------------------------------------
    def _post(self) -> None:
        payload = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
        if self._rank == 0:
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is not None:
                data = pending.to_json()
                framed = len(data).to_bytes(4, "big") + data
                payload[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
        self._posted = (self._group.broadcast(payload, 0), payload)

    def _receive(self) -> CommConfig | None:
        posted, self._posted = self._posted, None
        if posted is None:
            return None
        work, payload = posted
        work.wait()
        raw = bytes(payload.tolist())
        length = int.from_bytes(raw[:4], "big")
        return CommConfig.from_json(raw[4 : 4 + length]) if length else None

    # -- phases -----------------------------------------------------------------------
    def _needs_hook(self, config: CommConfig) -> bool:
        return self._hook_always or config.codec != "none"

    def _needs_rebuild(self, config: CommConfig) -> bool:
        hook_changes = self._needs_hook(config) != self._hook_installed
        return hook_changes or not config.same_buckets(self.current)

    def _check_applicable(self, config: CommConfig) -> None:
        if len(config.to_json()) > PAYLOAD_BYTES - 4:
            raise ConfigError(f"codec_params too large to send (over {PAYLOAD_BYTES - 4} bytes)")
        reason = self._rebuild_unavailable
        if reason is None:
            return
        if not config.same_buckets(self.current):
            raise ConfigError(f"bucket_cap_mb cannot change in this job: {reason}")
        if self._needs_hook(config) != self._hook_installed:
            raise ConfigError(
                f"codec cannot change in this job: {reason} "
                "(attach with bucket_timing=True to keep torshmon's comm hook installed)"
            )

    def _apply(self, config: CommConfig, step: int) -> Applied | Rejected:
        prepared: Codec | None = None
        reason = ""
        try:
            prepared = self._prepare(config)
        except Exception as exc:
            reason = f"rank {dist.get_rank()} could not prepare it: {exc}"
            log.warning("torshmon: config version %d rejected: %s", config.version, reason)
        if not self._all_agree(ok=not reason):
            return Rejected(config.version, reason or "another rank could not prepare it")
        self._commit(config, prepared)
        return Applied(config, effective_step=step + 1)

    def _prepare(self, config: CommConfig) -> Codec | None:
        if self._needs_rebuild(config) and self._rebuild_unavailable:
            raise ConfigError(self._rebuild_unavailable)
        if config.codec == "none":
            return None
        return make_codec(config.codec, self._hook.process_group, config.codec_params)

    def _all_agree(self, *, ok: bool) -> bool:
        vote = torch.tensor([1 if ok else 0], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([vote], options).wait()
        return bool(vote.item())

    def _commit(self, config: CommConfig, codec: Codec | None) -> None:
        if self._needs_rebuild(config):
            install = self._needs_hook(config)
            _torch_compat.rebuild_reducer(
                self._module,
                config.bucket_cap_bytes,
                config.first_bucket_cap_bytes,
                self._hook.__call__ if install else None,
            )
            self._hook_installed = install
        self._hook.set_codec(codec)
        self._hook.reset_buckets()
        self.current = config
