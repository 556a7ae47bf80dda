"""The notifier against real aiohttp receivers on 127.0.0.1 and a real Alertmanager."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.test_notify import check_block_kit
from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.notify.alertmanager import (
    ZERO_TIME,
    alertmanager_webhook_payload,
    group_key,
)
from torshmon.aggregator.notify.delivery import Notifier
from torshmon.aggregator.notify.targets import AlertmanagerTarget, SlackTarget, WebhookTarget

pytestmark = pytest.mark.integration

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
SECRET_PATH = "/services/T0SECRET/B0SECRET/xoxbSuperSecretPathValue"
TOKEN = "tok-9f8e7d6c5b4a3210"
EXTERNAL_URL = "http://aggregator.example:9470"


class Receiver:
    """An HTTP endpoint that answers scripted failures first, then 200, and keeps what it got."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str]]] = []
        self.requests: list[tuple[float, str, dict[str, str]]] = []
        self.bodies: list[Any] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", self._handle)
        # No access log: it would print the secret path, and it is not ours to test.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests.append((time.monotonic(), request.path, dict(request.headers)))
        body = await request.json()
        if self.script:
            status, headers = self.script.pop(0)
            # A careless server echoes the request: the notifier must not log it verbatim.
            echo = f"failed {request.path} auth={request.headers.get('Authorization')}"
            return web.Response(status=status, text=echo, headers=headers)
        self.bodies.append(body)
        return web.Response(text="ok")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rx = await Receiver().start()
    try:
        yield rx
    finally:
        await rx.stop()


@pytest.fixture
def caplog_debug(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="torshmon")
    return caplog


def _our_log(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        f"{r.levelname} {r.getMessage()} {r.exc_text or ''}"
        for r in caplog.records
        if r.name.startswith("torshmon")
    )


def _assert_no_secret(text: str) -> None:
    for secret in ("SuperSecretPathValue", "T0SECRET", TOKEN):
        assert secret not in text


def _alert(
    state: str = "firing", *, rank: str = "3", job: str = "train-42", rule: str = "HighMemoryUsage"
) -> Alert:
    now = time.time()
    return Alert(
        rule=rule,
        state=state,  # type: ignore[arg-type]
        severity="critical",
        labels={
            "alertname": rule,
            "severity": "critical",
            "job": job,
            "rank": rank,
            "metric": "torshmon_memory_utilization_ratio",
        },
        annotations={
            "summary": f"Memory of job {job} rank {rank} is at 97%",
            "description": "memory_utilization > 0.9 for 30s",
            "recommendation": "Reduce the batch size",
        },
        value=0.9731,
        starts_at_unix_s=now - 60,
        ends_at_unix_s=now if state == "resolved" else None,
    )


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Poll until ``predicate`` holds; the seconds it took. Fails the test on timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- Slack ----------------------------------------------------------------------------------


async def test_slack_gets_grouped_valid_block_kit_once_per_state(receiver: Receiver) -> None:
    notifier = Notifier([SlackTarget(receiver.url(SECRET_PATH))], group_wait_s=0.2)
    await notifier.start()
    try:
        a1, a2, other = _alert(rank="1"), _alert(rank="2"), _alert(rank="0", job="eval-7")
        notifier.submit([a1, other])
        await asyncio.sleep(0)  # the worker starts a1's group wait; a2 comes within it
        notifier.submit([a2])
        await _until(lambda: len(receiver.bodies) == 2)
        by_job = {body["blocks"][0]["text"]["text"]: body for body in receiver.bodies}
        assert len(by_job) == 2
        for body in receiver.bodies:
            check_block_kit(body)
            for fact in ("rank=", "metric=torshmon_memory_utilization_ratio", "value=0.9731"):
                assert fact in body["text"]
            assert "Recommendation: Reduce the batch size" in body["text"]
        train = next(b for b in receiver.bodies if "job=train-42" in b["text"])
        assert "rank=1" in train["text"] and "rank=2" in train["text"]
        assert "(2 alerts)" in train["blocks"][0]["text"]["text"]
        assert receiver.requests[0][1] == SECRET_PATH

        notifier.submit([a1])  # delivered already: not again
        notifier.submit([_alert("resolved", rank="1")])
        await _until(lambda: len(receiver.bodies) == 3)
        # Delivery keeps submission order: a duplicate of a1 would arrive before this.
        notifier.submit([_alert(rank="5", job="later-1")])
        await _until(lambda: len(receiver.bodies) == 4)
        assert "RESOLVED" in receiver.bodies[2]["blocks"][0]["text"]["text"]
        assert "job=later-1" in receiver.bodies[3]["text"]
        check_block_kit(receiver.bodies[2])
        # The receiver holds a body before its reply reaches the notifier, which counts the
        # delivery only then.
        await _until(lambda: notifier.stats()["slack"]["sent_total"] == 4)
        stats = notifier.stats()["slack"]
        assert (stats["sent_total"], stats["deduplicated_total"], stats["failed_total"]) == (
            4,
            1,
            0,
        )
    finally:
        await notifier.aclose()


