"""The probe's settings: ``torshmon.attach``'s keywords, else ``TORSHMON_*`` variables,
else the defaults; read and checked once, where ``attach`` loads them.

``ProbeSettings`` is a section of the same settings model as the daemons'
(``torshmon.settings``): each field declares its type, default, constraints, variable
and help once, and ``docs/configuration.md`` is generated from it. A keyword the code
passes is checked strictly (``fast_lane="off"`` is refused, not read as a wish); a
variable is text and read as the daemons read theirs (``off``, ``500ms``). Any bad
value stops ``attach`` with one line naming the keyword or the variable, before
training starts: a mistake in the settings fails fast at start-up, never mid-run.
Torch-free, so that the docs generator reads it without loading torch.
"""

from __future__ import annotations

import os
import pwd
import socket
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Final

import msgspec

from torshmon.paths import runtime_dir
from torshmon.probe.runid import RUN_ID_MAX_CHARS, env_run_id
from torshmon.settings import (
    FieldSpec,
    Layers,
    Section,
    SettingsError,
    convert,
    field_specs,
    setting,
)
from torshmon.wire import NAME_MAX_CHARS

__all__ = [
    "ENV_PREFIX",
    "ProbeSettings",
    "check_keywords",
    "default_job_name",
    "load_probe_settings",
]

#: The variables of settings that have none of their own: this and the name.
ENV_PREFIX: Final = "TORSHMON_PROBE_"
#: torchrun's id of a launch; "none" where neither ``--rdzv-id`` nor ``--standalone``
#: gave one.
TORCHRUN_RUN_ID_ENV: Final = "TORCHELASTIC_RUN_ID"


def _agent_socket(env: Mapping[str, str] | None = None) -> str:
    return str(runtime_dir(env) / "agent.sock")


class ProbeSettings(Section, frozen=True):
    """What ``torshmon.attach`` (and the zero-code attach, and the integrations) run with.

    Build it with ``load_probe_settings``: keyword, else variable, else default.
    """

    job: Annotated[
        str,
        setting(
            "the job's name, the same on every rank",
            env="TORSHMON_JOB",
            default_text="torchrun's run id ($TORCHELASTIC_RUN_ID), else `default`",
        ),
    ] = "default"
    agent_socket: Annotated[
        str,
        setting(
            "the node agent's Unix socket",
            env="TORSHMON_AGENT_SOCKET",
            default_text="<runtime dir>/agent.sock",
        ),
    ] = msgspec.field(default_factory=_agent_socket)
    node: Annotated[
        str,
        setting(
            "the node's name, as the agent's --node where the hostname is not it",
            env="TORSHMON_NODE",
            default_text="the hostname",
        ),
    ] = msgspec.field(default_factory=socket.gethostname)
    agent_user: Annotated[
        str | None,
        setting(
            "a user (name or uid) whose agent the probe also sends to, for an agent shared by "
            "the node's training users; else only this user's or root's",
            env="TORSHMON_AGENT_USER",
            default_text="none",
        ),
    ] = None
    run_id: Annotated[
        str | None,
        setting(
            "the launch's id, the same on every rank; torchrun's $TORCHELASTIC_RUN_ID comes "
            "first where it names one (not `none`)",
            env="TORSHMON_RUN_ID",
            default_text="torchrun's run id, else rank 0's, shared through the rendezvous store",
        ),
    ] = None
    local_rank: Annotated[
        int | None,
        setting(
            "this rank's index on its node (torchrun sets LOCAL_RANK)",
            env="LOCAL_RANK",
            default_text="the global rank",
        ),
    ] = None
    flush_interval_s: Annotated[
        float, setting("how often buffered steps are sent to the agent", gt=0)
    ] = 0.5
    max_buffered_steps: Annotated[
        int,
        setting(
            "steps held while the agent is away; past it the oldest are dropped and counted",
            ge=1,
        ),
    ] = 10_000
    ddp_stats_every: Annotated[
        int, setting("steps between samples of DDP's own bucket statistics", ge=1)
    ] = 50
    sync_every: Annotated[
        int,
        setting(
            "steps between the ranks' config consensus points (one small broadcast); "
            "the same on every rank",
            ge=1,
        ),
    ] = 10
    error_sample_every: Annotated[
        int, setting("steps between measurements of a codec's error", ge=1)
    ] = 50
    bucket_timing: Annotated[
        bool,
        setting(
            "time every DDP bucket through a Python comm hook even while no codec runs "
            "(about 0.3 ms a bucket on CPU gloo); off, DDP's sampled statistics describe them"
        ),
    ] = False
    fast_lane: Annotated[
        bool,
        setting(
            "send a step out of line with the rank's recent ones at once; false: every "
            "step waits for the next flush (alerts up to a second later)",
            env="TORSHMON_FAST_LANE",
        ),
    ] = True
    cpu_wait: Annotated[
        bool,
        setting(
            "read the run-queue clocks for cpu_wait_s and process_cpu_wait_s, so a rank "
            "held back by a busy node is told from a slow one (three cold system calls a "
            "step, 70-100 us of the training thread on CPU); false: neither is reported "
            "(a busy node's delay then counts as the rank's own)",
            env="TORSHMON_CPU_WAIT",
        ),
    ] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("job", "node"):
            value = getattr(self, name)
            length = len(value) if value.strip() else 0  # blank: none
            if not 1 <= length <= NAME_MAX_CHARS:
                # The agent would reject every frame of this rank, and nothing would say why.
                raise SettingsError(
                    f"{name} must be 1 to {NAME_MAX_CHARS} characters, got {length}"
                )
        if self.local_rank is not None and self.local_rank < 0:  # msgspec: no bound on X | None
            raise SettingsError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.run_id is not None and not 1 <= len(self.run_id) <= RUN_ID_MAX_CHARS:
            raise SettingsError(
                f"run_id must be 1 to {RUN_ID_MAX_CHARS} characters, got {len(self.run_id)}"
            )
        self.agent_uid()  # a user that does not exist is an error now, not at the first send

    def agent_uid(self) -> int | None:
        """The uid of ``agent_user`` (None without one); SettingsError if there is none."""
        user = self.agent_user
        if user is None:
            return None
        if user.strip().isdigit():
            return int(user)
        try:
            return pwd.getpwnam(user.strip()).pw_uid
        except KeyError:
            raise SettingsError(f"agent_user {user!r} is no user on this host") from None


