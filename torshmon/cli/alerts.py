"""``torshmon alerts`` and ``torshmon silence``: the alert lifecycle from a terminal;
``torshmon rules``: the rule files alerts come from.

Both talk to a running aggregator's API (``--aggregator``, the token as for ``tune``)::

    torshmon alerts list --state firing
    torshmon alerts ack 42 --comment "looking at node3"
    torshmon silence add alertname=Straggler job=llm --for 2h --comment "node3 in repair"
    torshmon silence list
    torshmon silence expire 7

Who acts is ``--by``, by default ``user@host`` of whoever runs the command.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Final

from torshmon.cli.common import USAGE_ERROR, aggregator_url, fail, http_json, read_token
from torshmon.redact import Redactor, redact_url

__all__ = ["Call", "add_commands", "lifecycle", "parse_duration", "rules", "run"]

#: One API request: (method, path with query, JSON body or None) -> (status, JSON object).
Call = Callable[[str, str, "dict[str, object] | None"], "tuple[int, Mapping[str, Any]]"]

_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION: Final = re.compile(r"^(?:(\d+(?:\.\d+)?)([smhd]))+$")
_PART: Final = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d12h`` -> seconds; argparse's error otherwise."""
    if not _DURATION.match(text):
        raise argparse.ArgumentTypeError(f"expected a duration like 30m, 2h or 1d12h, got {text!r}")
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(text))
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be more than zero, got {text!r}")
    return seconds


