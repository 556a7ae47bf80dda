"""The aggregator's settings: flags first, then ``TORSHMON_*`` variables, then a config file."""

from __future__ import annotations

import ipaddress
import os
import re
import reprlib
import socket
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Final, cast

from yaml.nodes import MappingNode, Node, ScalarNode

from torshmon import yamlfile
from torshmon.history.db import DB_URL_ENV, DEFAULT_DB_URL, DatabaseConfigError, normalize_url
from torshmon.history.reader import QUERY_DB_URL_ENV, reader_url

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9470

#: Environment variable per setting (the rest have no variable).
_ENV = {
    "host": "TORSHMON_AGGREGATOR_HOST",
    "port": "TORSHMON_AGGREGATOR_PORT",
    "token": "TORSHMON_TOKEN",
    "db_url": DB_URL_ENV,
    "query_db_url": QUERY_DB_URL_ENV,
    "rules_path": "TORSHMON_RULES",
    "aggregator_id": "TORSHMON_AGGREGATOR_ID",
    "otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "external_url": "TORSHMON_EXTERNAL_URL",
    "allowed_hosts": "TORSHMON_ALLOWED_HOSTS",
}

#: A host name or IP literal as it may appear in a Host header, without the port.
HOST_NAME = re.compile(r"\[[0-9a-fA-F:.]+\]|[^\[\]:@/?#\s]+")


#: Settings whose values are secrets (or hold one): never echoed in a message.
_SECRET: Final = frozenset({"token", "db_url", "query_db_url", "otlp_endpoint"})


class SettingsError(ValueError):
    """A setting with a bad value; the text names the setting and what is allowed."""


@dataclass(frozen=True, slots=True)
class AggregatorSettings:
    """Everything ``torshmon aggregator`` can be told. Durations in seconds."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    #: Secrets (a password in the URL, the token) are kept out of ``repr``.
    db_url: str = field(default="", repr=False)
    #: The URL history queries (POST /api/v1/query) connect with: on PostgreSQL a
    #: reader role's; by default ``db_url`` as the role torshmon_reader.
    query_db_url: str = field(default="", repr=False)
    token: str | None = field(default=None, repr=False)
    rules_path: str | None = None
    aggregator_id: str = ""
    eval_interval_s: float = 0.5
    #: Evaluate at once when an ingest brings a new finding, not only on the timer.
    eval_on_finding: bool = True
    #: The least time between an evaluation and one brought forward by a new finding.
    eval_min_gap_s: float = 0.05
    #: Store ingest in a process of its own (torshmon.aggregator.writer), not on the
    #: writer thread: SQL then runs beside detection and HTTP, on a core of its own.
    ingest_process: bool = True
    retention_interval_s: float = 300.0
    raw_retention_s: float = 86400.0
    rollup_retention_s: float = 30 * 86400.0
    max_body_bytes: int = 64 * 1024 * 1024
    hang_timeout_s: float = 5.0
    command_timeout_s: float = 60.0
    otlp_endpoint: str | None = field(default=None, repr=False)
    external_url: str = ""
    #: Host names the API answers to besides loopback names, IP literals, ``host`` and
    #: the host of ``external_url`` (the Host header of other names is refused: DNS
    #: rebinding). Lower case, without ports.
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise SettingsError("token is empty; give a token, or none to accept any request")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..65535, got {self.port}")
        for name in (
            "eval_interval_s",
            "eval_min_gap_s",
            "retention_interval_s",
            "raw_retention_s",
            "rollup_retention_s",
            "hang_timeout_s",
            "command_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise SettingsError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.db_url:
            object.__setattr__(self, "db_url", DEFAULT_DB_URL)
        try:
            query_db_url = self.query_db_url or reader_url(self.db_url)
            normalize_url(query_db_url)
        except DatabaseConfigError as exc:
            name = "query_db_url" if self.query_db_url else "db_url"
            raise SettingsError(f"{name}: {exc}") from None
        object.__setattr__(self, "query_db_url", query_db_url)
        if not self.aggregator_id:
            object.__setattr__(self, "aggregator_id", f"{socket.gethostname()}-{os.getpid()}")
        if not self.external_url:
            object.__setattr__(self, "external_url", f"http://{self.host}:{self.port}")
        for name in self.allowed_hosts:
            if not HOST_NAME.fullmatch(name):
                raise SettingsError(
                    f"allowed_hosts entries are host names without a port, got {name!r}"
                )
        object.__setattr__(self, "allowed_hosts", tuple(h.lower() for h in self.allowed_hosts))
        if not self.token and not is_loopback(self.host):
            raise SettingsError(
                f"host {self.host!r} is not a loopback address and no token is set, so anyone "
                "who reaches it could drive the API: set one with --token-file or TORSHMON_TOKEN "
                "(or listen on 127.0.0.1)"
            )


def is_loopback(host: str) -> bool:
    """Whether the listen address ``host`` is loopback only ("" and 0.0.0.0 are not)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_settings(
    overrides: Mapping[str, Any],
    *,
    config_file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AggregatorSettings:
    """Settings from ``overrides`` (None means unset), then the environment, then the
    YAML ``config_file`` (a mapping of setting names), then the defaults.

    Raises SettingsError naming an unknown key, a bad value, or an unreadable file.
    """
    env = os.environ if env is None else env
    known = {f.name: f for f in fields(AggregatorSettings)}
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_config(Path(config_file), known))
    for name, var in _ENV.items():
        if env.get(var):
            values[name] = env[var]
    if _blank(env, _ENV["token"]):
        # Most likely a substitution that failed; read as unset, the API would be open.
        raise SettingsError(f"{_ENV['token']} is set but empty; unset it to run without a token")
    values.update({k: v for k, v in overrides.items() if v is not None})
    typed: dict[str, Any] = {}
    for name, value in values.items():
        known_field = known.get(name)
        if known_field is None:
            raise SettingsError(f"unknown setting {name!r}; known: {', '.join(sorted(known))}")
        typed[name] = _coerce(name, str(known_field.type), value)
    return AggregatorSettings(**typed)


