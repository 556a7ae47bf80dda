"""Slack incoming-webhook messages for alert groups (Block Kit plus a plain-text fallback).

Pure: alerts in, the JSON body of one message out. Slack shows ``blocks`` in the
channel and ``text`` in notifications (and to clients without Block Kit), so both
name the same facts: job, rank, metric, value, severity, state and recommendation.
Block Kit limits (https://api.slack.com/reference/block-kit/blocks) are respected by
truncating with an ellipsis and summarising large groups as "... and N more".
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import quote

from torshmon.aggregator.core.alert import Alert

#: Block Kit limits that a message from here could reach.
MAX_BLOCKS: Final = 50
MAX_HEADER_CHARS: Final = 150
MAX_SECTION_CHARS: Final = 3000
MAX_FIELD_CHARS: Final = 2000
MAX_FIELDS: Final = 10
MAX_CONTEXT_ELEMENTS: Final = 10
#: Alerts drawn in full; the rest of a group is summarised. Each takes at most four
#: blocks (divider, section, recommendation, context): 1 + 4 * 10 + 2 stays under 50.
MAX_ALERTS_SHOWN: Final = 10
#: The fallback ``text``: each line bounded, so "... and N more" always survives.
MAX_TEXT_LINE_CHARS: Final = 400
MAX_TEXT_CHARS: Final = MAX_TEXT_LINE_CHARS * (MAX_ALERTS_SHOWN + 2)

_ELLIPSIS: Final = "…"
_PARTIAL_ENTITY = re.compile(r"&[a-z]{0,4}$")
_STATE_STYLE: Final = {
    "firing": (":rotating_light:", "FIRING"),
    "resolved": (":white_check_mark:", "RESOLVED"),
}
_SEVERITY_EMOJI: Final = {
    "critical": ":red_circle:",
    "high": ":large_orange_circle:",
    "warning": ":large_yellow_circle:",
    "medium": ":large_blue_circle:",
    "info": ":white_circle:",
}


def slack_payload(
    alerts: Sequence[Alert], *, group_key: str, external_url: str = ""
) -> dict[str, Any]:
    """The incoming-webhook body announcing one group of alerts (same alertname and job).

    The group is "firing" while any of its alerts fires. A firing alert with the
    ``capture_evidence`` action links to its job's evidence under ``external_url`` (the
    aggregator's URL). Raises ValueError for an empty group or a ``pending`` alert
    (pending alerts are never notified).
    """
    if not alerts:
        raise ValueError("slack_payload needs at least one alert, got none")
    for alert in alerts:
        _check_notifiable(alert)
    status = "firing" if any(a.state == "firing" for a in alerts) else "resolved"
    shown, hidden = alerts[:MAX_ALERTS_SHOWN], len(alerts) - MAX_ALERTS_SHOWN
    blocks: list[dict[str, Any]] = [_header(alerts, status)]
    for index, alert in enumerate(shown):
        if index:
            blocks.append({"type": "divider"})
        blocks.extend(_alert_blocks(alert, external_url))
    if hidden > 0:
        blocks.append(_section(f"_… and {hidden} more alerts in this group_"))
    blocks.append(
        {
            "type": "context",
            "elements": [_mrkdwn(f"torshmon · group `{_escape(group_key)}`", MAX_FIELD_CHARS)],
        }
    )
    return {"text": _fallback_text(alerts, status), "blocks": blocks}


def _check_notifiable(alert: Alert) -> None:
    if alert.state not in _STATE_STYLE:
        raise ValueError(
            f"alert {alert.fingerprint} is {alert.state!r}; only 'firing' or 'resolved' "
            "alerts are notified"
        )


def _header(alerts: Sequence[Alert], status: str) -> dict[str, Any]:
    emoji, word = _STATE_STYLE[status]
    first = alerts[0]
    title = f"{emoji} {word}: {_alertname(first)}"
    if first.job:
        title += f" · job {first.job}"
    if len(alerts) > 1:
        title += f" ({len(alerts)} alerts)"
    return {
        "type": "header",
        "text": {"type": "plain_text", "text": _truncate(title, MAX_HEADER_CHARS), "emoji": True},
    }


def evidence_url(alert: Alert, external_url: str) -> str | None:
    """Where the evidence an alert asks for will be listed, or None if it asks for none."""
    if alert.state != "firing" or "capture_evidence" not in alert.actions or not external_url:
        return None
    return f"{external_url.rstrip('/')}/api/v1/evidence?job={quote(alert.job, safe='')}"


def _alert_blocks(alert: Alert, external_url: str = "") -> list[dict[str, Any]]:
    emoji, word = _STATE_STYLE[alert.state]
    summary = alert.annotations.get("summary") or _alertname(alert)
    text = f"{emoji} *{_escape(summary)}*"
    description = alert.annotations.get("description", "")
    if description:
        text += "\n" + _escape(description)
    severity = alert.severity or alert.labels.get("severity", "")
    facts = (
        ("Job", f"`{_escape(alert.job)}`" if alert.job else "—"),
        ("Rank", f"`{_escape(alert.rank)}`" if alert.rank is not None else "all ranks"),
        ("Metric", f"`{_escape(alert.labels['metric'])}`" if alert.labels.get("metric") else "—"),
        ("Value", f"`{format_value(alert.value)}`"),
        ("Severity", f"{_SEVERITY_EMOJI.get(severity, '')} {_escape(severity)}".strip()),
        ("State", f"{emoji} {word.lower()}"),
    )
    fields = [_mrkdwn(f"*{name}*\n{value}", MAX_FIELD_CHARS) for name, value in facts]
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": _mrkdwn(text, MAX_SECTION_CHARS), "fields": fields[:MAX_FIELDS]}
    ]
    recommendation = alert.annotations.get("recommendation", "")
    if recommendation:
        blocks.append(_section(f"*Recommendation*\n{_escape(recommendation)}"))
    context = _times(alert)
    url = evidence_url(alert, external_url)
    if url is not None:
        # In the context block: an alert keeps to four blocks (see MAX_ALERTS_SHOWN).
        text = f"Evidence (Flight Recorder dumps, profiler traces): <{_escape(url)}|captures>"
        context.append(_mrkdwn(text, MAX_FIELD_CHARS))
    blocks.append({"type": "context", "elements": context[:MAX_CONTEXT_ELEMENTS]})
    return blocks


def _times(alert: Alert) -> list[dict[str, str]]:
    elements = [_mrkdwn(f"Started {_slack_date(alert.starts_at_unix_s)}", MAX_FIELD_CHARS)]
    if alert.state == "resolved" and alert.ends_at_unix_s is not None:
        lasted = human_duration(alert.ends_at_unix_s - alert.starts_at_unix_s)
        elements.append(
            _mrkdwn(f"Resolved {_slack_date(alert.ends_at_unix_s)} (lasted {lasted})", 2000)
        )
    elements.append(_mrkdwn(f"fingerprint `{_escape(alert.fingerprint)}`", MAX_FIELD_CHARS))
    return elements


def _fallback_text(alerts: Sequence[Alert], status: str) -> str:
    emoji, word = _STATE_STYLE[status]
    first = alerts[0]
    head = f"{emoji} {word}: {_escape(_alertname(first))} (job {_escape(first.job or '—')})"
    lines = [_truncate(head, MAX_TEXT_LINE_CHARS)]
    for alert in alerts[:MAX_ALERTS_SHOWN]:
        line = (
            f"• [{alert.state}, {_escape(alert.severity)}] job={_escape(alert.job or '—')}"
            f" rank={_escape(alert.rank if alert.rank is not None else 'all')}"
            f" metric={_escape(alert.labels.get('metric') or '—')}"
            f" value={format_value(alert.value)}"
        )
        summary = alert.annotations.get("summary", "")
        if summary:
            line += f": {_escape(summary)}"
        recommendation = alert.annotations.get("recommendation", "")
        if recommendation:
            line += f" Recommendation: {_escape(recommendation)}"
        lines.append(_truncate(line, MAX_TEXT_LINE_CHARS))
    if len(alerts) > MAX_ALERTS_SHOWN:
        lines.append(f"… and {len(alerts) - MAX_ALERTS_SHOWN} more")
    return _truncate("\n".join(lines), MAX_TEXT_CHARS)


def _alertname(alert: Alert) -> str:
    """The rule's own name ("Step Time Anomaly"), a title for people; the
    ``alertname`` label is its CamelCase form for Alertmanager."""
    return alert.rule or alert.labels.get("alertname", "")


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": _mrkdwn(text, MAX_SECTION_CHARS)}


def _mrkdwn(text: str, limit: int) -> dict[str, str]:
    return {"type": "mrkdwn", "text": _truncate(text, limit)}


def _escape(text: str) -> str:
    """Slack's three control characters as entities, so user text cannot form links or
    mentions (https://api.slack.com/reference/surfaces/formatting#escaping)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    # Cutting inside "&amp;" would leave a broken entity: drop the partial one too.
    head = _PARTIAL_ENTITY.sub("", text[: limit - len(_ELLIPSIS)])
    return head + _ELLIPSIS


def _slack_date(unix_s: float) -> str:
    """Slack renders the time in the reader's time zone; the fallback is UTC."""
    seconds = int(unix_s)
    fallback = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    return f"<!date^{seconds}^{{date_num}} {{time_secs}}|{fallback}>"


def format_value(value: float | None) -> str:
    """A metric value for people: four significant digits, ``n/a`` when there is none."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.4g}"


def human_duration(seconds: float) -> str:
    """``1h 2m 3s`` style; negative or tiny durations show as ``0s``."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h"] if hours else []
    if minutes or hours:
        parts.append(f"{minutes}m")
    parts.append(f"{secs}s")
    return " ".join(parts)


__all__ = ["MAX_ALERTS_SHOWN", "evidence_url", "format_value", "human_duration", "slack_payload"]
