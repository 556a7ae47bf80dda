"""The aggregator's settings: flags first, then ``TORSHMON_*`` variables, then a config file.

One model (``AggregatorSettings``) holds the service's own settings and, as sections,
the detectors' (``straggler:``, ``zscore:``, ``hang:``, ``link_check:``), the
notifier's (``notify:``, its targets included), the autotuner's (``tuner:``) and the
evidence kept on alert (``evidence:``). ``load_settings`` reads it; the
reading and checking is ``torshmon.settings``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import msgspec

from torshmon.aggregator.core.hang import HangSettings
from torshmon.aggregator.core.linkcheck import LinkCheckSettings
from torshmon.aggregator.core.straggler import StragglerSettings
from torshmon.aggregator.core.tuner import TunerSettings
from torshmon.aggregator.core.zscore import ZScoreSettings
from torshmon.aggregator.evidence import EvidenceSettings
from torshmon.aggregator.notify.targets import (
    AlertmanagerTarget,
    SlackTarget,
    Target,
    WebhookTarget,
    targets_from_env,
)
from torshmon.history.db import (
    DB_URL_ENV,
    DEFAULT_DB_URL,
    DatabaseConfigError,
    as_db_url,
    normalize_url,
    sqlite_path,
)
from torshmon.history.reader import QUERY_DB_URL_ENV, reader_url
from torshmon.settings import Layers, Section, SettingsError, setting

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "AggregatorSettings",
    "NotifySettings",
    "SettingsError",
    "is_loopback",
    "load_settings",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9470
#: The variables of settings that have none of their own: this and the path.
ENV_PREFIX = "TORSHMON_AGGREGATOR_"

#: A host name or IP literal as it may appear in a Host header, without the port.
HOST_NAME = re.compile(r"\[[0-9a-fA-F:.]+\]|[^\[\]:@/?#\s]+")

_TARGET_HELP = (
    "(the URL and token are secrets: never logged); the variable is a comma-separated list"
)


class NotifySettings(Section, frozen=True):
    """Where alerts go and how hard delivery tries."""

    slack: Annotated[
        tuple[SlackTarget, ...],
        setting(
            f"Slack incoming webhooks: items of url, name {_TARGET_HELP}",
            env="TORSHMON_SLACK_WEBHOOK_URL",
            secret=True,
        ),
    ] = ()
    webhooks: Annotated[
        tuple[WebhookTarget, ...],
        setting(
            "webhooks taking Alertmanager's payload: items of url, name, bearer_token "
            f"{_TARGET_HELP}; TORSHMON_WEBHOOK_TOKEN holds one token or one per URL",
            env="TORSHMON_WEBHOOK_URL",
            secret=True,
        ),
    ] = ()
    alertmanagers: Annotated[
        tuple[AlertmanagerTarget, ...],
        setting(
            f"Alertmanagers (v2 API): items of base_url, name, resend_interval_s {_TARGET_HELP}",
            env="TORSHMON_ALERTMANAGER_URL",
            secret=True,
        ),
    ] = ()
    group_wait_s: Annotated[
        float, setting("wait after an alert for others to send with it", ge=0)
    ] = 0.2
    max_queue: Annotated[int, setting("alerts queued per target (the oldest dropped)", ge=1)] = (
        10000
    )
    retry_initial_s: Annotated[float, setting("first wait between attempts", gt=0)] = 0.5
    retry_max_s: Annotated[float, setting("longest wait between attempts", gt=0)] = 30.0
    max_attempts: Annotated[int, setting("attempts per message", ge=1)] = 8
    timeout_s: Annotated[float, setting("limit of one attempt", gt=0)] = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [t.name for t in self.targets()]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise SettingsError(f"target names must be unique; repeated: {', '.join(duplicates)}")

    def targets(self) -> list[Target]:
        """Every target, Slack first."""
        return [*self.slack, *self.webhooks, *self.alertmanagers]

    def delivery(self) -> dict[str, Any]:
        """The Notifier's keyword arguments besides targets."""
        names = ("group_wait_s", "max_queue", "retry_initial_s", "retry_max_s")
        return {name: getattr(self, name) for name in (*names, "max_attempts", "timeout_s")}


