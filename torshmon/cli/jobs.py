"""``demo``, ``run`` and ``tune``: the commands that start or steer a training job."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from torshmon.cli.common import USAGE_ERROR, aggregator_url, fail, http_json, read_token
from torshmon.redact import Redactor, redact_url


def demo(args: argparse.Namespace) -> int:
    try:
        import torshmon.probe  # noqa: F401  (the demo's ranks run the probe, which needs torch)
    except ImportError as exc:
        if exc.name != "torch":
            raise
        print(f"torshmon demo: {exc}", file=sys.stderr)
        return 2
    from torshmon.demo import DemoConfig, run_demo
    from torshmon.faults import FaultError, parse_fault

    if args.max_trials is not None and not args.autotune:
        print("torshmon demo: --max-trials needs --autotune", file=sys.stderr)
        return USAGE_ERROR
    default_steps, default_layers = (3000, 7) if args.autotune else (200, 4)
    try:
        config = DemoConfig(
            world_size=args.world_size,
            steps=args.steps if args.steps is not None else default_steps,
            hidden=args.hidden if args.hidden is not None else 1024,
            layers=args.layers if args.layers is not None else default_layers,
            batch_size=args.batch_size,
            job=args.job,
            db=args.db,
            port=args.port,
            faults=tuple(parse_fault(spec) for spec in args.inject),
            link_rate=args.link_rate,
            autotune=args.autotune,
            tune_max_trials=args.max_trials,
        )
    except (FaultError, ValueError) as exc:
        print(f"torshmon demo: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return run_demo(config)


def run(args: argparse.Namespace, redact: Redactor) -> int:
    from torshmon import zerocode

    try:
        words = zerocode.resolve(args.launch)
    except ValueError as exc:
        return fail("run", redact, str(exc), USAGE_ERROR)
    try:
        zerocode.exec_command(words)
    except OSError as exc:
        return fail("run", redact, f"cannot run {words[0]}: {exc.strerror}", USAGE_ERROR)
    return 0  # not reached: exec replaced this process


def _codec_text(config: Mapping[str, object]) -> str:
    """``powersgd rank 4``, ``topk ratio 0.01``, ``fp16``: a codec with its parameters."""
    params = config.get("codec_params")
    words = [str(config.get("codec"))]
    if isinstance(params, dict):
        words += [f"{name} {value:g}" for name, value in sorted(params.items())]
    return " ".join(words)


def trial_line(trial: Mapping[str, Any], unit: str) -> str:
    """One decided trial of ``GET /api/v1/tuning/trials`` for people: config, decision,
    score with its unit, why (``unit`` is the session's, e.g. samples/s per rank)."""
    config = trial["config"]
    bucket = f"bucket {config.get('bucket_cap_mb'):.3g} MB"
    first = config.get("first_bucket_cap_mb")
    if first is not None and first != config.get("bucket_cap_mb"):
        bucket += f" (first {first:.3g} MB)"
    line = f"trial {trial['trial_index']}: {_codec_text(config)}, {bucket}: {trial['decision']}"
    if trial["score"] is not None:
        line += f": {trial['score']:.4g} {unit or 'per s'}"
    if trial["reason"]:
        line += f" - {trial['reason']}"
    return line


def _untunable(base: str, job: str, token: str | None) -> str | None:
    """Why ``job`` cannot be tuned: the aggregator has no such job, or it has ended
    (every rank's probe said it closed, or its ranks are silent past the report's bound
    by the aggregator's clock); None if it runs (or the aggregator did not answer: its
    answer to the tune request says why)."""
    import email.utils
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    from torshmon.report.model import closed_of, is_running
    from torshmon.report.text import when

    def get(path: str) -> tuple[Any, str | None]:
        request = urllib.request.Request(f"{base}/api/v1/jobs/{path}")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}"), response.headers.get("Date")

    quoted = urllib.parse.quote(job, safe="")
    try:
        row, date = get(quoted)
        ranks, _ = get(f"{quoted}/ranks?limit=10000")  # the newest sessions first
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return f"no job {job!r} on the aggregator at {redact_url(base)}"
        return None
    try:
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else None
        last_seen = float(row["last_seen_unix_ns"]) / 1e9
        closed = closed_of(ranks["ranks"])
    except (TypeError, ValueError, KeyError):
        return None
    if now is None or is_running(last_seen, now, closed=closed):
        return None
    if closed:
        what = f"its ranks closed; their last data came {when(last_seen)}"
    else:
        what = f"nothing from its ranks since {when(last_seen)}, {now - last_seen:.0f} s ago"
    return f"job {job!r} has ended ({what}): only a running job can be tuned"


def tune(args: argparse.Namespace, redact: Redactor) -> int:
    import time
    import urllib.error
    import urllib.parse

    try:
        base = aggregator_url(args, os.environ)
    except ValueError as exc:
        return fail("tune", redact, str(exc), USAGE_ERROR)
    redact.add_url(base)
    token = read_token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "").strip()
    job = urllib.parse.quote(args.job, safe="")
    body: dict[str, object] = {"pinned": list(args.pin)}
    if args.max_trials is not None:
        body["max_trials"] = args.max_trials
    try:
        refusal = _untunable(base, args.job, token or None)
        if refusal is not None:  # else a session would start, then abort on a silent job
            return fail("tune", redact, refusal, USAGE_ERROR)
        status, reply = http_json("POST", f"{base}/api/v1/jobs/{job}/tune", token or None, body)
    except (urllib.error.URLError, OSError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return fail("tune", redact, f"cannot reach {redact_url(base)}: {why}", USAGE_ERROR)
    if status != 201:  # 4xx: an unknown job, a session already running, a bad token
        message = f"HTTP {status}: {reply.get('error', '')}"
        return fail("tune", redact, message, USAGE_ERROR if 400 <= status < 500 else 1)
    session_id = str(reply["session_id"])
    print(f"tuning session {session_id} started for job {args.job}")
    if not args.wait:
        return 0
    printed: set[int] = set()
    while True:
        try:
            trials_status, trials = http_json(
                "GET",
                f"{base}/api/v1/tuning/trials?session_id={session_id}&limit=1000",
                token or None,
            )
            sessions_status, sessions = http_json(
                "GET", f"{base}/api/v1/tuning/sessions?job={job}", token or None
            )
        except (urllib.error.URLError, OSError) as exc:
            return fail("tune", redact, f"lost {redact_url(base)}: {exc}", 1)
        for status, reply in ((trials_status, trials), (sessions_status, sessions)):
            if status != 200:  # else a failing aggregator would be polled forever
                print(f"torshmon tune: {reply.get('error', f'HTTP {status}')}", file=sys.stderr)
                return 1
        listed = sessions.get("sessions", [])
        mine = [s for s in (listed if isinstance(listed, list) else []) if s["id"] == session_id]
        unit = str(mine[0].get("unit") or "") if mine else ""
        rows = trials.get("trials", [])
        for trial in sorted(rows if isinstance(rows, list) else [], key=lambda t: t["trial_index"]):
            if trial["decision"] is None or trial["trial_index"] in printed:
                continue
            printed.add(trial["trial_index"])
            print(trial_line(trial, unit), flush=True)
        if mine and mine[0]["state"] in ("finished", "aborted"):
            print(f"session {mine[0]['state']}: {mine[0].get('summary') or mine[0]['reason']}")
            return 0 if mine[0]["state"] == "finished" else 1
        time.sleep(args.poll_s)
