"""``torshmon report``: the summary of a history with known numbers (tests/report_history.py),
the page's escaping, and one-line errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, update

from tests import report_history as h
from torshmon.aggregator.core.alert_engine import AlertEngine
from torshmon.aggregator.core.bottleneck import JobSnapshot, bottleneck_report, rank_findings
from torshmon.aggregator.core.episodes import FindingEpisodes
from torshmon.aggregator.core.findings import Finding, slowdown_text
from torshmon.aggregator.core.series import SeriesStore
from torshmon.aggregator.notify.slack import slack_payload
from torshmon.aggregator.rule_files import default_rules
from torshmon.cli import main
from torshmon.history.db import make_engine
from torshmon.history.models import Base
from torshmon.history.store import HistoryStore
from torshmon.report import from_json, report_from_db, to_json
from torshmon.report.page import render_page
from torshmon.report.text import render_text, when


@pytest.fixture
def db(tmp_path: Path) -> Path:
    h.make_history(tmp_path / "h.db")
    return tmp_path / "h.db"


def _row(text: str, first_cell: str) -> list[str]:
    """The cells (split on 2+ spaces) of the table row that starts with ``first_cell``."""
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


def test_the_summary_shows_each_rank_the_findings_alerts_and_tuning(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", h.JOB, "--db", str(db)]) == 0
    out = capsys.readouterr().out
    ranks = out.split("Ranks (medians over the steps)")[1].split("Phases")[0]
    # rank, node, steps, median step, p95 step, compute, comm wait, comm %, samples/s
    assert _row(ranks, "0")[:5] == ["0", "node0", "20", "105 ms", "190 ms"]
    assert _row(ranks, "0")[7] == "25%"
    # samples/s over the step's period: 32 samples in 50 ms + 5 ms of input wait (581.8, not
    # the 640 of its step alone, which made a rank late by its input look the fastest)
    assert _row(ranks, "1") == [
        "1",
        "node1",
        "20",
        "50 ms",
        "50 ms",
        "45 ms",
        "5 ms",
        "10%",
        "581.8",
    ]
    phases = out.split("Phases of a step")[1].split("Top findings")[0]
    # 5 ms of input wait before a 50 ms step: forward 20%, backward 50% less 5 ms of comm
    # wait, optimizer 10%, the rest other.
    assert _row(phases, "1") == ["1", "5 ms", "10 ms", "20 ms", "5 ms", "5 ms", "10 ms"]
    assert _row(phases, "0")[1] == "-"
    # Two stored episodes of one straggler finding are one item, with the latest's text.
    findings = " ".join(out.split("Top findings")[1].split("Alerts")[0].split())  # unwrapped
    assert "[high, straggler, priority 1, 2 episodes] " + h.SUMMARY in findings
    assert "rank 1 was slow" not in findings
    since, ended = when(h.T0 + 2), when(h.T0 + 14)
    # The gain is what the steps of the episode (2-14) lose: rank 1 computes 45 ms, rank 0
    # 7.5 ms a step number, so 30, 22.5, 15 and 7.5 ms of steps 2-5 wait for rank 1, of
    # 877.5 ms (the ranks' median periods, (10 i + 55) / 2 ms): 8.5%, not the 30% stored.
    assert f"since {since}, ended {ended}; difficulty medium" in findings
    assert (
        "without it a step would take 61.7 ms instead of 67.5 ms (means over its episode): "
        "the job loses ~9% of its throughput" in findings
    )
    assert "what to do: Check rank 1's node." in findings
    alerts = out.split("Alerts (4 episodes)")[1].split("Tuning sessions")[0]
    # rule, rank, severity, episodes, fired, firing time, first, last ended, now
    assert _row(alerts, "Straggler")[:6] == ["Straggler", "1", "high", "1", "1", "4 s"]
    assert _row(alerts, "High Comm")[:6] == ["High Comm", "-", "high", "3", "0", "0 s"]
    tuning = out.split("Tuning sessions")[1]
    assert "baseline 600, best 700 samples/s" in tuning
    assert _row(tuning, "0")[1:4] == ["fp16, bucket 25 MB", "700", "kept"]
    assert _row(tuning, "1")[1:4] == ["int8, bucket 25 MB", "450", "worse"]


def test_the_report_travels_as_json_unchanged(db: Path) -> None:
    report = report_from_db(f"sqlite:///{db}", h.JOB, now_unix_s=h.T0 + 100)
    assert from_json(to_json(report)) == report
    assert not report.running  # seen last 80 s before the report


def test_the_page_shows_user_text_as_text(db: Path) -> None:
    report = report_from_db(f"sqlite:///{db}", h.JOB, now_unix_s=h.T0 + 100)
    page = render_page(report)
    assert "<script>alert(1)" not in page
    assert "bert&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>now</b>" not in page and "&lt;b&gt;now&lt;/b&gt;" in page
    # The data block cannot be closed early, and it is the report.
    block = page.split('<script type="application/json" id="report-data">')[1]
    data, _, _ = block.partition("</script>")
    assert "<" not in data
    assert json.loads(data)["job"] == h.JOB
    # No script runs: the only <script> element is the JSON block.
    assert page.count("<script") == 1
    assert 'http-equiv="refresh"' not in page  # a stopped job's page stays as it is


def test_bad_input_is_one_line_and_status_2(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database" * 100)
    cases = [
        (["report", "nope", "--db", str(db)], "no job 'nope' in the history"),
        (["report", "j", "--db", str(tmp_path / "missing.db")], "no history database at"),
        (["report", "j", "--db", str(garbage)], "cannot read the history"),
        (["report", "j", "--db", "mysql://x/y"], "supported: sqlite"),
        (["report", "j", "--aggregator", "http://127.0.0.1:1"], "cannot reach"),
        (["report", "j", "--aggregator", "ftp://x"], "is not http(s)://HOST[:PORT]"),
        (["report", h.JOB, "--db", str(db), "--html", str(tmp_path / "no/dir/x.html")],
         "cannot write"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
        assert err.startswith("torshmon report: "), err


def _add_evidence(db: Path) -> None:
    """Evidence rows as the aggregator stores them (history.models' evidence tables)."""
    url = f"sqlite:///{db}"
    engine = make_engine(url)
    tables = Base.metadata.tables
    fingerprint = f"{1:016x}"
    captures = [
        ("c1", 1, None, h.STRAGGLER_START + 3),
        # Asked for by fingerprint before the alert's row existed, during its episode.
        ("c2", None, fingerprint, h.STRAGGLER_START + 1),
        ("c3", None, fingerprint, h.T0 + 100),  # after the episode ended: not its own
    ]
    files = [
        ("c1", 1, "profile.json", "c1/1/profile.json"),
        ("c1", 0, "flight_recorder.json", None),
        ("c2", 1, "fr.json", "c2/1/fr.json"),
        ("c3", 1, "late.json", "c3/1/late.json"),
    ]
    with engine.begin() as conn:
        conn.execute(
            tables["evidence_captures"].insert(),
            [
                {
                    "id": capture,
                    "job": h.JOB,
                    "alert_id": alert_id,
                    "alert_fingerprint": alert_fingerprint,
                    "rule": "Straggler",
                    "profile_ranks": [1],
                    "created_unix_s": created,
                    "aggregator_id": "a1",
                }
                for capture, alert_id, alert_fingerprint, created in captures
            ],
        )
        conn.execute(
            tables["evidence_files"].insert(),
            [
                {
                    "capture_id": capture,
                    "rank": rank,
                    "name": name,
                    "job": h.JOB,
                    "size_bytes": 10,
                    "stored_bytes": 10 if path else 0,
                    "path": path,
                    "error": "" if path else "no file",
                    "taken_unix_s": h.STRAGGLER_START + 4,
                    "received_unix_s": h.STRAGGLER_START + 5,
                }
                for capture, rank, name, path in files
            ],
        )
    engine.dispose()


def test_alerts_link_the_evidence_captured_for_them(db: Path) -> None:
    _add_evidence(db)
    report = report_from_db(f"sqlite:///{db}", h.JOB, now_unix_s=h.T0 + 100)
    (straggler,) = [a for a in report.alerts if a.rule == "Straggler"]
    assert [(e.name, e.url) for e in straggler.evidence] == [
        ("rank 1 profile.json", "/api/v1/evidence/c1/1/profile.json"),
        ("rank 1 fr.json", "/api/v1/evidence/c2/1/fr.json"),
    ]
    assert all(not a.evidence for a in report.alerts if a.rule != "Straggler")
    assert '<a href="/api/v1/evidence/c1/1/profile.json">rank 1 profile.json</a>' in (
        render_page(report)
    )


def test_a_reader_that_leaves_early_gets_no_traceback(db: Path) -> None:
    """`torshmon report JOB | true`: the reader is gone before the report writes (python
    takes far longer to start than `true` to exit), so the write meets a closed pipe;
    the report stops quietly with the shell's SIGPIPE status, as cat does."""
    import shlex
    import subprocess
    import sys

    script = str(Path(sys.executable).with_name("torshmon"))
    command = shlex.join([script, "report", h.JOB, "--db", str(db)])
    done = subprocess.run(
        f"{command} | true; echo ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stderr == ""
    assert done.stdout.strip() == "141"


def _fill_of(svg: str, gid: str) -> str:
    """The fill colour of the first shape in the SVG group ``gid``."""
    group = svg.split(f'<g id="{gid}">', 1)[1]
    match = re.search(r"fill:\s*(#[0-9a-f]{6})", group)
    assert match is not None, gid
    return match.group(1)


def test_the_tuning_chart_colours_each_stored_decision(db: Path) -> None:
    from dataclasses import replace
    from typing import get_args

    from torshmon.aggregator.core.tuner.events import TrialDecision
    from torshmon.report.plots import DECISION_COLORS, UNDECIDED_COLOR, plots

    decisions = get_args(TrialDecision)  # what the tuner stores in tuning_trials.decision
    assert set(DECISION_COLORS) == set(decisions)
    assert len(set(DECISION_COLORS.values()) | {UNDECIDED_COLOR}) == len(decisions) + 1
    report = report_from_db(f"sqlite:///{db}", h.JOB, now_unix_s=h.T0 + 100)
    (template, *_) = report.trials
    trials = [
        replace(template, trial_index=i, decision=d, score=500.0 + i)
        for i, d in enumerate([*decisions, None])
    ]
    svg = plots(replace(report, trials=tuple(trials)))["tuning"]
    for i, decision in enumerate(decisions):
        assert _fill_of(svg, f"trial-{i}") == DECISION_COLORS[decision], decision
    assert _fill_of(svg, f"trial-{len(decisions)}") == UNDECIDED_COLOR
    # The stored history's own trials (kept, worse) are green and red, not grey.
    stored = plots(report)["tuning"]
    assert [_fill_of(stored, f"trial-{i}") for i in (0, 1)] == ["#1a9850", "#d73027"]


def test_a_job_that_ended_before_the_report_is_ended_everywhere(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The history's job was last heard from at T0 + 20: the probes heartbeat every
    second while a rank lives, so 16 s of silence is an end, not a pause. It was shown
    as running for a minute after it ended (a report made right after a demo)."""
    from torshmon.report.model import ENDED_AFTER_S
    from torshmon.report.page import render_index

    last_seen = h.T0 + h.STEPS
    url = f"sqlite:///{db}"
    ended = report_from_db(url, h.JOB, now_unix_s=last_seen + ENDED_AFTER_S + 1)
    live = report_from_db(url, h.JOB, now_unix_s=last_seen + 2)
    assert (ended.running, live.running) == (False, True)
    header = render_text(ended).splitlines()[2]
    assert "backend gloo, ended; first seen" in header, header
    assert "backend gloo, running; first seen" in render_text(live).splitlines()[2]
    page = render_page(ended, refresh_s=15)
    assert '<span class="badge ended">ended</span>' in page
    assert 'http-equiv="refresh"' not in page
    assert 'http-equiv="refresh"' in render_page(live, refresh_s=15)
    # The list of jobs follows the same rule.
    row = {"job": "j", "world_size": 2, "backend": "gloo"}
    row |= {"first_seen_unix_ns": int(h.T0 * 1e9), "last_seen_unix_ns": int(last_seen * 1e9)}
    assert "badge running" not in render_index([row], last_seen + ENDED_AFTER_S + 1)
    assert "badge running" in render_index([row], last_seen + 2)


def test_an_offline_page_links_copies_of_its_evidence_beside_it(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``report --html out.html``: a link to the aggregator's /api/v1/evidence/... is a
    file:///api/... in a browser; the page links copies in out_evidence/ instead."""
    import urllib.parse

    _add_evidence(db)
    # The files of c1 and c2 where the aggregator keeps them (beside a SQLite history);
    # c1's profile is gone (pruned).
    kept = db.with_name(db.name + ".evidence")
    (kept / "c2/1").mkdir(parents=True)
    (kept / "c2/1/fr.json").write_bytes(b"\x1f\x8bflight recorder")
    out = tmp_path / "pages" / "out.html"
    out.parent.mkdir()
    assert main(["report", h.JOB, "--db", str(db), "--html", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"evidence: 1 files in {out.parent / 'out_evidence'}/" in captured.out
    assert captured.err == "evidence not copied: rank 1 profile.json: No such file or directory\n"
    page = out.read_text()
    hrefs = re.findall(r'<a href="([^"]*)">rank 1 [a-z_.]+</a>', page)
    assert hrefs == ["out_evidence/c2/rank1-fr.json.gz"]
    # Relative to the page, as a browser resolves it, it is the stored file.
    copy = out.parent / urllib.parse.unquote(hrefs[0])
    assert copy.read_bytes() == b"\x1f\x8bflight recorder"
    assert "/api/v1/evidence" not in page


# -- causes before symptoms, one number per fact (issue 48) -------------------------------
#
# A three-rank job on nodes n0..n2. Steps 1-10 are healthy (every rank computes 100 ms and
# waits 10 ms in its all-reduce); from step 11 rank 1 computes 150 ms on odd steps and
# 250 ms on even ones while its peers still compute 100 ms and wait for it. A step then
# takes 160 or 260 ms (mean 210 ms); with rank 1 back at its peers' 100 ms it would take
# 110 ms: the job loses 1 - 110/210 = 47.6% of its throughput to the straggler.

CAUSES_JOB = "causes"
CAUSES_T0 = 1_700_000_000.0
STRAGGLER_FROM_STEP = 11
CAUSES_STEPS = 40


def _causes_compute_s(rank: int, step: int) -> float:
    if rank != 1 or step < STRAGGLER_FROM_STEP:
        return 0.100
    return 0.150 if step % 2 else 0.250


def _causes_step_rows() -> list[dict[str, Any]]:
    rows, end = [], CAUSES_T0
    for step in range(1, CAUSES_STEPS + 1):
        duration = max(_causes_compute_s(r, step) for r in range(3)) + 0.010
        end += duration
        for rank in range(3):
            compute = _causes_compute_s(rank, step)
            wait = duration - compute
            rows.append(
                {
                    "job": CAUSES_JOB, "rank": rank, "node": f"n{rank}", "step": step,
                    "end_unix_ns": int(end * 1e9), "duration_s": duration,
                    "comm_wait_s": wait, "compute_s": compute,
                    "communication_time_ratio": wait / duration, "comm_busy_s": wait,
                    "forward_s": compute / 3, "backward_s": compute / 2 + wait,
                    "optimizer_s": compute / 6, "batch_size": 32,
                    "samples_per_s": 32 / duration, "loss": 1.0, "loss_nonfinite": False,
                    "config_version": 0, "input_wait_s": None,
                }
            )  # fmt: skip
    return rows


def _step_end(rows: list[dict[str, Any]], step: int) -> float:
    return max(int(r["end_unix_ns"]) for r in rows if r["step"] == step) / 1e9


def _causes_db(
    path: Path,
    findings: list[dict[str, Any]],
    alerts: list[dict[str, Any]],
    rows: list[dict[str, Any]] | None = None,
) -> str:
    """A history of the job above (or of ``rows``) with ``findings`` and ``alerts``
    rows; its URL."""
    rows = _causes_step_rows() if rows is None else rows
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    t = Base.metadata.tables
    last = _step_end(rows, CAUSES_STEPS)
    with engine.begin() as conn:
        conn.execute(
            t["jobs"].insert(),
            [{"job": CAUSES_JOB, "world_size": 3, "backend": "gloo",
              "first_seen_unix_ns": int(CAUSES_T0 * 1e9), "last_seen_unix_ns": int(last * 1e9),
              "aggregator_id": "a1"}],
        )  # fmt: skip
        conn.execute(t["steps"].insert(), rows)
        if findings:
            conn.execute(t["findings"].insert(), findings)
        if alerts:
            conn.execute(t["alerts"].insert(), alerts)
    engine.dispose()
    return url


def _finding_row(**values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "job": CAUSES_JOB, "rank": None, "metric": None, "score": None, "recommendation": "",
        "category": None, "priority": None, "expected_gain_ratio": None, "difficulty": None,
        "ended_unix_s": None, "aggregator_id": "a1", "details": {},
    }  # fmt: skip
    row.update(values)
    row.setdefault("detected_unix_s", row["since_unix_s"])
    row.setdefault("updated_unix_s", row["since_unix_s"])
    return row


def _rows_as_stored_today() -> list[dict[str, Any]]:
    """The three episodes an aggregator stored before findings were linked: the
    straggler (high), the peers' communication wait (high, 'raise the bucket cap') and
    the efficiency roll-up (critical), each on its own."""
    since = _step_end(_causes_step_rows(), STRAGGLER_FROM_STEP)
    return [
        _finding_row(
            kind="straggler", rank=1, value=0.2, score=2.0, severity="high",
            category="straggler", priority=1, expected_gain_ratio=0.45, difficulty="medium",
            since_unix_s=since,
            summary="rank 1 of job causes computes 2.00x slower than the median of its peers "
            "at the same steps (0.200 s vs 0.100 s)",
            details={"slowdown_ratio": 2.0, "peer_median_s": 0.1, "phase": "compute"},
        ),
        _finding_row(
            kind="bottleneck", metric="communication_time_ratio", value=0.32, score=0.02,
            severity="high", category="communication", priority=2, expected_gain_ratio=0.02,
            difficulty="easy", since_unix_s=since,
            summary="job causes spends 32% of its step time waiting for communication "
            "(threshold 30%)",
            recommendation="raise the DDP bucket cap (bucket_cap_mb)",
        ),
        _finding_row(
            kind="bottleneck", metric="training_efficiency_ratio", value=0.64, score=0.06,
            severity="critical", category="efficiency", priority=3, expected_gain_ratio=0.04,
            difficulty="medium", since_unix_s=since,
            summary="job causes computes only 64% of its step time (threshold 70%)",
            recommendation="fix the other findings of this report, highest priority first",
            details={"rollup": True},
        ),
    ]  # fmt: skip


def _first_lines(text: str, *needles: str) -> list[int]:
    """The index in ``text`` of each of ``needles`` (each must be there)."""
    found = [text.find(n) for n in needles]
    assert -1 not in found, [n for n, i in zip(needles, found, strict=True) if i < 0]
    return found


def test_a_report_leads_with_the_straggler_and_lists_its_symptoms_under_it(
    tmp_path: Path,
) -> None:
    url = _causes_db(tmp_path / "c.db", _rows_as_stored_today(), [])
    report = report_from_db(url, CAUSES_JOB, now_unix_s=CAUSES_T0 + 3600)
    assert [(f.kind, f.category, f.severity) for f in report.findings] == [
        ("straggler", "straggler", "critical"),  # 48% of the throughput: critical
        ("bottleneck", "communication", "high"),
        ("bottleneck", "efficiency", "critical"),  # never above its cause
    ]
    assert [f.priority for f in report.findings] == [1, 2, 3]
    assert [f.explained_by for f in report.findings] == ["", *["straggler:rank=1"] * 2]
    assert report.headline == (
        "rank 1 on node n1 computes 2.00x slower than its peers: the job loses ~48% of "
        "its throughput; check its node"
    )
    text = render_text(report)
    assert f"In short: {report.headline}" in " ".join(text.split())
    findings = text.split("Top findings")[1].split("\nAlerts")[0]
    straggler, wait, rollup = _first_lines(
        findings, "- [critical, straggler, priority 1]", "  - [high, bottleneck, communication",
        "  - [critical, bottleneck, efficiency",
    )  # fmt: skip
    assert straggler < wait < rollup
    unwrapped = " ".join(findings.split())
    assert "(explained by the straggler on rank 1)" in unwrapped
    assert "bucket cap" not in unwrapped  # the wait is for rank 1, not the network
    page = render_page(report)
    body = page.split('id="findings"')[1].split("</h2>", 1)[1]
    straggler, wait, rollup = _first_lines(
        body, '<div class="finding depth0"><span class="badge critical">critical</span> '
        "<b>straggler",
        '<div class="finding depth1"><span class="badge high">high</span> <b>bottleneck · '
        "communication",
        '<div class="finding depth1"><span class="badge critical">critical</span> '
        "<b>bottleneck · efficiency",
    )  # fmt: skip
    assert straggler < wait < rollup
    assert f'<p class="headline" id="headline">{report.headline}</p>' in page


def test_the_what_if_is_the_step_time_without_the_straggler(tmp_path: Path) -> None:
    url = _causes_db(tmp_path / "c.db", _rows_as_stored_today(), [])
    report = report_from_db(url, CAUSES_JOB, now_unix_s=CAUSES_T0 + 3600)
    straggler = report.findings[0]
    # Steps 11-40: 160 and 260 ms (mean 210 ms); rank 1 at its peers' 100 ms: 110 ms.
    assert straggler.step_s == pytest.approx(0.210)
    assert straggler.what_if_step_s == pytest.approx(0.110)
    assert straggler.loss_ratio == pytest.approx(1 - 0.110 / 0.210)
    assert straggler.expected_gain_ratio == straggler.loss_ratio
    unwrapped = " ".join(render_text(report).split())
    assert (
        "without it a step would take 110 ms instead of 210 ms (means over its episode): the "
        "job loses ~48% of its throughput" in unwrapped
    )
    assert "Without it a step would take 110 ms instead of 210 ms" in render_page(report)


async def test_the_alert_the_finding_and_the_report_say_the_same_ratio(
    tmp_path: Path, store: HistoryStore
) -> None:
    """The detector names rank 1 at 6.00x over its first steps and measures 2.40x over
    the episode by the end; the job ends with the alert still open. Its alert was
    written at 6.00x when it fired; everything the report shows says 2.40x, the
    finding's ratio, written the one way (``slowdown_text``)."""
    since = _step_end(_causes_step_rows(), STRAGGLER_FROM_STEP)
    snapshot = JobSnapshot(communication_time_ratio=0.32, training_efficiency_ratio=0.64,
                           step_s=0.21)  # fmt: skip

    def straggler(ratio: float) -> Finding:
        # The detector's contract: score = details["slowdown_ratio"] = the ratio.
        return Finding(
            kind="straggler", labels={"job": CAUSES_JOB, "rank": "1"}, value=0.1 * ratio,
            score=ratio, summary=f"rank 1 is {ratio}x its peers", since_unix_s=since,
            severity="high",
            details={"slowdown_ratio": ratio, "peer_median_s": 0.1, "phase": "compute"},
        )  # fmt: skip

    engine = AlertEngine(default_rules())
    episodes = FindingEpisodes(update_every_s=0.0)
    sent = []
    for now, ratio in ((since + 1, 6.0), (since + 5, 2.4)):
        found = rank_findings(
            bottleneck_report(CAUSES_JOB, snapshot, now), [straggler(ratio)], snapshot
        )
        alerts = engine.evaluate(now, SeriesStore(), found)
        sent += [a for a in alerts if a.rule == "Straggler"]
        await store.record(episodes.evaluate(found, now), alerts, now)
        (named,) = [f for f in found if f.kind == "straggler"]
        assert slowdown_text(ratio) in named.summary and named.score == ratio
    (fired,) = sent  # the alert fired once, at the first figure, and is still open
    assert fired.state == "firing" and slowdown_text(6.0) in fired.annotations["summary"]
    # The rows of the steps, as ingest would have stored them.
    with store.engine.begin() as conn:
        t = Base.metadata.tables
        rows = _causes_step_rows()
        conn.execute(
            t["jobs"].insert(),
            [{"job": CAUSES_JOB, "world_size": 3, "backend": "gloo",
              "first_seen_unix_ns": int(CAUSES_T0 * 1e9),
              "last_seen_unix_ns": int(_step_end(rows, CAUSES_STEPS) * 1e9),
              "aggregator_id": "a1"}],
        )  # fmt: skip
        conn.execute(t["steps"].insert(), rows)
    report = report_from_db(store.url, CAUSES_JOB, now_unix_s=CAUSES_T0 + 3600)
    (finding,) = [f for f in report.findings if f.kind == "straggler"]
    (alert,) = [a for a in report.alerts if a.rule == "Straggler"]
    assert finding.slowdown_ratio == 2.4
    assert "computes 2.40x slower than its peers" in finding.summary
    assert alert.summary == finding.summary
    for shown in (render_text(report), render_page(report)):
        ratios = set(re.findall(r"\b\d+(?:\.\d+)?x\b", shown))
        assert ratios == {"2.40x"}, ratios
    # The alert's resolution carries the episode's figure too, and so does Slack's message.
    (resolved,) = engine.evaluate(since + 9, SeriesStore(), [])
    assert slowdown_text(2.4) in resolved.annotations["summary"]
    slack = json.dumps(slack_payload([resolved], group_key="g"))
    assert set(re.findall(r"\b\d+(?:\.\d+)?x\b", slack)) == {"2.40x"}


def _hung_step_rows() -> list[dict[str, Any]]:
    """40 steps of 100 ms (90 ms compute) on 3 ranks; before step 20's all-reduce rank 2
    stops for 8 s, which its peers spend waiting."""
    rows = []
    for row in _causes_step_rows():
        hung = row["step"] == 20
        compute = 8.09 if hung and row["rank"] == 2 else 0.09
        duration = 8.1 if hung else 0.1
        rows.append(row | {"duration_s": duration, "compute_s": compute,
                           "comm_wait_s": duration - compute, "end_unix_ns": 0})  # fmt: skip
    end = CAUSES_T0
    for step in range(1, CAUSES_STEPS + 1):
        end += 8.1 if step == 20 else 0.1
        for row in rows:
            if row["step"] == step:
                row["end_unix_ns"] = int(end * 1e9)
    return rows


def test_a_hang_leads_with_what_it_cost_the_run(tmp_path: Path) -> None:
    rows = _hung_step_rows()
    since, ended = _step_end(rows, 19) + 0.5, _step_end(rows, 20)
    findings = [
        _finding_row(
            kind="hang", rank=2, value=7.5, score=1.5, severity="critical", since_unix_s=since,
            ended_unix_s=ended,
            summary="rank 2 of job causes never joined all_reduce #20 that ranks 0 and 1 entered",
        ),
        _finding_row(
            kind="bottleneck", metric="communication_time_ratio", value=0.62, severity="critical",
            category="communication", expected_gain_ratio=0.32, difficulty="easy",
            since_unix_s=since, ended_unix_s=ended,
            summary="job causes spends 62% of its step time waiting for communication",
            recommendation="raise the DDP bucket cap (bucket_cap_mb)",
        ),
    ]  # fmt: skip
    url = _causes_db(tmp_path / "h.db", findings, [], rows)
    report = report_from_db(url, CAUSES_JOB, now_unix_s=CAUSES_T0 + 3600)
    assert [(f.kind, f.category, f.explained_by) for f in report.findings] == [
        ("hang", "", ""),
        ("bottleneck", "communication", "hang:rank=2"),
    ]
    hang = report.findings[0]
    # 39 steps of 100 ms and one of 8.1 s: a 300 ms mean; at 100 ms without the hang.
    assert hang.step_s == pytest.approx(0.3)
    assert hang.what_if_step_s == pytest.approx(0.1)
    assert hang.loss_ratio == pytest.approx(2 / 3)
    assert report.headline == (
        "rank 2 of job causes never joined all_reduce #20 that ranks 0 and 1 entered: the job "
        "lost ~67% of its throughput over the run; see where it waits (py-spy dump, the "
        "Flight Recorder dump)"
    )
    unwrapped = " ".join(render_text(report).split())
    assert (
        "without it a step would take 100 ms instead of 300 ms (means over the run): the job "
        "loses ~67% of its throughput" in unwrapped
    )


def test_a_job_whose_ranks_all_closed_is_ended_at_once(db: Path) -> None:
    """The probes' last batch says they closed (close() or process exit): a report made
    a second after the demo ends says "ended", not "running" for a while."""
    from sqlalchemy import insert, update

    from torshmon.history.models import Base

    last_seen = h.T0 + h.STEPS
    url = f"sqlite:///{db}"
    assert report_from_db(url, h.JOB, now_unix_s=last_seen + 1).running  # no word yet
    sessions = Base.metadata.tables["probe_sessions"]
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(update(sessions).values(closed_unix_ns=int(last_seen * 1e9)))
    report = report_from_db(url, h.JOB, now_unix_s=last_seen + 1)
    assert not report.running
    assert "backend gloo, ended; first seen" in render_text(report).splitlines()[2]
    assert '<span class="badge ended">ended</span>' in render_page(report, refresh_s=15)
    # The job relaunched under its name: rank 0's new probe runs, so the job does.
    later = int(last_seen * 1e9) + 1
    row = {"session": "s0-again", "job": h.JOB, "rank": 0, "started_unix_ns": later}
    row |= {"last_seen_unix_ns": later, "last_seq": 1, "dropped_records_total": 0}
    with engine.begin() as conn:
        conn.execute(insert(sessions), [row])
    engine.dispose()
    assert report_from_db(url, h.JOB, now_unix_s=last_seen + 1).running


def test_only_a_straggler_alert_takes_its_findings_sentence(tmp_path: Path) -> None:
    """An alert stored open at the first steps' figure shows the finding's; a slow-link
    alert on the same rank at the same time keeps its own text."""
    since = _step_end(_causes_step_rows(), STRAGGLER_FROM_STEP)

    def alert(id_: int, rule: str, summary: str) -> dict[str, Any]:
        return {
            "id": id_, "fingerprint": f"{id_:016x}", "rule": rule, "severity": "high",
            "state": "firing", "job": CAUSES_JOB, "rank": 1, "labels": {"job": CAUSES_JOB},
            "annotations": {"summary": summary}, "value": 0.6, "starts_at_unix_s": since,
            "fired_at_unix_s": since, "ends_at_unix_s": None, "updated_unix_s": since,
            "aggregator_id": "a1",
        }  # fmt: skip

    link = "Slow network link at rank 1 of job causes: 12 MB/s, 0.25x the median rank's"
    alerts = [
        alert(1, "Straggler", "rank 1 of job causes computes 6.00x slower than its peers"),
        alert(2, "Slow Link", link),
    ]
    url = _causes_db(tmp_path / "c.db", _rows_as_stored_today(), alerts)
    report = report_from_db(url, CAUSES_JOB, now_unix_s=CAUSES_T0 + 3600)
    summaries = {a.rule: a.summary for a in report.alerts}
    assert summaries["Straggler"] == report.findings[0].summary
    assert "2.00x slower" in summaries["Straggler"]
    assert summaries["Slow Link"] == link


def test_each_config_version_names_who_asked_for_it(db: Path) -> None:
    """v1 came from the tuner's trial 0 (its command), v2 as the session ended (the
    tuner keeping its best), v3 from a config command well after it (the API), v4 with
    no command at all (the training script's request_config)."""
    engine = make_engine(f"sqlite:///{db}")
    t = Base.metadata.tables
    applied = {1: h.T0 + 3, 2: h.T0 + 18.5, 3: h.T0 + 91, 4: h.T0 + 95}
    codecs = {1: "fp16", 2: "fp16", 3: "none", 4: "bf16"}
    with engine.begin() as conn:
        conn.execute(
            insert(t["configs"]),
            [
                {"job": h.JOB, "version": v, "bucket_cap_bytes": 25 << 20,
                 "first_bucket_cap_bytes": 1 << 20, "codec": codecs[v], "codec_params": {},
                 "effective_step": 2 + v, "applied_unix_ns": int(at * 1e9)}
                for v, at in applied.items()
            ],
        )  # fmt: skip
        conn.execute(
            insert(t["commands"]),
            [
                {"id": cid, "job": h.JOB, "kind": "config", "args": {}, "status": "applied",
                 "reason": "", "version": v, "effective_step": 2 + v,
                 "created_unix_s": applied[v] - 1, "updated_unix_s": applied[v],
                 "aggregator_id": "a1"}
                for cid, v in (("c-trial0", 1), ("c-best", 2), ("c-api", 3))
            ],
        )  # fmt: skip
        conn.execute(
            update(t["tuning_trials"])
            .where(t["tuning_trials"].c.trial_index == 0)
            .values(command_id="c-trial0")
        )
    engine.dispose()
    report = report_from_db(f"sqlite:///{db}", h.JOB, now_unix_s=h.T0 + 100)
    assert [(c.version, c.requested_by) for c in report.configs] == [
        (1, "autotuner trial 0"),
        (2, "the autotuner"),
        (3, "you, via the API"),
        (4, "you, in the training script"),
    ]
    text = render_text(report).split("Config changes")[1]
    assert _row(text, "v3")[3:] == ["none, bucket 25 MB", "you, via the API"]
    assert _row(text, "v1")[4] == "autotuner trial 0"
