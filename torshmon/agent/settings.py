"""The agent's settings: flags first, then ``TORSHMON_*`` variables, then a config file
(``torshmon agent --config FILE``); read and checked by ``torshmon.settings``."""

from __future__ import annotations

import grp
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from torshmon.agent.forwarder import check_aggregator_url
from torshmon.paths import default_agent_socket, runtime_dir
from torshmon.settings import Layers, Section, SettingsError, setting

__all__ = ["ENV_PREFIX", "AgentSettings", "load_settings"]

#: The variables of settings that have none of their own: this and the name.
ENV_PREFIX = "TORSHMON_AGENT_"


def _hostname() -> str:
    return socket.gethostname()


def _spool_path(env: Mapping[str, str] | None = None) -> str:
    return str(runtime_dir(env) / "agent-spool.db")


class AgentSettings(Section, frozen=True):
    """Where the agent listens, stores and forwards.

    ``aggregator_url`` is the aggregator's base URL (None: spool only); batches
    go to ``<base>/api/v1/ingest``. The socket is 0600, or 0660 with group
    ``socket_group`` (a name or gid) for training users of another uid in it.
    """

    socket_path: Annotated[
        str,
        setting(
            "the probes' Unix socket",
            env="TORSHMON_AGENT_SOCKET",
            flag="--socket",
            default_text="<runtime dir>/agent.sock",
        ),
    ] = msgspec.field(default_factory=default_agent_socket)
    socket_group: Annotated[
        str | None,
        setting(
            "make the socket 0660 with this group (a name or gid), for training users of "
            "another uid",
            env="TORSHMON_AGENT_SOCKET_GROUP",
            flag="--socket-group",
            default_text="0600, the agent's user only",
        ),
    ] = None
    metrics_host: Annotated[str, setting("/metrics address", flag="--metrics-host")] = "127.0.0.1"
    metrics_port: Annotated[
        int, setting("/metrics port", flag="--metrics-port", ge=0, le=65535)
    ] = 9465
    aggregator_url: Annotated[
        str | None,
        setting(
            "the aggregator's base URL, e.g. http://host:9470 (may hold credentials)",
            env="TORSHMON_AGGREGATOR_URL",
            flag="--aggregator",
            secret=True,
            default_text="none: spool only",
        ),
    ] = None
    token: Annotated[
        str | None,
        setting(
            "bearer token sent to the aggregator",
            env="TORSHMON_TOKEN",
            flag="--token-file",
            secret=True,
            refuse_blank=True,
        ),
    ] = None
    node: Annotated[str, setting("node name", flag="--node", default_text="the hostname")] = (
        msgspec.field(default_factory=_hostname)
    )
    agent_id: Annotated[
        str,
        setting(
            "agent id",
            env="TORSHMON_AGENT_ID",
            flag="--agent-id",
            default_text="<node>-<spool id>",
        ),
    ] = ""
    spool_path: Annotated[
        str,
        setting(
            "spool file",
            env="TORSHMON_AGENT_SPOOL",
            flag="--spool",
            default_text="<runtime dir>/agent-spool.db",
        ),
    ] = msgspec.field(default_factory=_spool_path)
    spool_max_bytes: Annotated[
        int,
        setting("spool bound (the oldest records go past it)", flag="--spool-max-mb", ge=1 << 20),
    ] = 256 * 1024 * 1024
    sample_interval_s: Annotated[
        float, setting("node sampling interval", flag="--sample-interval-s", gt=0)
    ] = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.aggregator_url is not None:
            check_aggregator_url(self.aggregator_url, self.token)
        if self.token is not None and not self.token.strip():
            raise SettingsError("the token is empty; give a token or none")
        if self.socket_group is not None:
            self.socket_gid()  # a group that does not exist is an error now, not at start
        msgspec.structs.force_setattr(self, "spool_path", str(Path(self.spool_path)))

    def socket_gid(self) -> int | None:
        """The gid of ``socket_group`` (None without one); ValueError if there is none."""
        group = self.socket_group
        if group is None:
            return None
        if group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise SettingsError(f"socket_group {group!r} is no group on this host") from None


def load_settings(
    overrides: Mapping[str, Any],
    *,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AgentSettings:
    """Settings from ``overrides`` (flags; None means unset), then the environment, then
    the YAML ``config_file``, then the defaults. SettingsError names what is wrong."""
    env = os.environ if env is None else env
    layers = Layers(AgentSettings, env_prefix=ENV_PREFIX)
    # The defaults under the runtime folder follow the environment given, not os.environ.
    layers.set(("socket_path",), default_agent_socket(env))
    layers.set(("spool_path",), _spool_path(env))
    if config_file is not None:
        layers.read_yaml(config_file)
    layers.read_env(env)
    layers.update(overrides)
    return layers.build()
