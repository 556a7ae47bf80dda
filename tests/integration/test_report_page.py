"""The report's page in a real headless Chromium: written by ``torshmon report --html`` and
served by the aggregator, it renders with no console error under its Content-Security-
Policy, and its plots carry the history's numbers (tests/report_history.py)."""

from __future__ import annotations

import itertools
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from tests import report_history as h
from tests.integration.browser import Browser
from tests.test_api import Api
from torshmon.aggregator.http import api
from torshmon.aggregator.http.guard import RequestGuard
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.cli import main
from torshmon.history.store import HistoryStore
from torshmon.report.source import HistoryReports
from torshmon.report.text import when

pytestmark = pytest.mark.integration

#: What the test reads from the page: the data block, the plots' hover titles, and the
#: vertices of the plotted lines (SVG y grows downwards).
_PROBE = """(() => {
  const text = id => document.getElementById(id)?.textContent.trim() ?? null;
  const title = id => document.getElementById(id)?.querySelector('title')?.textContent ?? null;
  const ys = id => {
    const d = document.getElementById(id)?.querySelector('path')?.getAttribute('d') ?? '';
    return [...d.matchAll(/[ML]\\s*([-\\d.]+)\\s+([-\\d.]+)/g)].map(m => Number(m[2]));
  };
  const box = id => {
    const r = document.getElementById(id)?.getBoundingClientRect();
    return r ? [r.width, r.height] : null;
  };
  return {
    data: JSON.parse(document.getElementById('report-data').textContent),
    heading: document.querySelector('h1').textContent,
    sections: [...document.querySelectorAll('h2')].map(e => e.id),
    svgs: [...document.querySelectorAll('svg')].map(s => s.getBoundingClientRect().width),
    step0: title('step-time-rank-0'), compute1: title('compute-time-rank-1'),
    step0_ys: ys('step-time-rank-0'), step1_ys: ys('step-time-rank-1'),
    alert: title('alert-1'), alert_box: box('alert-1'),
    trials: [title('trial-0'), title('trial-1')],
    rss0: title('memory-rank-0'),
    alert_label: text('alert-label-1'),
    configs: [text('config-sess1-0-label'), text('config-sess1-1-label')],
    config1: title('config-sess1-1'),
    axes: [...document.querySelectorAll('g[id^="matplotlib.axis_"]')]
      .map(g => [...g.querySelectorAll('text')].at(-1)?.textContent ?? ''),
  };
})()"""


def _check(seen: dict[str, Any]) -> None:
    assert seen["heading"].startswith("Job " + h.JOB)  # shown as text, not run
    assert seen["sections"][:2] == ["ranks", "findings"]
    for section in ("step-time", "phases", "comm-ratio", "memory", "alerts", "tuning"):
        assert section in seen["sections"]
    assert len(seen["svgs"]) == 6 and all(w > 300 for w in seen["svgs"])
    ranks = seen["data"]["ranks"]
    assert [r["median_step_s"] for r in ranks] == pytest.approx([0.105, 0.050])
    assert seen["step0"] == "rank 0: median step time 105 ms, p95 190 ms over 20 steps"
    assert seen["compute1"] == "rank 1: median compute time 45 ms over 20 steps"
    # Rank 0's steps grow by 10 ms each: its line climbs at every one of its 20 points;
    # rank 1's are all 50 ms: a flat line.
    ys0, ys1 = seen["step0_ys"], seen["step1_ys"]
    assert len(ys0) == h.STEPS and all(b < a for a, b in itertools.pairwise(ys0))
    assert len(ys1) == h.STEPS and max(ys1) - min(ys1) < 0.01
    # The alert on the timeline: its hover names rule, rank and start, and it is drawn.
    assert seen["alert"].startswith(f"Straggler rank 1 (high, resolved): {when(h.STRAGGLER_START)}")
    width, height = seen["alert_box"]
    assert width > 10 and height > 5
    assert seen["trials"][0].startswith("trial 0: fp16, bucket 25 MB: 700, kept")
    assert seen["trials"][1].startswith("trial 1: int8, bucket 25 MB: 450, worse")
    assert seen["rss0"] == "rank 0: peak 690 MiB resident"  # (500 + 10 * 19) MiB
    # Plots against the step, time on a second axis; the alert's span names its rule and
    # rank, and each tuning trial's config change is marked with the config it applied.
    assert seen["axes"].count("step") >= 3
    assert "time since the job started (s)" in seen["axes"]
    assert seen["alert_label"] == "Straggler rank 1"
    assert seen["configs"] == ["#0 fp16, bucket 25 MB", "#1 int8, bucket 25 MB"]
    assert "trial 1 applies int8, bucket 25 MB (worse)" in seen["config1"]


async def test_the_written_page_renders_with_its_data(tmp_path: Path) -> None:
    h.make_history(tmp_path / "h.db")
    page = tmp_path / "report.html"
    argv = ["report", h.JOB, "--db", str(tmp_path / "h.db"), "--html", str(page)]
    assert main(argv) == 0
    async with Browser(tmp_path / "profile") as browser:
        await browser.load(page.as_uri())
        seen = await browser.evaluate(_PROBE)
        errors = browser.errors()
    assert errors == []
    _check(seen)


async def test_the_served_page_renders_under_its_security_headers(tmp_path: Path) -> None:
    url = h.make_history(tmp_path / "h.db")
    writer = ThreadPoolExecutor(1)
    store = HistoryStore(url, aggregator_id="a1", writer=writer)
    store.open()
    fakes = Api(store)
    settings = AggregatorSettings(port=0, db_url=url, aggregator_id="a1")
    app = api.make_app(
        settings,
        guard=RequestGuard(settings),
        store=store,
        live=fakes.live,
        commands=fakes.commands,
        tuning=fakes.tuning,
        reports=HistoryReports(lambda: store.engine),
        registry=CollectorRegistry(),
        clock=lambda: h.T0 + 100,
    )
    try:
        async with (
            TestServer(app, host="127.0.0.1") as server,
            Browser(tmp_path / "profile") as browser,
        ):
            await browser.load(str(server.make_url("/")))
            links = await browser.evaluate(
                "[...document.querySelectorAll('a')].map(a => [a.textContent, a.href])"
            )
            assert browser.errors() == []
            assert [text for text, _ in links] == [h.JOB]
            await browser.load(links[0][1])  # the index's link opens the job's page
            seen = await browser.evaluate(_PROBE)
            assert browser.errors() == []
            await browser.load(str(server.make_url("/jobs/nope")))
            assert "No job nope" in await browser.evaluate("document.body.innerText")
    finally:
        writer.shutdown(wait=True)
        store.close()
    _check(seen)
    assert urllib.parse.unquote(links[0][1]).endswith("/jobs/" + h.JOB)