class AggregatorSettings(Section, frozen=True):
    """Everything ``torshmon aggregator`` can be told. Durations in seconds."""

    host: Annotated[
        str, setting("listen address", env="TORSHMON_AGGREGATOR_HOST", flag="--host")
    ] = DEFAULT_HOST
    port: Annotated[
        int,
        setting("listen port", env="TORSHMON_AGGREGATOR_PORT", flag="--port", ge=0, le=65535),
    ] = DEFAULT_PORT
    db_url: Annotated[
        str,
        setting(
            "history database: a SQLAlchemy URL or a SQLite file path",
            env=DB_URL_ENV,
            flag="--db",
            secret=True,
            default_text=DEFAULT_DB_URL,
        ),
    ] = ""
    query_db_url: Annotated[
        str,
        setting(
            "the URL history queries (POST /api/v1/query) connect with: on PostgreSQL a "
            "reader role's",
            env=QUERY_DB_URL_ENV,
            flag="--query-db",
            secret=True,
            default_text="db_url as the role torshmon_reader",
        ),
    ] = ""
    token: Annotated[
        str | None,
        setting(
            "bearer token the API and ingest require (needed unless host is loopback)",
            env="TORSHMON_TOKEN",
            flag="--token-file",
            secret=True,
            refuse_blank=True,
        ),
    ] = None
    rules_path: Annotated[
        str | None,
        setting(
            "alert rule file",
            env="TORSHMON_RULES",
            flag="--rules",
            default_text="the default rules",
        ),
    ] = None
    aggregator_id: Annotated[
        str,
        setting(
            "this aggregator's id: the shard that owns the jobs it ingests",
            env="TORSHMON_AGGREGATOR_ID",
            flag="--id",
            default_text="<hostname>-<pid>",
        ),
    ] = ""
    eval_interval_s: Annotated[float, setting("time between rule evaluations", gt=0)] = 0.5
    eval_on_finding: Annotated[
        bool, setting("evaluate at once when an ingest brings a new finding")
    ] = True
    eval_min_gap_s: Annotated[
        float, setting("least time between an evaluation and one a finding brings forward", gt=0)
    ] = 0.05
    ingest_process: Annotated[
        bool,
        setting(
            "store ingest in a process of its own (SQL beside detection and HTTP), not on "
            "the writer thread"
        ),
    ] = True
    collective_metrics_per_rank: Annotated[
        bool,
        setting(
            "export the collective-duration histogram and byte counter per rank (a rank "
            "label; series grow with the world size) rather than summed over each job's ranks"
        ),
    ] = False
    retention_interval_s: Annotated[float, setting("time between retention runs", gt=0)] = 300.0
    raw_retention_s: Annotated[float, setting("how long raw rows are kept", gt=0)] = 86400.0
    rollup_retention_s: Annotated[float, setting("how long per-minute rollups are kept", gt=0)] = (
        30 * 86400.0
    )
    max_body_bytes: Annotated[int, setting("largest request body", ge=1024)] = 64 * 1024 * 1024
    http_max_connections: Annotated[
        int,
        setting(
            "open HTTP connections at most (keep it under the open-file limit); one more "
            "is answered 503 and closed",
            ge=1,
        ),
    ] = 512
    http_header_timeout_s: Annotated[
        float,
        setting(
            "time a client has to send a request's head, from the connection's opening or "
            "the request's first byte; then a 408 and the socket closed",
            gt=0,
        ),
    ] = 10.0
    http_body_timeout_s: Annotated[
        float,
        setting("time a request's body may take once its head is in; then a 408", gt=0),
    ] = 60.0
    http_idle_timeout_s: Annotated[
        float, setting("time a kept-alive connection may wait idle for its next request", gt=0)
    ] = 75.0
    query_timeout_s: Annotated[
        float, setting("statement timeout of a history query (POST /api/v1/query)", gt=0)
    ] = 30.0
    query_max_running: Annotated[
        int,
        setting(
            "history queries (POST /api/v1/query) run at once, on threads of their own; "
            "one more is refused with 429",
            ge=1,
        ),
    ] = 4
    query_max_per_client: Annotated[
        int,
        setting(
            "history queries one client (peer address) may run at once, at most "
            "query_max_running; one more is refused with 429",
            ge=1,
        ),
    ] = 2
    command_timeout_s: Annotated[float, setting("time a command may take to be applied", gt=0)] = (
        60.0
    )
    otlp_endpoint: Annotated[
        str | None,
        setting(
            "OTLP/HTTP endpoint for the aggregator's spans",
            env="OTEL_EXPORTER_OTLP_ENDPOINT",
            secret=True,
            default_text="no spans",
        ),
    ] = None
    external_url: Annotated[
        str,
        setting(
            "the aggregator's URL as others reach it (in notifications)",
            env="TORSHMON_EXTERNAL_URL",
            default_text="http://<host>:<port>",
        ),
    ] = ""
    allowed_hosts: Annotated[
        tuple[str, ...],
        setting(
            "Host names the API answers to besides loopback names, IP literals, host and "
            "the host of external_url (DNS rebinding); no ports. The variable is "
            "comma-separated",
            env="TORSHMON_ALLOWED_HOSTS",
            flag="--allowed-host",
        ),
    ] = ()
    straggler: StragglerSettings = msgspec.field(default_factory=StragglerSettings)
    zscore: ZScoreSettings = msgspec.field(default_factory=ZScoreSettings)
    hang: HangSettings = msgspec.field(default_factory=HangSettings)
    link_check: LinkCheckSettings = msgspec.field(default_factory=LinkCheckSettings)
    notify: NotifySettings = msgspec.field(default_factory=NotifySettings)
    tuner: TunerSettings = msgspec.field(default_factory=TunerSettings)
    evidence: EvidenceSettings = msgspec.field(default_factory=EvidenceSettings)

    #: Settings of earlier versions, refused with their new place named.
    renamed: ClassVar[Mapping[str, str]] = {
        "hang_timeout_s": "hang.timeout_s",
        "evidence_dir": "evidence.dir",
        "evidence_capture_max_bytes": "evidence.capture_max_bytes",
        "evidence_max_bytes": "evidence.max_bytes",
        "evidence_retention_s": "evidence.retention_s",
        "evidence_min_interval_s": "evidence.min_interval_s",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token is not None and not self.token.strip():
            raise SettingsError("token is empty; give a token, or none to accept any request")
        # A file path as well as a URL, and SQLite files absolute (as_db_url).
        msgspec.structs.force_setattr(self, "db_url", as_db_url(self.db_url or DEFAULT_DB_URL))
        try:
            query_db_url = (
                as_db_url(self.query_db_url) if self.query_db_url else reader_url(self.db_url)
            )
            normalize_url(query_db_url)
        except DatabaseConfigError as exc:
            name = "query_db_url" if self.query_db_url else "db_url"
            raise SettingsError(f"{name}: {exc}") from None
        msgspec.structs.force_setattr(self, "query_db_url", query_db_url)
        if not self.evidence.dir:
            evidence = msgspec.structs.replace(self.evidence, dir=default_evidence_dir(self.db_url))
            msgspec.structs.force_setattr(self, "evidence", evidence)
        if not self.aggregator_id:
            aggregator_id = f"{socket.gethostname()}-{os.getpid()}"
            msgspec.structs.force_setattr(self, "aggregator_id", aggregator_id)
        if not self.external_url:
            msgspec.structs.force_setattr(self, "external_url", f"http://{self.host}:{self.port}")
        for name in self.allowed_hosts:
            if not HOST_NAME.fullmatch(name):
                raise SettingsError(
                    f"allowed_hosts entries are host names without a port, got {name!r}"
                )
        allowed = tuple(h.lower() for h in self.allowed_hosts)
        msgspec.structs.force_setattr(self, "allowed_hosts", allowed)
        if not self.token and not is_loopback(self.host):
            raise SettingsError(
                f"host {self.host!r} is not a loopback address and no token is set, so anyone "
                "who reaches it could drive the API: set one with --token-file or TORSHMON_TOKEN "
                "(or listen on 127.0.0.1)"
            )


def default_evidence_dir(db_url: str) -> str:
    """Beside a SQLite history file (``<file>.evidence``), else under the user's state
    folder (``$XDG_STATE_HOME``, by default ``~/.local/state``)."""
    path = sqlite_path(db_url)
    if path is not None:
        return str(path.with_name(path.name + ".evidence"))
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "torshmon", "evidence")


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
    """Settings from ``overrides`` (None means unset; a mapping for a section), then the
    environment, then the YAML ``config_file``, then the defaults.

    Raises SettingsError naming an unknown key, a bad value, or an unreadable file; a
    secret's value (token, URLs, webhooks) is never in its text.
    """
    env = os.environ if env is None else env
    layers = Layers(AggregatorSettings, env_prefix=ENV_PREFIX)
    if config_file is not None:
        layers.read_yaml(config_file)
    layers.read_env(env)
    try:
        targets = targets_from_env(env)  # its messages never quote a URL or token
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    for kind, cls, var in (
        ("slack", SlackTarget, "TORSHMON_SLACK_WEBHOOK_URL"),
        ("webhooks", WebhookTarget, "TORSHMON_WEBHOOK_URL"),
        ("alertmanagers", AlertmanagerTarget, "TORSHMON_ALERTMANAGER_URL"),
    ):
        if env.get(var, "").strip():
            layers.set(("notify", kind), [t for t in targets if isinstance(t, cls)], var)
    layers.update(overrides)
    return layers.build()