def _read_config(path: Path, known: Mapping[str, object]) -> dict[str, Any]:
    """The settings in a config file; SettingsError as ``file:line: reason``."""
    try:
        root = yamlfile.compose(yamlfile.read_text(path, what="config file"), str(path))
    except yamlfile.YamlFileError as exc:
        raise SettingsError(str(exc)) from None
    if root is None:
        return {}
    if not isinstance(root, MappingNode):
        raise SettingsError(f"{path}:{_line(root)}: expected a mapping of settings")
    values: dict[str, Any] = {}
    for key_node, value_node in root.value:
        key = key_node.value if isinstance(key_node, ScalarNode) else None
        if not isinstance(key, str) or key not in known:
            raise SettingsError(
                f"{path}:{_line(key_node)}: unknown setting {_describe(key_node)}; "
                f"known: {', '.join(sorted(known))}"
            )
        setting = cast(Field[Any], known[key])
        try:
            values[key] = _coerce(key, str(setting.type), yamlfile.construct(value_node))
        except SettingsError as exc:
            raise SettingsError(f"{path}:{_line(value_node)}: {exc}") from None
    return values


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _describe(node: Node) -> str:
    if isinstance(node, ScalarNode):
        return repr(node.value[:64])
    return "(a list or mapping)"


def _coerce(name: str, type_name: str, value: Any) -> Any:
    if type_name == "bool":
        return _boolean(name, value)
    if type_name == "tuple[str, ...]":
        return _strings(name, value)
    try:
        if type_name == "int":
            return int(value)
        if type_name == "float":
            return float(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{name} must be a {type_name}, got {_shown(name, value)}") from None
    if type_name in ("str", "str | None") and not isinstance(value, str):
        raise SettingsError(f"{name} must be a string, got {_shown(name, value)}")
    return value


def _shown(name: str, value: Any) -> str:
    """``value`` as an error message may show it: secrets by their type only."""
    if name in _SECRET:
        return f"a value of type {type(value).__name__} (not shown)"
    return reprlib.repr(value)


def _blank(env: Mapping[str, str], var: str) -> bool:
    """Whether ``var`` is set, to nothing but whitespace."""
    return var in env and not env[var].strip()


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be true or false, got {value!r}")


def _strings(name: str, value: Any) -> tuple[str, ...]:
    """A list, or a comma-separated string (an environment variable), of strings."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SettingsError(f"{name} must be a list of strings, got {value!r}")
