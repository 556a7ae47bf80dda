"""``torshmon demo`` end to end: aggregator + agent + a real gloo job, history in SQLite."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.test_notify import check_block_kit
from torshmon.aggregator.notify.targets import SlackTarget, WebhookTarget
from torshmon.demo import DemoConfig, run_system
from torshmon.faults import parse_fault
from torshmon.history.query import run_query
from torshmon.report import render_text, report_from_db
from torshmon.report.page import render_page

pytestmark = pytest.mark.integration


def _torshmon(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_demo_runs_the_whole_system_and_summarises_from_sql(tmp_path: Path) -> None:
    done = _torshmon(
        "demo",
        "--steps",
        "25",
        "--hidden",
        "128",
        "--layers",
        "3",
        "--world-size",
        "3",
        cwd=tmp_path,
        # An operator's word for every rank reaches the demo's: the run-queue clocks,
        # off by default, on (the rows below carry their readings).
        env={**os.environ, "TORSHMON_CPU_WAIT": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # nothing from torch, its profiler or warnings
    lines = done.stdout.splitlines()
    # Where its page is while it runs, with the token to sign in with.
    (page,) = [line for line in lines if line.startswith("the job's page")]
    assert re.fullmatch(
        r"the job's page, while the demo runs: http://127\.0\.0\.1:\d+/jobs/demo "
        r"\(sign in with the token [0-9a-f]{32}\)",
        page,
    ), page
    # Progress says a thing once: "waiting for the ranks to start..." came a dozen times.
    assert lines.count("waiting for the ranks to start...") <= 1, done.stdout
    assert all(a != b for a, b in itertools.pairwise(lines)), done.stdout
    assert "samples/s per job (mean step of the slowest rank)" in done.stdout
    assert f"history: sqlite:///{tmp_path / 'torshmon.db'}" in done.stdout
    # It ends with the report, then SQL: hints that work as printed.
    assert lines[-4:-2] == [
        "  torshmon report demo --db torshmon.db",
        "  torshmon report demo --db torshmon.db --html demo.html",
    ], lines[-6:]
    assert "torshmon query --db torshmon.db" in lines[-1]
    # Its ranks said they closed: a report made at once says the job ended.
    report = _torshmon("report", "demo", "--db", "torshmon.db", cwd=tmp_path)
    assert report.returncode == 0 and "backend gloo, ended;" in report.stdout, report.stderr
    assert (tmp_path / "torshmon.db").is_file()
    # Every step of every rank is in the history exactly once, readable through the CLI.
    query = _torshmon(
        "query",
        "--db",
        "torshmon.db",
        "--format",
        "csv",
        "SELECT rank, count(*), count(DISTINCT step), min(step), max(step), "
        "count(cpu_wait_s), count(process_cpu_wait_s) FROM steps GROUP BY rank ORDER BY rank",
        cwd=tmp_path,
    )
    assert query.returncode == 0, query.stderr
    rows = [line.split(",") for line in query.stdout.strip().splitlines()[1:]]
    # cpu_wait_s, process_cpu_wait_s: the kernel's run-queue delay of the training
    # thread and of all the rank's threads, known for every step on Linux with the
    # clocks on ($TORSHMON_CPU_WAIT above).
    assert rows == [[str(r), "25", "25", "1", "25", "25", "25"] for r in range(3)]


def test_the_demos_ranks_keep_the_profilers_lines_to_themselves(tmp_path: Path) -> None:
    """torch's profiler (kineto) prints a line as each evidence capture starts and stops,
    which came between the demo's progress lines; the demo's ranks run with QUIET_RANKS."""
    from torshmon.demo import QUIET_RANKS

    script = "import torch.profiler as p\nwith p.profile():\n    pass\nprint('traced')\n"
    base = {k: v for k, v in os.environ.items() if k not in QUIET_RANKS}
    loud, quiet = (
        subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for env in (base, {**base, **QUIET_RANKS})
    )
    assert "profiler_start" in loud.stderr  # what the demo printed between its lines
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "traced\n", "")


def test_demo_rejects_bad_flags_clearly(tmp_path: Path) -> None:
    done = _torshmon("demo", "--steps", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert "--steps" in done.stderr and "positive integer" in done.stderr
    done = _torshmon("demo", "--inject", "straggler:rank=9", cwd=tmp_path)
    assert done.returncode == 2 and "rank 9" in done.stderr
    done = _torshmon("demo", "--inject", "meteor", cwd=tmp_path)
    assert done.returncode == 2 and "unknown fault kind 'meteor'" in done.stderr


async def test_injected_straggler_fires_names_the_rank_notifies_slack_and_resolves(
    tmp_path: Path,
) -> None:
    received: list[tuple[float, dict[str, Any]]] = []
    hooked: list[dict[str, Any]] = []

    async def slack(request: web.Request) -> web.Response:
        received.append((time.time(), await request.json()))
        return web.Response(text="ok")

    async def webhook(request: web.Request) -> web.Response:
        hooked.append(await request.json())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/services/T000/B000/XXXX", slack)
    app.router.add_post("/hook", webhook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        config = DemoConfig(
            world_size=2,
            steps=220,
            # Compute of ~10 ms per step: at ~3 ms (hidden 256) scheduling noise on a busy
            # 2-core machine is enough to make two ranks look 20% apart for 3 steps.
            hidden=512,
            layers=3,
            db=tmp_path / "history.db",
            step_sleep_s=0.03,
            faults=(parse_fault("straggler:rank=1,slowdown=4,from=40,to=120"),),
            quiet=True,
        )
        result = await run_system(
            config,
            targets=[
                SlackTarget(f"http://127.0.0.1:{port}/services/T000/B000/XXXX"),
                WebhookTarget(f"http://127.0.0.1:{port}/hook"),
            ],
        )
    finally:
        await runner.cleanup()

    stragglers = [a for a in result.alerts if a["rule"] == "Straggler"]
    assert stragglers, f"no Straggler alert; alerts: {result.alerts}"
    # Rank 1 must be named. With two ranks the detector can ALSO name rank 0 (seen in CI:
    # a false positive at world size 2). That precision problem belongs to the detection
    # benchmark (issue 8) and is not asserted away here: it is known and open.
    named = [a for a in stragglers if a["rank"] == 1]
    assert named, stragglers
    alert = named[0]
    assert alert["fired_at_unix_s"] is not None
    assert alert["state"] == "resolved", "the alert must resolve once rank 1 is back to speed"
    assert "rank 1" in alert["annotations"]["summary"]

    messages = [m for _, m in received if "Straggler" in m["text"]]
    assert len(messages) >= 2, [m["text"] for _, m in received]
    for message in messages:
        check_block_kit(message)

    def names_rank_1(text: str) -> bool:
        return "rank 1" in text or "rank: 1" in text.lower()

    firing = [m["text"] for m in messages if "resolved" not in m["text"].lower()]
    resolved = [m["text"] for m in messages if "resolved" in m["text"].lower()]
    assert any(names_rank_1(t) and "demo" in t for t in firing), firing
    assert any(names_rank_1(t) for t in resolved), resolved
    # The firing Straggler's message links its evidence at the demo aggregator's real
    # address (its port was 0, "any free port", in the settings the link came from).
    links = re.findall(r"https?://[^\s\"'<>|]+", str(messages))
    assert f"http://127.0.0.1:{result.port}/api/v1/evidence?job=demo" in links, links
    assert all(link.startswith(f"http://127.0.0.1:{result.port}/") for link in links), links
    assert hooked, "the webhook got no message"
    for payload in hooked:
        assert payload["externalURL"] == f"http://127.0.0.1:{result.port}", payload
        assert {a["generatorURL"] for a in payload["alerts"]} == {payload["externalURL"]}

    # The rows behind it: every step of both ranks, in SQL.
    counts = run_query(
        result.db_url, "SELECT rank, count(*) FROM steps GROUP BY rank ORDER BY rank"
    )
    assert counts.rows == [(0, 220), (1, 220)]

    # torshmon report on that history: both ranks, and the straggler named in its alerts
    # and on the page's timeline.
    report = report_from_db(result.db_url, "demo")
    assert [(r.rank, r.steps) for r in report.ranks] == [(0, 220), (1, 220)]
    text = render_text(report)
    alerts = text.split("Alerts (")[1].split("Tuning sessions")[0]
    assert re.search(r"^Straggler\s+1\s+high\s+\d+\s+[1-9]", alerts, re.M), alerts
    page = render_page(report)
    assert f'<g id="alert-{alert["id"]}"><title>Straggler rank 1 (high, resolved)' in page


async def test_a_rank_with_a_slow_data_loader_is_the_straggler_named_by_its_input(
    tmp_path: Path,
) -> None:
    """Rank 1 waits a step's time for each batch from step 40: its compute is its peers',
    they wait for it in the all-reduce. It is the one paged, with its input phase, and
    the report leads with it; the peers' wait is its consequence, not a finding of its
    own (the detector once compared compute only and named nobody)."""
    config = DemoConfig(
        world_size=3,
        steps=140,
        hidden=512,
        layers=3,
        db=tmp_path / "history.db",
        faults=(parse_fault("slow-input:rank=1,slowdown=1,from=40"),),
        quiet=True,
    )
    result = await run_system(config)
    stragglers = [a for a in result.alerts if a["rule"] == "Straggler"]
    assert {a["rank"] for a in stragglers} == {1}, stragglers
    assert "waiting for its input" in stragglers[0]["annotations"]["summary"]
    report = report_from_db(result.db_url, "demo")
    # Its steps are short (it waits before them), but it trains at the job's pace like
    # every rank: not listed as the fastest.
    rates = {r.rank: r.median_samples_per_s for r in report.ranks}
    assert rates[1] is not None and rates[0] is not None
    assert rates[1] < 1.15 * rates[0], rates
    text = render_text(report)
    headline = text.split("In short: ")[1].split("\n\n")[0]
    assert headline.startswith("rank 1 on node"), headline
    assert "waiting for its input" in " ".join(headline.split())
    findings = text.split("Top findings")[1].split("Alerts (")[0]
    first = findings.split("\n- ")[1]
    assert first.startswith("[critical, straggler, priority 1] rank 1 of job demo is"), first
    for line in findings.split("\n- ")[2:]:
        assert "communication" not in line.split("]")[0] or "explained by" in line, line