# -- retries and failures -------------------------------------------------------------------


async def test_three_500s_then_success_is_one_delivery_and_logs_no_secret(
    receiver: Receiver, caplog_debug: pytest.LogCaptureFixture
) -> None:
    receiver.script = [(500, {})] * 3
    target = WebhookTarget(receiver.url(SECRET_PATH), bearer_token=TOKEN)
    notifier = Notifier([target], group_wait_s=0.0, retry_initial_s=0.02, retry_max_s=0.1)
    async with notifier:
        notifier.submit([_alert()])
        await _until(lambda: len(receiver.bodies) == 1)
        await asyncio.sleep(0.1)
    assert len(receiver.requests) == 4 and len(receiver.bodies) == 1
    stats = notifier.stats()["webhook"]
    assert (stats["sent_total"], stats["retries_total"], stats["failed_total"]) == (1, 3, 0)
    log_text = _our_log(caplog_debug)
    assert "HTTP 500" in log_text and "notify target webhook" in log_text
    assert "<redacted>" in log_text  # the echoed path and token were scrubbed
    _assert_no_secret(log_text)


async def test_429_retry_after_is_honoured(receiver: Receiver) -> None:
    receiver.script = [(429, {"Retry-After": "1"})]
    notifier = Notifier(
        [SlackTarget(receiver.url("/hook"))], group_wait_s=0.0, retry_initial_s=0.01
    )
    async with notifier:
        notifier.submit([_alert()])
        await _until(lambda: len(receiver.bodies) == 1, timeout_s=3)
    gap = receiver.requests[1][0] - receiver.requests[0][0]
    assert 0.95 <= gap < 2.0
    assert notifier.stats()["slack"]["retries_total"] == 1


async def test_4xx_is_permanent_and_logged_once(
    receiver: Receiver, caplog_debug: pytest.LogCaptureFixture
) -> None:
    receiver.script = [(404, {}), (404, {})]
    notifier = Notifier(
        [SlackTarget(receiver.url(SECRET_PATH))], group_wait_s=0.0, retry_initial_s=0.01
    )
    async with notifier:
        notifier.submit([_alert(job="a")])
        await _until(lambda: notifier.stats()["slack"]["failed_total"] == 1)
        notifier.submit([_alert(job="b")])
        await _until(lambda: notifier.stats()["slack"]["failed_total"] == 2)
        # Not delivered, so the same alert may be offered again, and now it goes.
        notifier.submit([_alert(job="a")])
        await _until(lambda: len(receiver.bodies) == 1)
    assert len(receiver.requests) == 3
    stats = notifier.stats()["slack"]
    assert (stats["retries_total"], stats["sent_total"], stats["deduplicated_total"]) == (0, 1, 0)
    warnings = [
        r
        for r in caplog_debug.records
        if r.name.startswith("torshmon") and "HTTP 404" in r.getMessage()
    ]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.DEBUG]
    _assert_no_secret(_our_log(caplog_debug))


async def test_dead_endpoint_blocks_neither_caller_nor_other_targets(
    receiver: Receiver, caplog_debug: pytest.LogCaptureFixture
) -> None:
    dead = WebhookTarget(
        f"http://127.0.0.1:{_free_port()}{SECRET_PATH}", name="dead", bearer_token=TOKEN
    )
    live = SlackTarget(receiver.url("/live"), name="live")
    notifier = Notifier(
        [dead, live], group_wait_s=0.02, retry_initial_s=0.05, retry_max_s=0.2, max_attempts=1000
    )
    await notifier.start()
    try:
        started = time.perf_counter()
        for rank in range(200):
            notifier.submit([_alert(rank=str(rank))])
        submit_s = time.perf_counter() - started
        assert submit_s < 0.2
        took_s = await _until(lambda: len(receiver.bodies) >= 1, timeout_s=2.0)
        assert took_s < 1.0
        await _until(lambda: notifier.stats()["dead"]["retries_total"] >= 2)
    finally:
        started = time.perf_counter()
        await notifier.aclose(flush_timeout_s=0.3)
        close_s = time.perf_counter() - started
    assert close_s < 1.0
    stats = notifier.stats()
    assert stats["dead"]["sent_total"] == 0 and stats["dead"]["dropped_total"] == 200
    assert stats["live"]["dropped_total"] == 0 and stats["live"]["sent_total"] >= 1
    assert sum(len(b["text"]) > 0 for b in receiver.bodies) == stats["live"]["sent_total"]
    log_text = _our_log(caplog_debug)
    assert "notify target dead: cannot connect" in log_text
    _assert_no_secret(log_text)


