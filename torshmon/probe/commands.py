"""The agent's commands to one rank: validated and queued as they arrive, answered
(accepted, applied, rejected, superseded) as the config consensus and the link checks
act on them.

Commands arrive on the shipper thread (``take``); the consensus runs on the training
thread at a step's end (``sync``), which is where queued configs take effect and where
the link checks a step ran are reported (``report_link_checks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torshmon.probe.config import ConfigError
from torshmon.probe.evidence import EvidenceCapture
from torshmon.probe.linkcheck import DEFAULT_SIZE_BYTES, LinkCheckDone, LinkCheckRequest
from torshmon.probe.reconfig import Applied, Reconfigurator, Rejected
from torshmon.probe.shipper import Shipper
from torshmon.wire import (
    TEXT_MAX_CHARS,
    AckStatus,
    AppliedConfig,
    Command,
    CommandAck,
    ConfigRejection,
    LinkCheckResult,
    LinkPeerResult,
)

#: What a "config" command may set: ``Monitor.request_config``'s arguments.
_CONFIG_ARGS = frozenset({"bucket_cap_mb", "first_bucket_cap_mb", "codec", "codec_params"})
#: What a "link_check" command may set.
_LINK_CHECK_ARGS = frozenset({"size_bytes", "repeats"})
_COMMAND_KINDS = "config, link_check, evidence"


class CommandDesk:
    """One rank's commands in flight: what was accepted and awaits its final answer.

    ``request_config`` is ``Monitor.request_config`` (it raises where live
    reconfiguration is off); ``current_step`` says the steps completed so far.
    """

    def __init__(
        self,
        *,
        job: str,
        rank: int,
        shipper: Shipper,
        evidence: EvidenceCapture,
        reconfig: Reconfigurator | None,
        request_config: Callable[..., int],
        current_step: Callable[[], int],
    ) -> None:
        self._job = job
        self._rank = rank
        self._shipper = shipper
        self._evidence = evidence
        self._reconfig = reconfig
        self._request_config = request_config
        self._current_step = current_step
        self._by_version: dict[int, Command] = {}
        self._link_checks: dict[str, Command] = {}

    def take(self, commands: list[Command]) -> None:
        """Commands relayed by the agent (shipper thread): validate and queue them."""
        for command in commands:
            try:
                if command.job != self._job:
                    raise ConfigError(f"command for job {command.job!r} reached job {self._job!r}")
                if command.kind == "link_check":
                    self._accept_link_check(command)
                    continue
                if command.kind == "evidence":
                    self._evidence.request(command)
                    if self._rank == 0:  # every rank takes it; rank 0 answers for the job
                        self._ack(command, "applied", effective_step=self._current_step())
                    continue
                version = self._accept_config(command)
            except (ConfigError, RuntimeError, TypeError, ValueError) as exc:
                self._ack(command, "rejected", reason=str(exc))
            else:
                self._by_version[version] = command
                self._ack(command, "accepted", version=version)

    def sync(self, step: int) -> tuple[AppliedConfig | None, list[ConfigRejection]]:
        """Join the config consensus at step ``step``'s boundary (a collective on sync
        steps): the config it applied, if any, and the configs it rejected."""
        if self._reconfig is None:
            return None, []
        # Not guarded: a failure here is a broken process group, which the job
        # will see in its own next collective; swallowing it could desync ranks.
        outcome = self._reconfig.sync(step)
        rejected = [
            ConfigRejection(version=r.version, reason=r.reason[:TEXT_MAX_CHARS])
            for r in self._reconfig.take_rejections()
        ]
        if isinstance(outcome, Rejected):
            rejected.append(
                ConfigRejection(version=outcome.version, reason=outcome.reason[:TEXT_MAX_CHARS])
            )
            self._ack_superseded(outcome.version)
            command = self._by_version.pop(outcome.version, None)
            if command is not None:
                self._ack(command, "rejected", reason=outcome.reason)
        if not isinstance(outcome, Applied):
            return None, rejected
        config = outcome.config
        self._ack_superseded(config.version)
        command = self._by_version.pop(config.version, None)
        if command is not None:
            self._ack(
                command, "applied", version=config.version, effective_step=outcome.effective_step
            )
        return (
            AppliedConfig(
                version=config.version,
                bucket_cap_bytes=config.bucket_cap_bytes,
                first_bucket_cap_bytes=config.first_bucket_cap_bytes,
                codec=config.codec,
                codec_params=dict(config.codec_params),
                effective_step=outcome.effective_step,
            ),
            rejected,
        )

    def report_link_checks(self) -> None:
        """Ship the link checks the consensus ran since the last call."""
        if self._reconfig is not None:
            for done in self._reconfig.take_link_checks():
                self._report_link_check(done)

    def _accept_link_check(self, command: Command) -> None:
        unknown = sorted(set(command.args) - _LINK_CHECK_ARGS)
        if unknown:
            allowed = ", ".join(sorted(_LINK_CHECK_ARGS))
            raise ConfigError(f"unknown link_check field {unknown[0]!r}; allowed: {allowed}")
        size = _int_arg(command, "size_bytes", DEFAULT_SIZE_BYTES)
        repeats = _int_arg(command, "repeats", 1)
        if self._reconfig is None:
            raise RuntimeError(
                "link checks need a DDP module whose process group spans the whole job "
                "(they run on the config consensus's gloo group)"
            )
        request = LinkCheckRequest(id=command.id, size_bytes=size, repeats=repeats)

        def queued() -> None:
            # Before the check can run: its "applied" must never come first.
            self._link_checks[command.id] = command
            self._ack(command, "accepted")

        self._reconfig.request_link_check(request, on_queued=queued)

    def _report_link_check(self, done: LinkCheckDone) -> None:
        """Ship what this rank measured; rank 0 also answers the command."""
        result = LinkCheckResult(
            id=done.request.id,
            job=self._job,
            rank=self._rank,
            step=done.step,
            duration_s=done.duration_s,
            host=done.host,
            peers=[
                LinkPeerResult(
                    peer=p.peer,
                    size_bytes=p.size_bytes,
                    duration_s=p.duration_s,
                    cpu_wait_s=p.cpu_wait_s,
                )
                for p in done.peers
            ],
        )
        self._shipper.link_checks.put(result)
        command = self._link_checks.pop(done.request.id, None)
        if command is not None:
            self._ack(command, "applied", effective_step=done.step)

    def _accept_config(self, command: Command) -> int:
        if command.kind != "config":
            raise ConfigError(f"unknown command kind {command.kind!r}; allowed: {_COMMAND_KINDS}")
        unknown = sorted(set(command.args) - _CONFIG_ARGS)
        if unknown:
            allowed = ", ".join(sorted(_CONFIG_ARGS))
            raise ConfigError(f"unknown config field {unknown[0]!r}; allowed: {allowed}")
        return self._request_config(**command.args)

    def _ack(self, command: Command, status: AckStatus, **details: Any) -> None:
        if "reason" in details:
            details["reason"] = details["reason"][:TEXT_MAX_CHARS]
        ack = CommandAck(id=command.id, job=command.job, status=status, **details)
        self._shipper.command_acks.put(ack)

    def _ack_superseded(self, version: int) -> None:
        """Commands queued before ``version`` were replaced by it (a later request
        replaces a queued one): they get their final answer now, not never."""
        # list(): the shipper thread adds commands while the training thread is here.
        for older in sorted(v for v in list(self._by_version) if v < version):
            command = self._by_version.pop(older, None)
            if command is None:
                continue
            self._ack(
                command,
                "rejected",
                reason=f"superseded by config version {version} before it was applied",
            )


def _int_arg(command: Command, name: str, default: int) -> int:
    value = command.args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value