_SPECS: Final = {spec.name: spec for spec in field_specs(ProbeSettings)}


def load_probe_settings(
    keywords: Mapping[str, Any], *, env: Mapping[str, str] | None = None
) -> ProbeSettings:
    """The settings from ``keywords`` (``attach``'s; None: not given), else the
    environment (``os.environ`` where ``env`` is None), else the defaults.

    TypeError for a keyword the probe has not, or of the wrong type; SettingsError (a
    ValueError) for a value out of range, naming the variable where one gave it.
    """
    env = os.environ if env is None else env
    check_keywords(keywords)
    layers: Layers[ProbeSettings] = Layers(ProbeSettings, env_prefix=ENV_PREFIX)
    values: dict[str, Any] = {}
    variables: dict[str, str] = {}  # the settings that came from one: its name
    for name, spec in _SPECS.items():
        given = keywords.get(name)
        if given is not None:
            values[name] = given
            continue
        variable = layers.env_name((name,), spec)
        text = env.get(variable, "").strip()
        if text:
            values[name] = _from_variable(variable, spec, text)
            variables[name] = variable
    if "job" not in values:
        values["job"] = default_job_name(env)
    if "run_id" not in keywords or keywords["run_id"] is None:
        # torchrun's id comes before TORSHMON_RUN_ID (see runid.env_run_id).
        values["run_id"] = env_run_id(env)
    if "agent_socket" not in values:  # follows the environment given, not os.environ
        values["agent_socket"] = _agent_socket(env)
    try:
        return ProbeSettings(**values)
    except SettingsError as exc:
        # __post_init__'s own checks name their field first: say which variable gave it.
        source = variables.get(str(exc).split(" ", 1)[0])
        raise SettingsError(f"{source}: {exc}" if source else str(exc)) from None


def check_keywords(keywords: Mapping[str, Any]) -> None:
    """TypeError for a name that is no probe setting, or a value of the wrong type;
    SettingsError for one out of range (None: not given, always fine)."""
    unknown = sorted(set(keywords) - set(_SPECS))
    if unknown:
        raise TypeError(f"unknown probe setting {unknown[0]!r}; known: {', '.join(sorted(_SPECS))}")
    for name, value in keywords.items():
        if value is None:
            continue
        spec = _SPECS[name]
        try:
            convert(spec, value, strict=True)
        except SettingsError as exc:
            if _is_type(spec, value):
                raise  # a value of the right type, out of range
            raise TypeError(str(exc)) from None


def _is_type(spec: FieldSpec, value: Any) -> bool:
    base = typing.get_args(spec.hint)[0] if typing.get_origin(spec.hint) is Annotated else spec.hint
    try:
        msgspec.convert(value, base, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def _from_variable(variable: str, spec: FieldSpec, text: str) -> Any:
    try:
        return convert(spec, text)
    except SettingsError as exc:
        raise SettingsError(f"{variable}: {exc}") from None


def default_job_name(env: Mapping[str, str]) -> str:
    """``$TORSHMON_JOB``, else torchrun's run id (``$TORCHELASTIC_RUN_ID``, its
    ``--rdzv-id``; a fresh id per run under ``--standalone``; not its default "none"),
    else ``default``: jobs under torchrun are told apart without naming them."""
    run_id = env.get(TORCHRUN_RUN_ID_ENV, "")
    return env.get("TORSHMON_JOB") or (run_id if run_id not in ("", "none") else "default")
