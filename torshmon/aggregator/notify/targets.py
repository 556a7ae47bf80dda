"""Where alerts go: Slack, generic webhook and Alertmanager targets, checked when built.

Webhook URLs and tokens are secrets (a Slack webhook URL is a credential): a target is
named by its ``name`` in logs and errors, never by its URL or token.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from yarl import URL

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass(frozen=True, slots=True)
class SlackTarget:
    """A Slack incoming webhook; the URL is a secret and is left out of ``repr``."""

    url: str = field(repr=False)
    name: str = "slack"

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_url(f"target {self.name!r} url", self.url)


@dataclass(frozen=True, slots=True)
class WebhookTarget:
    """A generic webhook that receives Alertmanager's webhook payload (version 4)."""

    url: str = field(repr=False)
    name: str = "webhook"
    bearer_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_url(f"target {self.name!r} url", self.url)
        if self.bearer_token is not None and not _is_token(self.bearer_token):
            raise ValueError(
                f"target {self.name!r} bearer token must be non-empty printable ASCII "
                "without spaces"
            )


@dataclass(frozen=True, slots=True)
class AlertmanagerTarget:
    """An Alertmanager, fed through POST ``{base_url}/api/v2/alerts``.

    Alertmanager resolves an alert nobody re-sends, so firing alerts are re-posted every
    ``resend_interval_s`` with ``endsAt`` four intervals ahead, as Prometheus does.
    """

    base_url: str = field(repr=False)
    name: str = "alertmanager"
    resend_interval_s: float = 60.0

    def __post_init__(self) -> None:
        _check_name(self.name)
        _check_url(f"target {self.name!r} base url", self.base_url)
        if not (self.resend_interval_s > 0 and math.isfinite(self.resend_interval_s)):
            raise ValueError(
                f"target {self.name!r} resend_interval_s must be a positive number of "
                f"seconds, got {self.resend_interval_s}"
            )

    @property
    def alerts_url(self) -> str:
        return self.base_url.rstrip("/") + "/api/v2/alerts"


Target = SlackTarget | WebhookTarget | AlertmanagerTarget


def targets_from_env(env: Mapping[str, str] | None = None) -> list[Target]:
    """Targets named by ``TORSHMON_SLACK_WEBHOOK_URL``, ``TORSHMON_WEBHOOK_URL`` (with
    ``TORSHMON_WEBHOOK_TOKEN``) and ``TORSHMON_ALERTMANAGER_URL``; each may be a
    comma-separated list. ``TORSHMON_WEBHOOK_TOKEN`` is one token for every webhook or
    one per webhook URL, in order. Targets are named ``slack``, ``slack-2``, ...

    ``env`` defaults to ``os.environ``. Raises ValueError naming the variable and item;
    never echoes the URL or token.
    """
    env = os.environ if env is None else env
    slack = _env_list(env, "TORSHMON_SLACK_WEBHOOK_URL")
    hooks = _env_list(env, "TORSHMON_WEBHOOK_URL")
    tokens = _env_list(env, "TORSHMON_WEBHOOK_TOKEN")
    managers = _env_list(env, "TORSHMON_ALERTMANAGER_URL")
    if tokens and not hooks:
        raise ValueError("TORSHMON_WEBHOOK_TOKEN is set but TORSHMON_WEBHOOK_URL is not")
    if len(tokens) not in (0, 1, len(hooks)):
        raise ValueError(
            f"TORSHMON_WEBHOOK_TOKEN has {len(tokens)} tokens for {len(hooks)} webhook URLs; "
            "give one token for all of them or one per URL"
        )
    targets: list[Target] = []
    for index, url in enumerate(slack):
        _check_url(_env_item("TORSHMON_SLACK_WEBHOOK_URL", index, slack), url)
        targets.append(SlackTarget(url, name=_nth("slack", index)))
    for index, url in enumerate(hooks):
        _check_url(_env_item("TORSHMON_WEBHOOK_URL", index, hooks), url)
        token = tokens[index if len(tokens) > 1 else 0] if tokens else None
        if token is not None and not _is_token(token):
            raise ValueError(
                f"{_env_item('TORSHMON_WEBHOOK_TOKEN', index, tokens)} must be printable "
                "ASCII without spaces"
            )
        targets.append(WebhookTarget(url, name=_nth("webhook", index), bearer_token=token))
    for index, url in enumerate(managers):
        _check_url(_env_item("TORSHMON_ALERTMANAGER_URL", index, managers), url)
        targets.append(AlertmanagerTarget(url, name=_nth("alertmanager", index)))
    return targets


def _env_list(env: Mapping[str, str], key: str) -> list[str]:
    return [item.strip() for item in env.get(key, "").split(",") if item.strip()]


def _env_item(key: str, index: int, items: Sequence[str]) -> str:
    return key if len(items) == 1 else f"{key} item {index + 1}"


def _nth(base: str, index: int) -> str:
    return base if index == 0 else f"{base}-{index + 1}"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(
            f"target name {name!r} must be 1-64 characters of letters, digits, '_', '.', "
            "':' or '-' (it becomes a metric label)"
        )


def _is_token(token: str) -> bool:
    return bool(token) and all(33 <= ord(c) <= 126 for c in token)


def _check_url(what: str, url: str) -> None:
    """ValueError unless ``url`` is http(s) with a host; the message never echoes it."""
    try:
        parsed = URL(url)
        host = parsed.host
    except (ValueError, TypeError):
        # ``from None``: the parser's own message may quote the URL.
        raise ValueError(f"{what} is not a valid URL") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{what} must start with http:// or https://")
    if not host:
        raise ValueError(f"{what} has no host")


__all__ = ["AlertmanagerTarget", "SlackTarget", "Target", "WebhookTarget", "targets_from_env"]
