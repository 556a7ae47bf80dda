"""Alertmanager's JSON shapes: the webhook payload and the v2 ``/api/v2/alerts`` body.

Also the grouping by (alertname, job) that every JSON target shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Final

import msgspec

from torshmon.aggregator.core.alert import Alert

#: Go's zero time, which Alertmanager writes as ``endsAt`` of an alert not yet ended.
ZERO_TIME: Final = "0001-01-01T00:00:00Z"
#: Alerts per message for the JSON targets; Slack summarises beyond its own limit.
MAX_ALERTS_PER_MESSAGE: Final = 500


def rfc3339(unix_s: float | None) -> str:
    """Unix seconds as RFC 3339 in UTC (Go's RFC3339Nano style); None is Go's zero time."""
    if unix_s is None:
        return ZERO_TIME
    text = datetime.fromtimestamp(unix_s, tz=timezone.utc).isoformat(timespec="microseconds")
    whole, fraction = text.removesuffix("+00:00").split(".")
    fraction = fraction.rstrip("0")
    return f"{whole}.{fraction}Z" if fraction else f"{whole}Z"


def group_key(alertname: str, job: str) -> str:
    """The group's identity, written as Alertmanager writes its group keys."""
    labels = msgspec.json.encode(alertname).decode(), msgspec.json.encode(job).decode()
    return f"{{}}:{{alertname={labels[0]}, job={labels[1]}}}"


def group_alerts(alerts: Sequence[Alert]) -> list[tuple[str, list[Alert]]]:
    """Alerts as messages: grouped by (alertname, job) in arrival order.

    A fingerprint that comes back in a group (firing, then resolved) starts a new
    message, so every message holds one state per alert and states arrive in order.
    Groups over MAX_ALERTS_PER_MESSAGE are split too.
    """
    return [(key, [alerts[i] for i in indices]) for key, indices in group_indices(alerts)]


def group_indices(alerts: Sequence[Alert]) -> list[tuple[str, list[int]]]:
    """``group_alerts`` as positions in ``alerts``."""
    open_groups: dict[tuple[str, str], tuple[list[int], set[str]]] = {}
    messages: list[tuple[str, list[int]]] = []
    for index, alert in enumerate(alerts):
        grouping = (alert.labels.get("alertname") or alert.rule, alert.job)
        current = open_groups.get(grouping)
        if (
            current is None
            or alert.fingerprint in current[1]
            or len(current[0]) >= MAX_ALERTS_PER_MESSAGE
        ):
            current = open_groups[grouping] = ([], set())
            messages.append((group_key(*grouping), current[0]))
        current[0].append(index)
        current[1].add(alert.fingerprint)
    return messages


def alertmanager_webhook_payload(
    alerts: Sequence[Alert],
    *,
    receiver: str,
    group_key: str,
    external_url: str,
    generator_url: str | None = None,
) -> dict[str, Any]:
    """Alertmanager's webhook body (version "4") for one group of alerts.

    ``generatorURL`` of each alert is ``generator_url``, by default ``external_url``.
    Raises ValueError for an empty group, a pending alert, or a resolved one without
    ``ends_at_unix_s``.
    """
    if not alerts:
        raise ValueError("alertmanager_webhook_payload needs at least one alert, got none")
    for alert in alerts:
        _check_sendable(alert)
    common_labels = _common(a.labels for a in alerts)
    return {
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
        "status": "firing" if any(a.state == "firing" for a in alerts) else "resolved",
        "receiver": receiver,
        "groupLabels": {k: v for k, v in common_labels.items() if k in ("alertname", "job")},
        "commonLabels": common_labels,
        "commonAnnotations": _common(a.annotations for a in alerts),
        "externalURL": external_url,
        "alerts": [
            {
                "status": alert.state,
                "labels": dict(alert.labels),
                "annotations": dict(alert.annotations),
                "startsAt": rfc3339(alert.starts_at_unix_s),
                "endsAt": rfc3339(alert.ends_at_unix_s if alert.state == "resolved" else None),
                "generatorURL": external_url if generator_url is None else generator_url,
                "fingerprint": alert.fingerprint,
            }
            for alert in alerts
        ],
    }


def alertmanager_v2_alerts(
    alerts: Sequence[Alert], *, generator_url: str, firing_ends_at_unix_s: float | None = None
) -> list[dict[str, Any]]:
    """The body of POST /api/v2/alerts.

    A resolved alert carries its resolve time as ``endsAt``. A firing one carries
    ``firing_ends_at_unix_s`` when given (a time after the next re-send, so Alertmanager
    resolves it if the sender dies) and no ``endsAt`` otherwise, which Alertmanager reads
    as "resolve after resolve_timeout unless re-sent". Raises ValueError as
    ``alertmanager_webhook_payload`` does.
    """
    body: list[dict[str, Any]] = []
    for alert in alerts:
        _check_sendable(alert)
        entry: dict[str, Any] = {
            "labels": dict(alert.labels),
            "annotations": dict(alert.annotations),
            "startsAt": rfc3339(alert.starts_at_unix_s),
        }
        ends_at = alert.ends_at_unix_s if alert.state == "resolved" else firing_ends_at_unix_s
        if ends_at is not None:
            entry["endsAt"] = rfc3339(ends_at)
        if generator_url:
            # Alertmanager validates it as a URI: an empty string is left out, not sent.
            entry["generatorURL"] = generator_url
        body.append(entry)
    return body


def _check_sendable(alert: Alert) -> None:
    if alert.state not in ("firing", "resolved"):
        raise ValueError(
            f"alert {alert.fingerprint} is {alert.state!r}; only 'firing' or 'resolved' "
            "alerts are notified"
        )
    if alert.state == "resolved" and alert.ends_at_unix_s is None:
        raise ValueError(f"resolved alert {alert.fingerprint} has no ends_at_unix_s")


def _common(mappings: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """The key/value pairs every mapping has."""
    iterator = iter(mappings)
    common = dict(next(iterator, {}))
    for mapping in iterator:
        common = {k: v for k, v in common.items() if mapping.get(k) == v}
    return common


__all__ = [
    "MAX_ALERTS_PER_MESSAGE",
    "ZERO_TIME",
    "alertmanager_v2_alerts",
    "alertmanager_webhook_payload",
    "group_alerts",
    "group_indices",
    "group_key",
    "rfc3339",
]
