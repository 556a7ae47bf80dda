"""The aggregator's pages (``/``, ``/jobs/{job}``, ``/login``) and the report as JSON, on
a real loopback server over a history with known numbers (tests/report_history.py)."""

from __future__ import annotations

import asyncio
import html
import re
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, CookieJar
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from tests import report_history as h
from tests.test_api import AUTH, TOKEN, Api
from torshmon.aggregator.http.pages import SESSION_COOKIE, session_cookie
from torshmon.cli import main
from torshmon.history.store import HistoryStore
from torshmon.report import from_json, report_from_aggregator
from torshmon.report.page import JobLead, render_index
from torshmon.report.source import HistoryReports

JOB_PATH = "/jobs/" + urllib.parse.quote(h.JOB, safe="")


@pytest.fixture
def history(tmp_path: Path) -> Iterator[HistoryStore]:
    url = h.make_history(tmp_path / "h.db")
    writer = ThreadPoolExecutor(1)
    store = HistoryStore(url, aggregator_id="a1", writer=writer)
    store.open()
    yield store
    writer.shutdown(wait=True)
    store.close()


@pytest.fixture
async def client(history: HistoryStore) -> AsyncIterator[TestClient[Any, Any]]:
    # A cookie jar that keeps cookies of an IP-literal host (the test server's 127.0.0.1).
    server = TestServer(Api(history).app())
    async with TestClient(server, cookie_jar=CookieJar(unsafe=True)) as client:
        yield client


def _check_headers(headers: Any) -> None:
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert "script-src" not in csp  # no script at all: default-src 'none' covers it
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Content-Type"].startswith("text/html")


async def test_pages_want_the_token_and_a_browser_gives_it_once(
    client: TestClient[Any, Any],
) -> None:
    for path in ("/", JOB_PATH):
        async with client.get(path) as response:
            assert response.status == 401
            text = await response.text()
            assert 'name="token"' in text and 'type="password"' in text
            assert h.JOB not in text  # nothing of the history before signing in
            _check_headers(response.headers)
    # The wrong token: the form again, no cookie.
    form = {"token": "wrong", "next": JOB_PATH}
    async with client.post("/login", data=form, allow_redirects=False) as response:
        assert response.status == 401 and SESSION_COOKIE not in response.cookies
    # The right one: a cookie that is not the token, HttpOnly and SameSite=Strict, and back
    # to the page asked for.
    form["token"] = TOKEN
    async with client.post("/login", data=form, allow_redirects=False) as response:
        assert response.status == 303
        assert response.headers["Location"] == JOB_PATH
        cookie = response.cookies[SESSION_COOKIE]
        assert cookie.value == session_cookie(TOKEN) and TOKEN not in cookie.value
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
    async with client.get(JOB_PATH) as response:
        assert response.status == 200
        _check_headers(response.headers)
        page = await response.text()
    assert "bert&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "105 ms" in page and "190 ms" in page  # rank 0's median and p95 step
    async with client.get("/") as response:
        assert response.status == 200
        index = await response.text()
    assert f'href="{JOB_PATH}"' in index and "bert&lt;script&gt;" in index
    # A login never sends the browser to another site.
    form["next"] = "//evil.example/x"
    async with client.post("/login", data=form, allow_redirects=False) as response:
        assert response.headers["Location"] == "/"


async def test_a_bearer_token_opens_the_pages_and_the_json(client: TestClient[Any, Any]) -> None:
    async with client.get(JOB_PATH, headers=AUTH) as response:
        assert response.status == 200
    async with client.get("/api/v1/jobs/nope/summary", headers=AUTH) as response:
        assert response.status == 404
        assert (await response.json())["error"] == "no job 'nope' in the history"
    path = "/api/v1/jobs/" + urllib.parse.quote(h.JOB, safe="") + "/summary"
    async with client.get(path) as response:
        assert response.status == 401
    async with client.get(path, headers=AUTH) as response:
        assert response.status == 200
        report = from_json(await response.read())
    assert [r.steps for r in report.ranks] == [h.STEPS, h.STEPS]
    assert {a.rule for a in report.alerts} == {"Straggler", "High Comm"}


async def test_the_list_of_jobs_leads_with_each_jobs_headline_and_state(
    client: TestClient[Any, Any],
) -> None:
    """The list says what the job's report leads with, word for word, and whether its
    latest run still goes: the reader knows which job to open."""
    path = "/api/v1/jobs/" + urllib.parse.quote(h.JOB, safe="") + "/summary"
    async with client.get(path, headers=AUTH) as response:
        report = from_json(await response.read())
    assert report.headline.startswith("rank 1 on node node1 computes")
    async with client.get("/", headers=AUTH) as response:
        assert response.status == 200
        text = await response.text()
    [row] = [r for r in text.split("<tr>") if f">{html.escape(h.JOB)}</a>" in r]
    cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in row.split("</td>")][:3]
    assert cells == [h.JOB, "running" if report.running else "ended", report.headline]
    # an ended run says so, whatever its last_seen alone would suggest (its ranks closed)
    seen = {"job": "j", "world_size": 2, "backend": "gloo", "first_seen_unix_ns": 0}
    page = render_index([seen | {"last_seen_unix_ns": 10**18}], 1e9, {"j": JobLead("x", False)})
    assert '<span class="badge ended">ended</span></td><td class="text lead">x</td>' in page


async def test_an_unknown_job_is_a_404_page(client: TestClient[Any, Any]) -> None:
    async with client.get("/jobs/<nope>", headers=AUTH) as response:
        assert response.status == 404
        _check_headers(response.headers)
        text = await response.text()
    assert "No job &lt;nope&gt;" in text


async def test_a_form_from_another_site_is_refused(client: TestClient[Any, Any]) -> None:
    headers = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    form = {"token": TOKEN, "next": "/"}
    async with client.post("/login", data=form, headers=headers) as response:
        assert response.status == 403
    # Forms go to /login only: the API still takes JSON alone.
    async with client.post("/api/v1/query", data={"sql": "SELECT 1"}, headers=AUTH) as response:
        assert response.status == 415


async def test_the_command_reads_the_report_through_the_aggregator(
    client: TestClient[Any, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = str(client.make_url("")).rstrip("/")
    report = await asyncio.to_thread(report_from_aggregator, base, h.JOB, TOKEN)
    assert report.job == h.JOB and len(report.trials) == 2
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    argv = ["report", h.JOB, "--aggregator", base, "--token-file", str(token_file)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "torshmon report: job " + h.JOB in out and "105 ms" in out
    # Without the token: one line, status 2.
    assert await asyncio.to_thread(main, argv[:4]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 401" in err


async def test_without_a_token_the_pages_are_open_as_the_api_is(history: HistoryStore) -> None:
    from torshmon.aggregator.http import api
    from torshmon.aggregator.http.guard import RequestGuard
    from torshmon.aggregator.settings import AggregatorSettings

    fakes = Api(history)
    settings = AggregatorSettings(port=0, db_url=history.url, aggregator_id="a1")
    app = api.make_app(
        settings,
        guard=RequestGuard(settings),
        store=history,
        live=fakes.live,
        commands=fakes.commands,
        tuning=fakes.tuning,
        reports=HistoryReports(lambda: history.engine),
        registry=CollectorRegistry(),
        clock=lambda: h.T0 + 5,
    )
    async with (
        TestServer(app) as server,
        ClientSession() as session,
        session.get(server.make_url(JOB_PATH)) as response,
    ):
        assert response.status == 200
        page = await response.text()
    # Seen 15 s before "now": running, so the page reloads itself.
    assert '<meta http-equiv="refresh" content="15">' in page
