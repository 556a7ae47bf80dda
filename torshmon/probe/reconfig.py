"""Applying a new communication config on every rank at the same step.

Only rank 0 takes requests. Every ``sync_every`` steps, at the end of the
step, all ranks post one broadcast of a small fixed-size buffer from rank 0 on
a separate gloo group (so it never touches NCCL streams; on a gloo job built on
the job's own device, ``_torch_compat.side_group``); empty means "no change".
The broadcast completes in the background and is read at the end of the next
step, so no rank ever waits for it. A change is then applied in three
phases, so that ranks can never end up on different configs (which would hang
the job):

1. prepare: each rank builds what it needs (codec object, checks) without
   touching DDP;
2. vote: one all-reduce (MIN) of "prepared"; any failure rejects on all ranks;
3. commit: every rank swaps the codec and, if the caps changed or torshmon's
   comm hook must come or go, rebuilds the Reducer, before the next step.

The same broadcast carries link checks (``linkcheck.py``): a check queued on rank
0 runs on every rank at the step where its payload is read, after any config
change of that payload is applied and before the next payload is posted, so the
check's messages on the side group never interleave with the consensus.

With codec ``none`` (and bucket timing off) the job reduces through DDP's own
C++ path: a Python comm hook costs about 0.3 ms per bucket on CPU gloo (the
GIL passes between threads three times per bucket), so it is installed only
while a codec needs it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torshmon.probe import _torch_compat
from torshmon.probe.codecs import Codec, make_codec
from torshmon.probe.commhook import DispatchingCommHook
from torshmon.probe.config import MIB, CommConfig, ConfigError, next_config
from torshmon.probe.linkcheck import (
    LinkCheckDone,
    LinkCheckRequest,
    gather_strings,
    host_key,
    run_link_check,
)

log = logging.getLogger(__name__)

#: Size of the broadcast buffer: a 4-byte length and the config as JSON, then a
#: 4-byte length and the link check as JSON (a length of 0: none).
PAYLOAD_BYTES = 1024
#: Room kept for the link check's part (its JSON is under 100 bytes).
LINK_CHECK_BYTES = 128
#: The largest config JSON that fits beside a link check.
MAX_CONFIG_BYTES = PAYLOAD_BYTES - 4 - LINK_CHECK_BYTES
#: The buffer's first 8 bytes (both lengths) when it carries neither part.
_NOTHING_SENT = bytes(8)


def encode_payload(config: CommConfig | None, check: LinkCheckRequest | None) -> bytes:
    """The broadcast buffer's bytes (exactly PAYLOAD_BYTES) carrying either, both or none.

    Raises ConfigError if a part does not fit.
    """
    data = config.to_json() if config is not None else b""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config too large to send ({len(data)} > {MAX_CONFIG_BYTES} bytes)")
    tail = b""
    if check is not None:
        fields = {"id": check.id, "size_bytes": check.size_bytes, "repeats": check.repeats}
        tail = json.dumps(fields).encode()
        if len(tail) > LINK_CHECK_BYTES - 4:
            raise ConfigError(f"link check id too long to send: {check.id!r}")
    framed = len(data).to_bytes(4, "big") + data + len(tail).to_bytes(4, "big") + tail
    return framed.ljust(PAYLOAD_BYTES, b"\0")


def decode_payload(raw: bytes) -> tuple[CommConfig | None, LinkCheckRequest | None]:
    """The config and link check a broadcast buffer carries (None where absent).

    Every rank decodes the same bytes, so every rank gets the same answer: a link
    check part that cannot be read is dropped (and logged) on all of them alike.
    """
    length = int.from_bytes(raw[:4], "big")
    config = CommConfig.from_json(raw[4 : 4 + length]) if length else None
    at = 4 + length
    check_length = int.from_bytes(raw[at : at + 4], "big")
    check = None
    if check_length:
        try:
            fields = json.loads(raw[at + 4 : at + 4 + check_length])
            check = LinkCheckRequest(
                id=str(fields["id"]),
                size_bytes=int(fields["size_bytes"]),
                repeats=int(fields.get("repeats", 1)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("torshmon: unreadable link check in the consensus payload: %s", exc)
    return config, check


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
        job_hook: _torch_compat.JobCommHook | None = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if job_hook is not None and hook_always:
            raise ValueError("torshmon's comm hook cannot replace the job's own")
        self._module = module
        self._hook = hook
        self._job_hook = job_hook
        self._sync_every = sync_every
        self._hook_always = hook_always
        self._hook_installed = hook_always
        # Collective: every rank creates it at attach, in the same order.
        self._group = _torch_compat.side_group()
        self._rank = self._group.rank()
        self._hosts: list[str] | None = None  # each rank's host_key, at the first link check
        self._rebuild_unavailable = _torch_compat.reducer_rebuild_unavailable(module)
        self._lock = threading.Lock()
        self._pending: CommConfig | None = None
        self._pending_check: LinkCheckRequest | None = None
        self._checks_done: list[LinkCheckDone] = []
        self._posted: Any = None  # the broadcast in flight (its Work)
        # One buffer for every exchange: each is waited for before the next is posted.
        self._payload = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
        # Its two lengths, seen through a view made once (the buffer is only ever
        # written in place): comparing 8 bytes costs about 1.5 us a receive, numpy's
        # ``any`` on two slices 35 us on a loaded core (a tight loop, 2 gloo ranks).
        self._payload_head = memoryview(self._payload.numpy())[:8]
        # The list-and-options overload: ``broadcast(tensor, root)`` builds its options
        # anew and pybind tries the list overload first (26 against 33-65 us a post).
        self._broadcast_options = dist.BroadcastOptions()
        self._broadcast_options.rootRank = 0
        self._payload_blank = True  # rank 0's buffer holds nothing to send
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

    def request_link_check(
        self, request: LinkCheckRequest, on_queued: Callable[[], None] | None = None
    ) -> None:
        """Queue a link check for the next sync step (rank 0 only).

        ``on_queued`` runs once the request is valid, before the check can be sent
        (so an acknowledgement it queues comes before the check's outcome). Raises
        ConfigError if one is already queued or the job has a single rank,
        RuntimeError on any rank but 0.
        """
        if self._rank != 0:
            raise RuntimeError("only rank 0 takes link check requests")
        if self._group.size() < 2:
            raise ConfigError("a link check needs at least 2 ranks")
        encode_payload(None, request)  # fails here, not at the sync step
        with self._lock:
            if self._pending_check is not None:
                raise ConfigError(f"link check {self._pending_check.id!r} is already queued")
            if on_queued is not None:
                on_queued()
            self._pending_check = request

    def take_link_checks(self) -> list[LinkCheckDone]:
        """Link checks this rank ran since the last call."""
        if not self._checks_done:
            return []  # every step: no allocation for the usual case
        out, self._checks_done = self._checks_done, []
        return out

    def take_rejections(self) -> list[Rejected]:
        """Rejections of requests made on this rank since the last call."""
        if not self._rejections:
            return []
        with self._lock:
            out, self._rejections = self._rejections, []
        return out

    def idle_at(self, step: int) -> bool:
        """True where ``sync(step)`` has nothing to do: no exchange to read, none to
        post (not a sync step) and no rejection to report. The training thread asks
        first and skips the consensus's calls, about 8 us a step on a loaded core; the
        exchanges, and so the step every rank applies a config at, are unchanged."""
        return self._posted is None and step % self._sync_every != 0 and not self._rejections

    def sync(self, step: int) -> Applied | Rejected | None:
        """End-of-step consensus: apply what the last sync step carried, post the next."""
        outcome = None
        config, check = self._receive()
        if config is not None:
            outcome = self._apply(config, step)
        if check is not None:
            self._run_check(check, step)
        if step % self._sync_every == 0:
            self._post()
        return outcome

    def close(self) -> None:
        """Finish a posted exchange (every rank posted it, so it completes), then let
        the side group go: its gloo threads would otherwise outlive the monitor, a
        process that attaches again gaining more each time."""
        try:
            self._receive()
        finally:
            try:
                _torch_compat.release_side_group(self._group)
            except Exception as exc:  # the job destroyed every group first, say
                log.debug("torshmon: side group not released: %s", exc)

    # -- the exchange -----------------------------------------------------------------
    def _post(self) -> None:
        payload = self._payload
        if self._rank == 0:
            with self._lock:
                pending, self._pending = self._pending, None
                check, self._pending_check = self._pending_check, None
            if pending is not None or check is not None:
                framed = encode_payload(pending, check)
                payload[:] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
                self._payload_blank = False
            elif not self._payload_blank:
                payload.zero_()
                self._payload_blank = True
        self._posted = self._group.broadcast([payload], self._broadcast_options)

    def _receive(self) -> tuple[CommConfig | None, LinkCheckRequest | None]:
        work, self._posted = self._posted, None
        if work is None:
            return None, None
        work.wait()
        if self._payload_head.tobytes() == _NOTHING_SENT:
            return None, None  # the usual exchange
        return decode_payload(self._payload.numpy().tobytes())

    def _run_check(self, check: LinkCheckRequest, step: int) -> None:
        # Not guarded, like the consensus itself: every rank is inside the same
        # exchanges, and a failure is a broken side group the job would see anyway.
        started = time.perf_counter()
        if self._hosts is None:
            # Once per job: which ranks share a host (and so a NIC) does not change.
            self._hosts = gather_strings(self._group, host_key())
        timings = run_link_check(
            self._group,
            self._rank,
            self._group.size(),
            check.size_bytes,
            check.repeats,
            hosts=self._hosts,
        )
        done = LinkCheckDone(
            check, step, time.perf_counter() - started, tuple(timings), self._hosts[self._rank]
        )
        self._checks_done.append(done)

    # -- phases -----------------------------------------------------------------------
    def _needs_hook(self, config: CommConfig) -> bool:
        return self._hook_always or config.codec != "none"

    def _needs_rebuild(self, config: CommConfig) -> bool:
        hook_changes = self._needs_hook(config) != self._hook_installed
        return hook_changes or not config.same_buckets(self.current)

    def _check_applicable(self, config: CommConfig) -> None:
        if len(config.to_json()) > MAX_CONFIG_BYTES:
            raise ConfigError(f"codec_params too large to send (over {MAX_CONFIG_BYTES} bytes)")
        reason = self._job_hook_conflict(config)
        if reason is not None:
            raise ConfigError(reason)
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

    def _job_hook_conflict(self, config: CommConfig) -> str | None:
        """Why ``config`` would change what the job's own comm hook computes, or None.

        A built-in C++ hook is registered again on every rebuilt Reducer, so the
        bucket cap may change; a codec would replace it. A Python hook's state may
        depend on the bucket layout, so nothing changes under it.
        """
        job_hook = self._job_hook
        if job_hook is None:
            return None
        if job_hook.builtin is None:
            return (
                f"the job registered its own DDP comm hook ({job_hook.name}): torshmon "
                "keeps it and does not retune this job (a new Reducer would drop it)"
            )
        if config.codec != "none":
            return (
                f"the job registered its own DDP comm hook ({job_hook.name}): a codec "
                "would replace it and change the job's results; bucket_cap_mb may change"
            )
        return None

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
        conflict = self._job_hook_conflict(config)
        if conflict is not None:
            raise ConfigError(conflict)
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
                builtin_hook=None if self._job_hook is None else self._job_hook.builtin,
            )
            self._hook_installed = install
        self._hook.set_codec(codec)
        self._hook.reset_buckets()
        self.current = config