def _matcher(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected LABEL=VALUE, e.g. job=llm, got {text!r}")
    return name, value


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def add_commands(
    command: Callable[..., argparse.ArgumentParser],
    aggregator_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add ``alerts`` and ``silence`` with ``command`` (build_parser's factory);
    ``aggregator_flags`` adds --aggregator and --token-file to a parser."""
    alerts = command("alerts", "list and acknowledge alerts on a running aggregator", env="tune")
    alert_commands = alerts.add_subparsers(dest="alerts_command", required=True)
    listing = alert_commands.add_parser("list", help="alerts, newest first")
    listing.add_argument("--job", help="only this job's")
    listing.add_argument("--state", choices=("pending", "firing", "resolved"))
    listing.add_argument("--limit", type=int, default=50, help="at most this many (50)")
    ack = alert_commands.add_parser("ack", help="acknowledge a pending or firing alert")
    ack.add_argument("id", type=int, help="the alert's id (alerts list)")
    ack.add_argument("--by", default=None, help="who (default user@host)")
    ack.add_argument("--comment", default="", help="what you are doing about it")
    for parser in (listing, ack):
        aggregator_flags(parser)

    silence = command("silence", "mute notifications of matching alerts for a while", env="tune")
    silence_commands = silence.add_subparsers(dest="silence_command", required=True)
    add = silence_commands.add_parser("add", help="add a silence")
    add.add_argument(
        "matchers",
        nargs="+",
        type=_matcher,
        metavar="LABEL=VALUE",
        help="labels an alert must have, e.g. alertname=Straggler job=llm rank=3",
    )
    add.add_argument(
        "--for",
        dest="duration_s",
        metavar="DURATION",
        type=parse_duration,
        required=True,
        help="how long, e.g. 30m, 2h, 1d (at most 30d)",
    )
    add.add_argument("--by", default=None, help="who (default user@host)")
    add.add_argument("--comment", default="", help="why")
    listed = silence_commands.add_parser("list", help="silences, newest first")
    listed.add_argument("--state", choices=("active", "pending", "expired"))
    expire = silence_commands.add_parser("expire", help="end a silence now")
    expire.add_argument("id", type=int, help="the silence's id (silence list)")
    for parser in (add, listed, expire):
        aggregator_flags(parser)


def run(args: argparse.Namespace, call: Call) -> int:
    """Run ``alerts`` or ``silence``; exit status (2: the aggregator refused the request,
    e.g. an unknown id or a wrong token; 1: it failed)."""
    if args.command == "alerts":
        if args.alerts_command == "list":
            return _list_alerts(args, call)
        return _ack(args, call)
    if args.silence_command == "add":
        return _add_silence(args, call)
    if args.silence_command == "list":
        return _list_silences(args, call)
    return _expire_silence(args, call)


def _refused(command: str, status: int, reply: Mapping[str, Any]) -> int:
    print(f"torshmon {command}: HTTP {status}: {reply.get('error', '')}", file=sys.stderr)
    return 2 if 400 <= status < 500 else 1  # a user's mistake is 2 (USAGE_ERROR)


def _when(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _list_alerts(args: argparse.Namespace, call: Call) -> int:
    query = {"limit": str(max(1, min(args.limit, 1000)))}
    if args.job:
        query["job"] = args.job
    if args.state:
        query["state"] = args.state
    status, reply = call("GET", "/api/v1/alerts?" + urllib.parse.urlencode(query), None)
    if status != 200:
        return _refused("alerts", status, reply)
    rows = reply.get("alerts", [])
    print(f"{'id':>6}  {'state':<8}  {'since':<19}  rule / job / rank / acknowledged")
    for row in rows:
        rank = "" if row.get("rank") is None else f" rank {row['rank']}"
        ack = f"  ack: {row['acknowledged_by']}" if row.get("acknowledged_by") else ""
        print(
            f"{row['id']:>6}  {row['state']:<8}  {_when(row.get('starts_at_unix_s')):<19}  "
            f"{row['rule']} / {row['job']}{rank}{ack}"
        )
    return 0


def _ack(args: argparse.Namespace, call: Call) -> int:
    body: dict[str, object] = {"by": args.by or _who(), "comment": args.comment}
    status, reply = call("POST", f"/api/v1/alerts/{args.id}/ack", body)
    if status != 200:
        return _refused("alerts", status, reply)
    row = reply["alert"]
    print(f"alert {row['id']} ({row['rule']}, job {row['job']}) acknowledged by {body['by']}")
    return 0


def _add_silence(args: argparse.Namespace, call: Call) -> int:
    body: dict[str, object] = {
        "matchers": dict(args.matchers),
        "duration_s": args.duration_s,
        "created_by": args.by or _who(),
        "comment": args.comment,
    }
    status, reply = call("POST", "/api/v1/silences", body)
    if status != 201:
        return _refused("silence", status, reply)
    silence = reply["silence"]
    print(f"silence {silence['id']} until {_when(silence['ends_at_unix_s'])}: {_labels(silence)}")
    return 0


def _list_silences(args: argparse.Namespace, call: Call) -> int:
    path = "/api/v1/silences"
    if args.state:
        path += "?state=" + args.state
    status, reply = call("GET", path, None)
    if status != 200:
        return _refused("silence", status, reply)
    print(f"{'id':>6}  {'state':<8}  {'until':<19}  {'by':<20}  matchers / comment")
    for row in reply.get("silences", []):
        comment = f"  # {row['comment']}" if row.get("comment") else ""
        print(
            f"{row['id']:>6}  {row['state']:<8}  {_when(row['ends_at_unix_s']):<19}  "
            f"{row['created_by']:<20}  {_labels(row)}{comment}"
        )
    return 0


def _expire_silence(args: argparse.Namespace, call: Call) -> int:
    status, reply = call("DELETE", f"/api/v1/silences/{args.id}", None)
    if status != 200:
        return _refused("silence", status, reply)
    print(f"silence {args.id} expired")
    return 0


def _labels(silence: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(silence["matchers"].items()))


def lifecycle(args: argparse.Namespace, redact: Redactor) -> int:
    """``alerts`` and ``silence`` against the aggregator's API."""
    import urllib.error

    try:
        base = aggregator_url(args, os.environ)
    except ValueError as exc:
        return fail(args.command, redact, str(exc), USAGE_ERROR)
    redact.add_url(base)
    token = read_token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "").strip()

    def call(
        method: str, path: str, body: dict[str, object] | None
    ) -> tuple[int, Mapping[str, Any]]:
        return http_json(method, base + path, token or None, body)

    try:
        return run(args, call)
    except (urllib.error.URLError, OSError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return fail(args.command, redact, f"cannot reach {redact_url(base)}: {why}", USAGE_ERROR)


def rules(args: argparse.Namespace) -> int:
    from torshmon.aggregator.rule_files import check_rules_cli, export_rules_cli

    if args.rules_command == "check":
        return check_rules_cli(args.file)
    return export_rules_cli(args.file, args.format)
