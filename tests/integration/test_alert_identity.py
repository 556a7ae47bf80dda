"""One alert identity (issue 18): the aggregator's pushed alert and the exported
Prometheus rule's alert end as ONE alert in a real Alertmanager.

Prometheus's side is evaluated by the real rules engine (``promtool test rules`` on
the exported file, over the series as a scrape of the aggregator stores them), which
checks that its alerts carry exactly the aggregator's labels; those labels are then
posted to Alertmanager as Prometheus posts them, beside the aggregator's own push.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest
import yaml

from tests.test_promrules import SHARED_RULES, engine_alert, firing_value, scraped_series
from torshmon.aggregator.core.promrules import to_prometheus
from torshmon.aggregator.core.rules import Rule
from torshmon.aggregator.notify.alertmanager import rfc3339
from torshmon.aggregator.notify.delivery import Notifier
from torshmon.aggregator.notify.targets import AlertmanagerTarget
from torshmon.aggregator.rule_files import default_rules

pytestmark = pytest.mark.integration

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
PROMTOOL = "/usr/bin/promtool"
#: Scrape and evaluation interval of the promtool test, and how long its series run.
INTERVAL_S = 2
POINTS = 200


def _promtool_values(rule: Rule) -> str:
    value = firing_value(rule)
    if math.isnan(value):
        return " ".join(["NaN"] * POINTS)  # promtool 2.42 cannot expand NaNxN
    if rule.kind in ("rate", "increase"):  # a counter rising by ``value`` a second
        return f"0+{value * INTERVAL_S!r}x{POINTS}"
    return f"{value!r}x{POINTS}"


def _series_text(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def test_prometheus_evaluates_every_exported_rule_to_the_aggregators_labels(
    tmp_path: Path,
) -> None:
    document = yaml.safe_load(to_prometheus(default_rules()))
    for entry in document["groups"][0]["rules"]:
        # promtool compares annotations too; only names and labels make the identity.
        del entry["annotations"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(document))
    tests = []
    for rule in SHARED_RULES:
        alert = engine_alert(rule)
        name, labels = scraped_series(rule)
        expected = {k: v for k, v in alert.labels.items() if k != "alertname"}
        tests.append(
            {
                "interval": f"{INTERVAL_S}s",
                "input_series": [
                    {"series": _series_text(name, labels), "values": _promtool_values(rule)}
                ],
                "alert_rule_test": [
                    {
                        "eval_time": f"{POINTS * INTERVAL_S // 2}s",
                        "alertname": alert.labels["alertname"],
                        # promtool compares label sets whole: one label more or less fails.
                        "exp_alerts": [{"exp_labels": expected}],
                    }
                ],
            }
        )
    unit = {"rule_files": ["rules.yml"], "evaluation_interval": f"{INTERVAL_S}s", "tests": tests}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(unit))
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> Any:
    with urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager on a free port, with a receiver that sends nothing."""
    if shutil.which(ALERTMANAGER) is None:
        pytest.fail(f"{ALERTMANAGER} is not installed")
    config = tmp_path / "alertmanager.yml"
    config.write_text("route: {receiver: quiet}\nreceivers: [{name: quiet}]\n")
    port = _free_port()
    process = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                stderr = process.stderr.read() if process.stderr else b""
                pytest.fail(f"alertmanager exited: {stderr.decode(errors='replace')}")
            try:
                with urlopen(base + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("alertmanager did not become ready in 10 s")
            time.sleep(0.05)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _push_as_the_aggregator(base: str, alerts: list[Any]) -> None:
    target = AlertmanagerTarget(base, name="am")
    async with Notifier([target], group_wait_s=0.0) as notifier:
        notifier.submit(alerts)
        deadline = time.monotonic() + 10
        while notifier.stats()["am"]["sent_total"] < 1:
            assert time.monotonic() < deadline, notifier.stats()
            await asyncio.sleep(0.05)


def _post_as_prometheus(base: str, rules: list[Rule], alerts: list[Any]) -> None:
    """POST /api/v2/alerts as Prometheus's notifier does: the alert's labels (those
    promtool checked above), the rule's annotations, its own generator URL."""
    (group,) = yaml.safe_load(to_prometheus(default_rules()))["groups"]
    exported = {entry["alert"]: entry for entry in group["rules"]}
    body = [
        {
            "labels": dict(alert.labels),
            "annotations": exported[alert.labels["alertname"]]["annotations"],
            "startsAt": rfc3339(time.time()),
            "endsAt": rfc3339(time.time() + 300),
            "generatorURL": "http://prometheus:9090/graph",
        }
        for alert in alerts
    ]
    request = Request(
        base + "/api/v2/alerts",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urlopen(request, timeout=5) as response:
        assert response.status == 200


def test_alertmanager_holds_one_alert_when_both_paths_send_it(alertmanager: str) -> None:
    alerts = [engine_alert(rule) for rule in SHARED_RULES]
    asyncio.run(_push_as_the_aggregator(alertmanager, alerts))
    _post_as_prometheus(alertmanager, SHARED_RULES, alerts)
    held = _get(alertmanager + "/api/v2/alerts")
    # Alertmanager stores a POST before it answers: what it holds now is final.
    assert sorted(a["labels"]["alertname"] for a in held) == sorted(
        a.labels["alertname"] for a in alerts
    )
    assert sorted(json.dumps(a["labels"], sort_keys=True) for a in held) == sorted(
        json.dumps(dict(a.labels), sort_keys=True) for a in alerts
    )
    step = next(a for a in held if a["labels"]["alertname"] == "StepTimeAnomaly")
    assert step["labels"] == {
        "alertname": "StepTimeAnomaly",
        "severity": "warning",
        "job": "train",
        "run": "r1",
        "rank": "1",
        "metric": "step_duration_seconds",
    }