# -- generic webhook ------------------------------------------------------------------------


async def test_webhook_gets_v4_payload_with_bearer_token_and_close_flushes(
    receiver: Receiver,
) -> None:
    notifier = Notifier(
        [WebhookTarget(receiver.url("/hook"), name="ops", bearer_token=TOKEN)],
        group_wait_s=0.5,
        external_url=EXTERNAL_URL,
    )
    await notifier.start()
    notifier.submit([_alert(rank="1"), _alert("resolved", rank="2")])
    await notifier.aclose(flush_timeout_s=3)  # cuts the group wait short, then delivers
    await notifier.aclose()
    assert len(receiver.bodies) == 1
    assert receiver.requests[0][2]["Authorization"] == f"Bearer {TOKEN}"
    assert receiver.requests[0][2]["Content-Type"] == "application/json"
    payload = receiver.bodies[0]
    assert payload["version"] == "4" and payload["receiver"] == "ops"
    assert payload["groupKey"] == group_key("HighMemoryUsage", "train-42")
    assert payload["status"] == "firing" and payload["externalURL"] == EXTERNAL_URL
    assert payload["groupLabels"] == {"alertname": "HighMemoryUsage", "job": "train-42"}
    assert [a["status"] for a in payload["alerts"]] == ["firing", "resolved"]
    assert payload["alerts"][0]["endsAt"] == ZERO_TIME
    assert payload["alerts"][1]["endsAt"] != ZERO_TIME


# -- Alertmanager ---------------------------------------------------------------------------


async def test_alertmanager_target_resends_firing_and_stops_after_resolve(
    receiver: Receiver,
) -> None:
    target = AlertmanagerTarget(receiver.url(""), resend_interval_s=0.15)
    async with Notifier([target], group_wait_s=0.0) as notifier:
        notifier.submit([_alert()])
        await _until(lambda: len(receiver.bodies) >= 3, timeout_s=2)
        assert {path for _, path, _ in receiver.requests} == {"/api/v2/alerts"}
        ends = [body[0]["endsAt"] for body in receiver.bodies]
        assert ends == sorted(ends) and len(set(ends)) == len(ends)  # pushed ahead each time
        notifier.submit([_alert("resolved")])
        await _until(lambda: receiver.bodies[-1][0]["endsAt"] < receiver.bodies[-2][0]["endsAt"])
        count = len(receiver.bodies)
        # Another alert's re-sends mark time: the resolved one must be in none of them.
        notifier.submit([_alert(rank="8")])
        await _until(lambda: len(receiver.bodies) >= count + 3, timeout_s=2)
        later = [alert["labels"]["rank"] for body in receiver.bodies[count:] for alert in body]
        assert later == ["8"] * len(later)  # nothing of rank 3 left to re-send


@pytest.fixture
async def alertmanager(tmp_path: Path, receiver: Receiver) -> AsyncIterator[str]:
    """A real Alertmanager on a free port that notifies ``receiver`` at /am-hook."""
    if shutil.which(ALERTMANAGER) is None:
        pytest.fail(f"{ALERTMANAGER} is not installed")
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        "route:\n"
        "  receiver: hook\n"
        "  group_by: [alertname, job]\n"
        "  group_wait: 50ms\n"
        "  group_interval: 500ms\n"
        "  repeat_interval: 1h\n"
        "receivers:\n"
        "  - name: hook\n"
        "    webhook_configs:\n"
        f"      - url: {receiver.url('/am-hook')}\n"
        "        send_resolved: true\n"
    )
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        ALERTMANAGER,
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        "--log.level=warn",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 10
            while True:
                if process.returncode is not None:
                    stderr = await process.stderr.read() if process.stderr else b""
                    pytest.fail(f"alertmanager exited: {stderr.decode(errors='replace')}")
                try:
                    async with session.get(base + "/-/ready") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("alertmanager did not become ready in 10 s")
                await asyncio.sleep(0.05)
        yield base
    finally:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 5)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()


