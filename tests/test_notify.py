"""Notification payload builders, targets, retry timing and the notifier's queue (no network)."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

import pytest

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.notify.alertmanager import (
    MAX_ALERTS_PER_MESSAGE,
    ZERO_TIME,
    alertmanager_v2_alerts,
    alertmanager_webhook_payload,
    group_alerts,
    group_key,
    rfc3339,
)
from torshmon.aggregator.notify.delivery import (
    STAT_NAMES,
    Notifier,
    parse_retry_after,
    retry_delay_s,
)
from torshmon.aggregator.notify.slack import (
    MAX_ALERTS_SHOWN,
    format_value,
    human_duration,
    slack_payload,
)
from torshmon.aggregator.notify.targets import (
    AlertmanagerTarget,
    SlackTarget,
    WebhookTarget,
    targets_from_env,
)

SECRET_PATH = "/services/T0SECRET/B0SECRET/xoxbSuperSecretPathValue"
TOKEN = "tok-9f8e7d6c5b4a"
T0 = 1_700_000_000.0

# -- a Block Kit structural checker ---------------------------------------------------------

_TEXT_TYPES = ("mrkdwn", "plain_text")


def _check_text(obj: Any, where: str, limit: int, *, plain_only: bool = False) -> None:
    assert isinstance(obj, dict), f"{where}: a text object must be a dict"
    allowed = {"type", "text", "emoji", "verbatim"}
    assert set(obj) <= allowed, f"{where}: unknown keys {set(obj) - allowed}"
    assert obj.get("type") in (("plain_text",) if plain_only else _TEXT_TYPES), where
    text = obj.get("text")
    assert isinstance(text, str) and text, f"{where}: text must be a non-empty string"
    assert len(text) <= limit, f"{where}: {len(text)} chars over the {limit} limit"
    if obj["type"] == "plain_text":
        assert "emoji" not in obj or isinstance(obj["emoji"], bool), where


def check_block_kit(message: Mapping[str, Any]) -> None:
    """Fail unless ``message`` is a structurally valid incoming-webhook Block Kit message."""
    assert isinstance(message.get("text"), str) and message["text"], "fallback text missing"
    assert len(message["text"]) <= 40_000
    blocks = message.get("blocks")
    assert isinstance(blocks, list) and 1 <= len(blocks) <= 50, "1..50 blocks"
    for index, block in enumerate(blocks):
        where = f"blocks[{index}]"
        assert isinstance(block, dict), where
        kind = block.get("type")
        if kind == "header":
            assert set(block) <= {"type", "text", "block_id"}, where
            _check_text(block["text"], where + ".text", 150, plain_only=True)
        elif kind == "section":
            assert set(block) <= {"type", "text", "fields", "block_id", "accessory"}, where
            assert "text" in block or "fields" in block, f"{where}: text or fields required"
            if "text" in block:
                _check_text(block["text"], where + ".text", 3000)
            fields = block.get("fields", [])
            assert isinstance(fields, list) and len(fields) <= 10, f"{where}: <= 10 fields"
            for n, item in enumerate(fields):
                _check_text(item, f"{where}.fields[{n}]", 2000)
        elif kind == "context":
            elements = block.get("elements")
            assert isinstance(elements, list) and 1 <= len(elements) <= 10, where
            for n, item in enumerate(elements):
                _check_text(item, f"{where}.elements[{n}]", 3000)
        elif kind == "divider":
            assert set(block) <= {"type", "block_id"}, where
        else:
            raise AssertionError(f"{where}: unexpected block type {kind!r}")


def _alert(
    state: str = "firing",
    *,
    rule: str = "HighMemoryUsage",
    job: str = "train-42",
    rank: str | None = "3",
    metric: str | None = "torshmon_memory_utilization_ratio",
    value: float | None = 0.9731,
    severity: str = "critical",
    summary: str = "Memory of job train-42 rank 3 is at 97%",
    recommendation: str = "Reduce the batch size or enable activation checkpointing",
    ends_at: float | None = None,
    extra: Mapping[str, str] | None = None,
) -> Alert:
    labels = {"alertname": rule, "severity": severity, "job": job}
    if rank is not None:
        labels["rank"] = rank
    if metric is not None:
        labels["metric"] = metric
    labels.update(extra or {})
    return Alert(
        rule=rule,
        state=state,  # type: ignore[arg-type]
        severity=severity,
        labels=labels,
        annotations={
            "summary": summary,
            "description": "memory_utilization > 0.9 for 30s",
            "recommendation": recommendation,
        },
        value=value,
        starts_at_unix_s=T0,
        ends_at_unix_s=ends_at
        if ends_at is not None
        else (T0 + 125 if state == "resolved" else None),
    )


def _all_text(message: Mapping[str, Any]) -> str:
    parts: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("text"), str):
                parts.append(node["text"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(message["blocks"])
    return "\n".join(parts)


# -- Slack ----------------------------------------------------------------------------------


def test_slack_firing_names_every_fact_in_blocks_and_text() -> None:
    message = slack_payload([_alert()], group_key=group_key("HighMemoryUsage", "train-42"))
    check_block_kit(message)
    blocks_text = _all_text(message)
    for fact in ("train-42", "3", "torshmon_memory_utilization_ratio", "0.9731", "critical"):
        assert fact in blocks_text
        assert fact in message["text"]
    assert "Reduce the batch size" in blocks_text
    assert "Reduce the batch size" in message["text"]
    assert message["blocks"][0]["type"] == "header"
    assert "FIRING" in message["blocks"][0]["text"]["text"]
    assert ":rotating_light:" in message["text"]
    fields = [f["text"] for f in message["blocks"][1]["fields"]]
    assert [f.split("\n")[0] for f in fields] == [
        "*Job*",
        "*Rank*",
        "*Metric*",
        "*Value*",
        "*Severity*",
        "*State*",
    ]
    assert "<!date^1700000000^" in blocks_text


def test_slack_resolved_looks_different_and_says_how_long() -> None:
    firing = slack_payload([_alert()], group_key="k")
    resolved = slack_payload([_alert("resolved")], group_key="k")
    check_block_kit(resolved)
    assert "RESOLVED" in resolved["blocks"][0]["text"]["text"]
    assert ":white_check_mark:" in resolved["text"]
    assert resolved["blocks"][0] != firing["blocks"][0]
    assert "lasted 2m 5s" in _all_text(resolved)


def test_slack_large_group_is_summarised_within_limits() -> None:
    alerts = [
        _alert(rank=str(r), summary="x" * 5000, recommendation="y" * 5000, rule="R" * 300)
        for r in range(137)
    ]
    message = slack_payload(alerts, group_key="{}:{}")
    check_block_kit(message)
    header = message["blocks"][0]["text"]["text"]
    assert len(header) == 150 and header.endswith("…")
    assert "and 127 more" in _all_text(message)
    assert "and 127 more" in message["text"]
    assert len(message["text"]) <= 4800
    assert sum(1 for b in message["blocks"] if "fields" in b) == MAX_ALERTS_SHOWN


def test_slack_escapes_control_characters_and_truncates_cleanly() -> None:
    alert = _alert(summary="a <@U123> & <!channel> > b", job="j&<x>")
    message = slack_payload([alert], group_key="k")
    check_block_kit(message)
    text = _all_text(message) + message["text"]
    assert "<@U123>" not in text and "<!channel>" not in text
    assert "&lt;@U123&gt; &amp; &lt;!channel&gt;" in text
    long = slack_payload([_alert(summary="&" * 4000)], group_key="k")
    section = long["blocks"][1]["text"]["text"]
    assert section.endswith("…") and not re.search(r"&[a-z]{0,4}…$", section)


def test_slack_without_rank_or_metric_or_value() -> None:
    message = slack_payload([_alert(rank=None, metric=None, value=None)], group_key="k")
    check_block_kit(message)
    assert "rank=all" in message["text"] and "value=n/a" in message["text"]
    assert "all ranks" in _all_text(message)


@pytest.mark.parametrize("alerts", [[], [_alert("pending")]])
def test_slack_rejects_empty_and_pending(alerts: list[Alert]) -> None:
    with pytest.raises(ValueError, match="alert"):
        slack_payload(alerts, group_key="k")


def test_value_and_duration_formats() -> None:
    assert format_value(0.97312) == "0.9731"
    assert format_value(123456789.0) == "1.235e+08"
    assert format_value(float("nan")) == "n/a"
    assert human_duration(3723.4) == "1h 2m 3s"
    assert human_duration(-5) == "0s"


# -- Alertmanager payloads ------------------------------------------------------------------


def test_rfc3339() -> None:
    assert rfc3339(None) == ZERO_TIME == "0001-01-01T00:00:00Z"
    assert rfc3339(T0) == "2023-11-14T22:13:20Z"
    assert rfc3339(T0 + 0.25) == "2023-11-14T22:13:20.25Z"


def test_webhook_v4_payload() -> None:
    firing = _alert(rank="1")
    resolved = _alert("resolved", rank="2")
    key = group_key("HighMemoryUsage", "train-42")
    payload = alertmanager_webhook_payload(
        [firing, resolved], receiver="ops", group_key=key, external_url="http://agg:9470"
    )
    assert set(payload) == {
        "version",
        "groupKey",
        "truncatedAlerts",
        "status",
        "receiver",
        "groupLabels",
        "commonLabels",
        "commonAnnotations",
        "externalURL",
        "alerts",
    }
    assert payload["version"] == "4"
    assert payload["groupKey"] == '{}:{alertname="HighMemoryUsage", job="train-42"}'
    assert payload["status"] == "firing"
    assert payload["receiver"] == "ops"
    assert payload["groupLabels"] == {"alertname": "HighMemoryUsage", "job": "train-42"}
    assert "rank" not in payload["commonLabels"]
    assert payload["commonLabels"]["severity"] == "critical"
    assert payload["commonAnnotations"]["recommendation"].startswith("Reduce")
    first, second = payload["alerts"]
    assert set(first) == {
        "status",
        "labels",
        "annotations",
        "startsAt",
        "endsAt",
        "generatorURL",
        "fingerprint",
    }
    assert first["status"] == "firing" and first["endsAt"] == ZERO_TIME
    assert first["startsAt"] == "2023-11-14T22:13:20Z"
    assert first["fingerprint"] == firing.fingerprint and len(first["fingerprint"]) == 16
    assert first["generatorURL"] == "http://agg:9470"
    assert second["status"] == "resolved" and second["endsAt"] == "2023-11-14T22:15:25Z"
    only_resolved = alertmanager_webhook_payload(
        [resolved], receiver="ops", group_key=key, external_url=""
    )
    assert only_resolved["status"] == "resolved"


def test_v2_alerts_body() -> None:
    firing, resolved = _alert(rank="1"), _alert("resolved", rank="2")
    body = alertmanager_v2_alerts([firing, resolved], generator_url="http://agg:9470/alerts")
    assert "endsAt" not in body[0]
    assert body[1]["endsAt"] == "2023-11-14T22:15:25Z"
    assert body[0]["labels"]["rank"] == "1" and body[0]["generatorURL"].endswith("/alerts")
    assert set(body[0]) == {"labels", "annotations", "startsAt", "generatorURL"}
    held = alertmanager_v2_alerts([firing], generator_url="", firing_ends_at_unix_s=T0 + 240)
    assert held[0]["endsAt"] == "2023-11-14T22:17:20Z" and "generatorURL" not in held[0]


def test_payloads_reject_resolved_without_end_and_pending() -> None:
    unended = Alert(
        rule="r",
        state="resolved",
        severity="info",
        labels={"alertname": "r"},
        annotations={},
        value=1.0,
        starts_at_unix_s=T0,
    )
    with pytest.raises(ValueError, match="no ends_at_unix_s"):
        alertmanager_v2_alerts([unended], generator_url="")
    with pytest.raises(ValueError, match="pending"):
        alertmanager_webhook_payload(
            [_alert("pending")], receiver="r", group_key="k", external_url=""
        )


def test_grouping_by_alertname_and_job_splits_repeated_fingerprints() -> None:
    a1 = _alert(rank="1")
    a2 = _alert(rank="2")
    other_job = _alert(rank="1", job="other")
    other_rule = _alert(rank="1", rule="Straggler")
    a1_resolved = _alert("resolved", rank="1")
    groups = group_alerts([a1, other_job, a2, other_rule, a1_resolved])
    assert [(k, [a.fingerprint for a in g]) for k, g in groups] == [
        (group_key("HighMemoryUsage", "train-42"), [a1.fingerprint, a2.fingerprint]),
        (group_key("HighMemoryUsage", "other"), [other_job.fingerprint]),
        (group_key("Straggler", "train-42"), [other_rule.fingerprint]),
        (group_key("HighMemoryUsage", "train-42"), [a1.fingerprint]),
    ]
    assert groups[3][1][0].state == "resolved"
    many = group_alerts([_alert(rank=str(r)) for r in range(MAX_ALERTS_PER_MESSAGE + 3)])
    assert [len(g) for _, g in many] == [MAX_ALERTS_PER_MESSAGE, 3]
    assert group_key('a"b', "j") == '{}:{alertname="a\\"b", job="j"}'


# -- retries --------------------------------------------------------------------------------


def test_retry_delay_grows_is_capped_jittered_and_honours_retry_after() -> None:
    rng = random.Random(7)
    delays = [retry_delay_s(n, initial_s=0.5, max_s=30, rng=rng) for n in range(1, 12)]
    for attempt, delay in enumerate(delays, start=1):
        base = min(30.0, 0.5 * 2 ** (attempt - 1))
        assert base / 2 <= delay <= base
    assert delays[-1] > 15
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    rng_again = random.Random(7)
    again = [retry_delay_s(n, initial_s=0.5, max_s=30, rng=rng_again) for n in range(1, 3)]
    assert again == delays[:2]  # deterministic given the RNG
    assert retry_delay_s(1, initial_s=0.5, max_s=30, rng=rng, retry_after_s=7) == 7
    assert retry_delay_s(1, initial_s=0.5, max_s=30, rng=rng, retry_after_s=900) == 30


def test_parse_retry_after() -> None:
    assert parse_retry_after("3", now_unix_s=T0) == 3.0
    assert parse_retry_after(None, now_unix_s=T0) is None
    assert parse_retry_after("soon", now_unix_s=T0) is None
    assert parse_retry_after("nan", now_unix_s=T0) is None
    http_date = "Tue, 14 Nov 2023 22:13:30 GMT"
    assert parse_retry_after(http_date, now_unix_s=T0) == pytest.approx(10.0)
    assert parse_retry_after(http_date, now_unix_s=T0 + 60) == 0.0


# -- targets --------------------------------------------------------------------------------


def test_targets_hide_secrets_from_repr_and_errors() -> None:
    target = WebhookTarget("https://hooks.example.com" + SECRET_PATH, bearer_token=TOKEN)
    slack = SlackTarget("https://hooks.slack.com" + SECRET_PATH)
    for text in (repr(target), str(target), repr(slack)):
        assert "SuperSecret" not in text and TOKEN not in text
    for bad in ("ftp://hooks.example.com" + SECRET_PATH, "hooks.slack.com" + SECRET_PATH):
        with pytest.raises(ValueError, match="http:// or https://") as info:
            SlackTarget(bad)
        assert "SuperSecret" not in str(info.value)
    with pytest.raises(ValueError, match="no host") as info:
        WebhookTarget("http://" + SECRET_PATH)
    assert "SuperSecret" not in str(info.value)
    with pytest.raises(ValueError, match="not a valid URL") as info:
        SlackTarget("http://[::1" + SECRET_PATH)
    assert "SuperSecret" not in str(info.value) and info.value.__cause__ is None
    with pytest.raises(ValueError, match="bearer token") as info:
        WebhookTarget("http://h/x", bearer_token="has space " + TOKEN)
    assert TOKEN not in str(info.value)
    with pytest.raises(ValueError, match="target name"):
        SlackTarget("http://h/x", name="bad name")
    with pytest.raises(ValueError, match="resend_interval_s"):
        AlertmanagerTarget("http://am:9093", resend_interval_s=0)


def test_targets_from_env() -> None:
    env = {
        "TORSHMON_SLACK_WEBHOOK_URL": "https://hooks.slack.com/a, https://hooks.slack.com/b,",
        "TORSHMON_WEBHOOK_URL": "http://one.example/hook,http://two.example/hook",
        "TORSHMON_WEBHOOK_TOKEN": "t1,t2",
        "TORSHMON_ALERTMANAGER_URL": "http://127.0.0.1:9093/",
        "UNRELATED": "x",
    }
    targets = targets_from_env(env)
    assert [t.name for t in targets] == ["slack", "slack-2", "webhook", "webhook-2", "alertmanager"]
    assert isinstance(targets[2], WebhookTarget) and targets[2].bearer_token == "t1"
    assert isinstance(targets[3], WebhookTarget) and targets[3].bearer_token == "t2"
    assert isinstance(targets[4], AlertmanagerTarget)
    assert targets[4].alerts_url == "http://127.0.0.1:9093/api/v2/alerts"
    shared = targets_from_env(
        {"TORSHMON_WEBHOOK_URL": "http://a/x,http://b/y", "TORSHMON_WEBHOOK_TOKEN": "t"}
    )
    assert [t.bearer_token for t in shared if isinstance(t, WebhookTarget)] == ["t", "t"]
    assert targets_from_env({}) == []
    assert targets_from_env({"TORSHMON_SLACK_WEBHOOK_URL": "  "}) == []


def test_targets_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TORSHMON_SLACK_WEBHOOK_URL", "TORSHMON_WEBHOOK_URL", "TORSHMON_WEBHOOK_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORSHMON_ALERTMANAGER_URL", "http://127.0.0.1:9093")
    assert [t.name for t in targets_from_env()] == ["alertmanager"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TORSHMON_SLACK_WEBHOOK_URL": "https://ok.example/a,hooks.slack.com" + SECRET_PATH},
            "TORSHMON_SLACK_WEBHOOK_URL item 2 must start with http:// or https://",
        ),
        (
            {"TORSHMON_ALERTMANAGER_URL": "http://" + SECRET_PATH},
            "TORSHMON_ALERTMANAGER_URL has no host",
        ),
        ({"TORSHMON_WEBHOOK_TOKEN": TOKEN}, "TORSHMON_WEBHOOK_URL is not"),
        (
            {
                "TORSHMON_WEBHOOK_URL": "http://a/x,http://b/y,http://c/z",
                "TORSHMON_WEBHOOK_TOKEN": "a,b",
            },
            "2 tokens for 3 webhook URLs",
        ),
    ],
)
def test_targets_from_env_errors_name_the_variable_not_the_secret(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        targets_from_env(env)
    assert message in str(info.value)
    assert "SuperSecret" not in str(info.value) and TOKEN not in str(info.value)


# -- the notifier's queue, without a network ------------------------------------------------


async def test_submit_drops_oldest_when_full_and_deduplicates() -> None:
    notifier = Notifier(
        [SlackTarget("http://127.0.0.1:9/a", name="s"), WebhookTarget("http://127.0.0.1:9/b")],
        max_queue=3,
    )
    alerts = [_alert(rank=str(r)) for r in range(5)]
    notifier.submit(alerts)
    notifier.submit([alerts[4], _alert("pending", rank="9")])  # queued already / never sent
    stats = notifier.stats()
    assert set(stats) == {"s", "webhook"}
    assert tuple(stats["s"]) == STAT_NAMES
    assert stats["s"]["dropped_total"] == 2 and stats["s"]["queued"] == 3
    assert stats["s"]["deduplicated_total"] == 1
    # The dropped ones were never delivered, so offering them again queues them again.
    notifier.submit([alerts[0]])
    assert (
        notifier.stats()["s"]["dropped_total"] == 3
        and notifier.stats()["s"]["deduplicated_total"] == 1
    )
    await notifier.aclose()
    after = notifier.stats()["webhook"]
    assert (
        after["queued"] == 0 and after["dropped_total"] == 3 + 3
    )  # never started: all undelivered
    notifier.submit([_alert(rank="7")])  # after close: counted, not raised
    assert notifier.stats()["webhook"]["dropped_total"] == 7
    await notifier.aclose()  # twice is safe


async def test_bad_input_costs_only_itself() -> None:
    notifier = Notifier([SlackTarget("http://127.0.0.1:9/a", name="s")])
    notifier.submit(None)  # type: ignore[arg-type]
    notifier.submit([object(), _alert(rank="1"), None, _alert(rank="2")])  # type: ignore[list-item]
    # the two real alerts behind and between the bad items are queued, nothing else
    assert notifier.stats()["s"]["queued"] == 2
    await notifier.aclose()
    assert notifier.stats()["s"]["dropped_total"] == 2  # never started: undelivered


def test_notifier_validates_its_settings() -> None:
    target = SlackTarget("http://127.0.0.1:9/a")
    with pytest.raises(ValueError, match="unique; repeated: slack"):
        Notifier([target, SlackTarget("http://127.0.0.1:9/b")])
    with pytest.raises(ValueError, match="max_queue must be at least 1, got 0"):
        Notifier([target], max_queue=0)
    with pytest.raises(ValueError, match="retry_initial_s"):
        Notifier([target], retry_initial_s=-1)
    with pytest.raises(ValueError, match="max_attempts"):
        Notifier([target], max_attempts=0)