async def _am_alerts(base: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(base + "/api/v2/alerts") as resp:
        assert resp.status == 200
        alerts: list[dict[str, Any]] = await resp.json()
        return alerts


async def test_real_alertmanager_shows_then_ends_the_alert(
    alertmanager: str, receiver: Receiver
) -> None:
    firing = _alert(rank="5")
    target = AlertmanagerTarget(alertmanager, name="am")
    async with Notifier([target], group_wait_s=0.0, external_url=EXTERNAL_URL) as notifier:
        notifier.submit([firing])
        shown: list[dict[str, Any]] = []

        async def poll() -> None:
            while not shown:
                shown.extend(await _am_alerts(alertmanager))
                await asyncio.sleep(0.05)

        await asyncio.wait_for(poll(), 5)
        (alert,) = shown
        assert alert["labels"] == dict(firing.labels)
        assert alert["annotations"]["recommendation"] == "Reduce the batch size"
        assert alert["status"]["state"] == "active"
        assert alert["generatorURL"] == EXTERNAL_URL
        # Alertmanager's own webhook notification has exactly our v4 payload's shape.
        await _until(lambda: len(receiver.bodies) == 1)
        real = receiver.bodies[0]
        ours = alertmanager_webhook_payload(
            [firing], receiver="hook", group_key=real["groupKey"], external_url=alertmanager
        )
        assert set(real) == set(ours)
        assert set(real["alerts"][0]) == set(ours["alerts"][0])
        assert real["alerts"][0]["endsAt"] == ZERO_TIME == ours["alerts"][0]["endsAt"]
        assert real["alerts"][0]["fingerprint"]
        assert (real["groupLabels"], real["status"]) == (ours["groupLabels"], ours["status"])
        assert real["commonLabels"] == ours["commonLabels"]

        notifier.submit([_alert("resolved", rank="5")])

        async def gone() -> None:
            while await _am_alerts(alertmanager):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(gone(), 5)
        await _until(lambda: len(receiver.bodies) == 2, timeout_s=5)
        assert receiver.bodies[1]["status"] == "resolved"
        assert receiver.bodies[1]["alerts"][0]["endsAt"] != ZERO_TIME
    assert notifier.stats()["am"]["sent_total"] == 2


async def test_a_silence_in_the_real_alertmanager_matches_the_labels_torshmon_pushes(
    alertmanager: str, receiver: Receiver
) -> None:
    """Users who route through Alertmanager silence there (``amtool silence add
    alertname=HighMemoryUsage job=train-42 rank=3``): the labels torshmon pushes are the
    ones its alerts and docs name, so such a silence suppresses exactly that alert."""
    now = time.time()
    silence = {
        "matchers": [
            {"name": name, "value": value, "isRegex": False, "isEqual": True}
            for name, value in (
                ("alertname", "HighMemoryUsage"),
                ("job", "train-42"),
                ("rank", "3"),
            )
        ],
        "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 1)),
        "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 3600)),
        "createdBy": "ops",
        "comment": "node3 in repair",
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(alertmanager + "/api/v2/silences", json=silence) as resp,
    ):
        assert resp.status == 200, await resp.text()
        silence_id = (await resp.json())["silenceID"]
    target = AlertmanagerTarget(alertmanager, name="am")
    async with Notifier([target], group_wait_s=0.0, external_url=EXTERNAL_URL) as notifier:
        notifier.submit([_alert(rank="3"), _alert(rank="4")])
        states: dict[str, dict[str, Any]] = {}

        async def both() -> None:
            while len(states) < 2:
                for alert in await _am_alerts(alertmanager):
                    states[alert["labels"]["rank"]] = alert["status"]
                await asyncio.sleep(0.05)

        await asyncio.wait_for(both(), 5)
        assert states["3"]["state"] == "suppressed" and states["3"]["silencedBy"] == [silence_id]
        assert states["4"]["state"] == "active" and states["4"]["silencedBy"] == []
        # Only the unsilenced alert reaches Alertmanager's receiver.
        await _until(lambda: len(receiver.bodies) == 1)
        assert [a["labels"]["rank"] for a in receiver.bodies[0]["alerts"]] == ["4"]
