"""The ``torshmon`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torshmon import cli_alerts
from torshmon.redact import RedactingFilter, Redactor, redact_url
from torshmon.version import __version__

log = logging.getLogger("torshmon.cli")

#: Exit status of a user error (bad flag, value, path or URL; a database or aggregator
#: that cannot be reached): one line on stderr, never a traceback. 1 is a failure.
USAGE_ERROR = 2
DEFAULT_AGGREGATOR_URL = "http://127.0.0.1:9470"
TOKEN_FILE_ENV = "TORSHMON_TOKEN_FILE"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


_DB_HELP = (
    "history database: a SQLite file path (./torshmon.db) or a URL (sqlite:///PATH, "
    "postgresql://USER@HOST/DB) ($TORSHMON_DB_URL; default ./torshmon.db)"
)
_QUERY_DB_HELP = (
    "path or URL queries connect with, on PostgreSQL a reader role's ($TORSHMON_QUERY_DB_URL; "
    "default: the history URL as the user torshmon_reader, password from ~/.pgpass)"
)
_TOKEN_HELP = (
    "file holding the bearer token, not empty ($TORSHMON_TOKEN holds the token itself, "
    f"${TOKEN_FILE_ENV} names such a file)"
)

#: The variables each command reads, for its --help; every one is in docs/configuration.md.
_ENVIRONMENT: Mapping[str, tuple[tuple[str, str], ...]] = {
    "agent": (
        ("TORSHMON_AGGREGATOR_URL", "aggregator base URL (--aggregator)"),
        ("TORSHMON_TOKEN, TORSHMON_TOKEN_FILE", "bearer token, or a file holding it"),
        ("TORSHMON_AGENT_*", "the other settings, e.g. TORSHMON_AGENT_SOCKET"),
    ),
    "aggregator": (
        ("TORSHMON_DB_URL", "history database, path or URL (--db)"),
        ("TORSHMON_QUERY_DB_URL", "the reader's URL for queries (--query-db)"),
        ("TORSHMON_TOKEN, TORSHMON_TOKEN_FILE", "bearer token, or a file holding it"),
        ("TORSHMON_ALERTMANAGER_URL", "Alertmanager to push alerts to"),
        ("TORSHMON_SLACK_WEBHOOK_URL", "Slack incoming webhook"),
        ("TORSHMON_AGGREGATOR_*", "the other settings, e.g. TORSHMON_AGGREGATOR_PORT"),
    ),
    "query": (
        ("TORSHMON_DB_URL", "history database, path or URL (--db)"),
        ("TORSHMON_QUERY_DB_URL", "the reader's URL for queries (--query-db)"),
    ),
    "db": (("TORSHMON_DB_URL", "history database, path or URL (--db)"),),
    "report": (
        ("TORSHMON_DB_URL", "history database, path or URL (--db)"),
        ("TORSHMON_QUERY_DB_URL", "the reader's URL the history is read with"),
        ("TORSHMON_TOKEN, TORSHMON_TOKEN_FILE", "bearer token for --aggregator"),
    ),
    "tune": (
        ("TORSHMON_AGGREGATOR_URL", "aggregator base URL (--aggregator)"),
        ("TORSHMON_TOKEN, TORSHMON_TOKEN_FILE", "bearer token, or a file holding it"),
    ),
}


#: Each command's examples, for its --help, by its words after ``torshmon`` ("" is the
#: top level); a test parses every one.
_EXAMPLES: Mapping[str, tuple[str, ...]] = {
    "": (
        "torshmon demo --inject straggler:rank=1,slowdown=2,from=40,to=120",
        "torshmon report demo --html demo.html",
        "torshmon aggregator --help",
    ),
    "demo": (
        "torshmon demo",
        "torshmon demo --inject straggler:rank=1,slowdown=2,from=40,to=120",
        "torshmon demo --inject hang:rank=1,from=50,seconds=8",
        "torshmon demo --autotune --max-trials 6",
    ),
    "agent": (
        "torshmon agent",
        "torshmon agent --aggregator http://aggregator-host:9470 --token-file ~/.torshmon/token",
    ),
    "aggregator": (
        "torshmon aggregator",
        "torshmon aggregator --host 0.0.0.0 --token-file /etc/torshmon/token "
        "--db postgresql://torshmon@db-host/torshmon",
    ),
    "query": (
        'torshmon query "SELECT rank, avg(duration_s) FROM steps GROUP BY rank"',
        "torshmon query --db runs.db --format csv \"SELECT * FROM alerts WHERE job = 'bert'\"",
    ),
    "report": (
        "torshmon report demo",
        "torshmon report demo --html demo.html",
        "torshmon report demo --run 1 --compare -1",
        "torshmon report bert --aggregator http://aggregator-host:9470 --token-file token",
    ),
    "run": (
        "torshmon run -- torchrun --nproc-per-node 2 train.py",
        "torshmon run -- python -m torch.distributed.run --standalone --nproc-per-node 8 train.py",
    ),
    "db": ("torshmon db upgrade --db postgresql://torshmon@db-host/torshmon",),
    "db upgrade": (
        "torshmon db upgrade",
        "torshmon db upgrade --db postgresql://torshmon@db-host/torshmon "
        "--reader-password-file reader.pw",
    ),
    "rules": ("torshmon rules check my-rules.yaml", "torshmon rules export"),
    "rules check": ("torshmon rules check my-rules.yaml",),
    "rules export": ("torshmon rules export", "torshmon rules export my-rules.yaml"),
    "tune": (
        "torshmon tune bert --wait",
        "torshmon tune bert --pin codec --max-trials 8 --aggregator http://aggregator-host:9470",
    ),
    "alerts": ("torshmon alerts list --state firing", "torshmon alerts ack 42 --comment 'on it'"),
    "alerts list": ("torshmon alerts list --state firing", "torshmon alerts list --job bert"),
    "alerts ack": ("torshmon alerts ack 42 --comment 'node 3 is being drained'",),
    "silence": (
        "torshmon silence add alertname=Straggler job=bert --for 2h --comment 'node 3 repair'",
        "torshmon silence list --state active",
        "torshmon silence expire 7",
    ),
    "silence add": (
        "torshmon silence add alertname=Straggler job=bert --for 2h --comment 'node 3 repair'",
        "torshmon silence add job=bert rank=3 --for 30m",
    ),
    "silence list": ("torshmon silence list", "torshmon silence list --state active"),
    "silence expire": ("torshmon silence expire 7",),
}


def _add_examples(parser: argparse.ArgumentParser, words: str = "") -> None:
    """Put ``_EXAMPLES[words]`` at the top of the epilog of ``parser`` and, recursively,
    of its commands' parsers (``alerts list``: made in cli_alerts)."""
    examples = "examples:\n" + "\n".join(f"  {line}" for line in _EXAMPLES[words])
    parser.epilog = examples + (f"\n\n{parser.epilog}" if parser.epilog else "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _add_examples(sub, f"{words} {name}".strip())


def _epilog(*commands: str) -> str:
    rows = dict(row for command in commands for row in _ENVIRONMENT[command])
    width = max(map(len, rows))
    lines = [f"  {name:<{width}}  {what}" for name, what in rows.items()]
    return "environment:\n" + "\n".join(lines) + "\n\nAll settings: docs/configuration.md"


def _common_flags(*, config: bool) -> argparse.ArgumentParser:
    """Flags every command takes after its name too (``torshmon agent -v``).

    Their default is SUPPRESS, so that a subcommand's parser leaves the value the main
    parser read (``torshmon -v agent``) alone unless the flag is given again.
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level"
    )
    if config:
        common.add_argument(
            "--config", type=Path, default=argparse.SUPPRESS, help="YAML file of settings"
        )
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torshmon",
        description="Monitor and tune distributed PyTorch training.",
        epilog=_epilog("agent", "aggregator", "query", "tune"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"torshmon {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--config", type=Path, help="YAML file of settings (agent and aggregator)")
    commands = parser.add_subparsers(dest="command", required=True)
    plain, configured = _common_flags(config=False), _common_flags(config=True)

    def command(
        name: str, help: str, *, config: bool = False, env: str | None = None
    ) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=help,
            parents=[configured if config else plain],
            epilog=_epilog(env) if env else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    demo = command("demo", "run a real multi-process gloo DDP job with the probe attached")
    demo.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    demo.add_argument(
        "--steps",
        type=_positive_int,
        help="steps (default 200; with --autotune an upper bound, default 3000)",
    )
    demo.add_argument("--hidden", type=_positive_int, help="MLP width (default 1024)")
    demo.add_argument(
        "--layers",
        type=_positive_int,
        help="MLP depth (default 4, a 16.8 MB model; with --autotune 7, 29.4 MB)",
    )
    demo.add_argument("--batch-size", type=_positive_int, default=64, help="per rank (default 64)")
    demo.add_argument("--job", default="demo", help="job name (default 'demo')")
    demo.add_argument(
        "--db",
        default="torshmon.db",
        help="SQLite history: a file path or a sqlite:///PATH URL (default ./torshmon.db)",
    )
    demo.add_argument(
        "--port", type=_port, default=0, help="aggregator port (default: any free port)"
    )
    demo.add_argument(
        "--link-rate",
        metavar="RATE",
        help="shape every rank's link to RATE, e.g. 1gbit or 200mbit (needs root and iproute2)",
    )
    demo.add_argument(
        "--autotune",
        action="store_true",
        help="tune the job while it runs (as 'torshmon tune' does), print each trial and the "
        "result; the job stops once the session ends",
    )
    demo.add_argument(
        "--max-trials",
        type=_positive_int,
        help="with --autotune: configs to measure, the baseline included (default 12)",
    )
    demo.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND[:k=v,...]",
        help=(
            "inject a fault for real (repeatable): straggler, regression, hang, memory-leak, "
            "loss-spike or slow-link, e.g. straggler:rank=1,slowdown=0.5,from=40,to=120; "
            "see docs/faults.md"
        ),
    )
    agent = command(
        "agent",
        "the per-node daemon: serves the probes, spools, forwards, /metrics",
        config=True,
        env="agent",
    )
    agent.add_argument("--socket", help="probe socket (default $TORSHMON_AGENT_SOCKET)")
    agent.add_argument(
        "--socket-group",
        help="make the socket 0660 with this group, for training users of another uid "
        "($TORSHMON_AGENT_SOCKET_GROUP; default: 0600, the agent's user only)",
    )
    agent.add_argument("--metrics-host", default=None, help="/metrics address (127.0.0.1)")
    agent.add_argument("--metrics-port", type=_port, default=None, help="/metrics port (9465)")
    _url_flag(agent, "aggregator base URL, e.g. http://host:9470 ($TORSHMON_AGGREGATOR_URL)")
    agent.add_argument("--token-file", type=Path, help=_TOKEN_HELP)
    agent.add_argument("--spool", help="spool file ($TORSHMON_AGENT_SPOOL)")
    agent.add_argument("--spool-max-mb", type=_positive_int, help="spool bound in MiB (256)")
    agent.add_argument("--node", help="node name (the hostname)")
    agent.add_argument("--agent-id", help="agent id (the node name)")
    agent.add_argument(
        "--sample-interval-s", help="node sampling interval: seconds, or 500ms, 1m (2)"
    )

    aggregator = command(
        "aggregator",
        "the central daemon: ingest, history, detection, alerts, API",
        config=True,
        env="aggregator",
    )
    aggregator.add_argument("--host", help="listen address (127.0.0.1)")
    aggregator.add_argument("--port", type=_port, help="listen port (9470)")
    aggregator.add_argument("--db", help=_DB_HELP)
    aggregator.add_argument("--query-db", help=_QUERY_DB_HELP)
    aggregator.add_argument(
        "--token-file", type=Path, help=_TOKEN_HELP + "; needed unless --host is loopback"
    )
    aggregator.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="NAME",
        help="a Host name the API answers to besides loopback, IP literals, --host and the "
        "external URL's host (repeatable; $TORSHMON_ALLOWED_HOSTS, comma-separated)",
    )
    aggregator.add_argument("--rules", help="alert rule file (the default rules otherwise)")
    aggregator.add_argument("--id", dest="aggregator_id", help="this aggregator's id (shard)")

    query = command("query", "read-only SQL on the history", env="query")
    query.add_argument("sql", help='e.g. "SELECT rank, avg(duration_s) FROM steps GROUP BY rank"')
    query.add_argument("--db", help=_DB_HELP)
    query.add_argument("--query-db", help=_QUERY_DB_HELP)
    query.add_argument("--format", choices=("table", "csv", "json"), default="table")
    query.add_argument("--max-rows", type=_positive_int, default=10000)

    report = command(
        "report", "a job's summary from the history: ranks, phases, findings, alerts", env="report"
    )
    report.add_argument("job", help="job name")
    source = report.add_mutually_exclusive_group()
    source.add_argument("--db", help=_DB_HELP)
    _url_flag(
        source, "read the history through this aggregator instead, e.g. " + DEFAULT_AGGREGATOR_URL
    )
    report.add_argument("--token-file", type=Path, help=_TOKEN_HELP)
    report.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="also write the report as one self-contained HTML page with plots; the "
        "evidence its alerts link to is copied beside it (out_evidence/ for out.html)",
    )
    report.add_argument(
        "--evidence-dir",
        metavar="DIR",
        help="with --db: the aggregator's evidence folder ($TORSHMON_EVIDENCE_DIR; default "
        "beside a SQLite history, <db>.evidence)",
    )
    _run_flags(report)

    db = command("db", "history database maintenance", env="db")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser(
        "upgrade",
        help="apply the Alembic migrations to head",
        parents=[plain],
        epilog=_epilog("db"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    upgrade.add_argument("--db", help=_DB_HELP)
    upgrade.add_argument(
        "--reader-role",
        default="torshmon_reader",
        help="PostgreSQL: the login role queries connect as, made or updated (torshmon_reader)",
    )
    upgrade.add_argument(
        "--reader-password-file",
        type=Path,
        help="PostgreSQL: file holding the reader role's password (none is set without it)",
    )

    rules = command("rules", "alert rule files")
    rules_commands = rules.add_subparsers(dest="rules_command", required=True)
    check = rules_commands.add_parser("check", help="validate a rule file", parents=[plain])
    check.add_argument("file", type=Path)
    export = rules_commands.add_parser(
        "export", help="export rules for another system", parents=[plain]
    )
    export.add_argument("file", type=Path, nargs="?", help="rule file (the default rules)")
    export.add_argument("--format", choices=("prometheus",), default="prometheus")

    tune = command("tune", "start an autotuning session for a running job", env="tune")
    tune.add_argument("job", help="job name")
    _aggregator_flags(tune)
    tune.add_argument("--max-trials", type=_positive_int, help="configs to measure (12)")
    tune.add_argument(
        "--pin",
        action="append",
        default=[],
        choices=("bucket_cap_mb", "codec"),
        help="keep this knob at the job's own value (repeatable)",
    )
    tune.add_argument("--wait", action="store_true", help="print trials until the session ends")
    tune.add_argument("--poll-s", type=float, default=2.0, help=argparse.SUPPRESS)
    run = command(
        "run", "run a launcher (torchrun) with the probe attached to an unmodified script"
    )
    run.add_argument(
        "launch", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run"
    )
    cli_alerts.add_commands(command, _aggregator_flags)
    _add_examples(parser)
    return parser


def _url_flag(parser: argparse.ArgumentParser | argparse._ActionsContainer, help: str) -> None:
    """``--aggregator URL``, the one name of the aggregator's URL on every command
    (``args.aggregator``); ``--url``, which some commands took, stays as a hidden alias."""
    parser.add_argument("--aggregator", metavar="URL", help=help)
    parser.add_argument("--url", dest="aggregator", help=argparse.SUPPRESS)


def _aggregator_flags(parser: argparse.ArgumentParser) -> None:
    """--aggregator and --token-file: the commands that talk to a running aggregator."""
    _url_flag(
        parser,
        f"aggregator base URL ($TORSHMON_AGGREGATOR_URL; default {DEFAULT_AGGREGATOR_URL})",
    )
    parser.add_argument("--token-file", type=Path, help=_TOKEN_HELP)


class _TokenError(Exception):
    """--token-file could not be read or is empty; the text says why."""


def _token(args: argparse.Namespace, redact: Redactor, env: Mapping[str, str]) -> str | None:
    """The bearer token in ``--token-file``, else (with ``$TORSHMON_TOKEN`` unset, which
    the settings read themselves) in the file ``$TORSHMON_TOKEN_FILE`` names; None
    without either. From now on scrubbed by ``redact``; _TokenError if unreadable or empty.

    Read when the command runs, not while parsing, so command lines can be checked
    (docs, unit files) without the secret at hand.
    """
    path, source = args.token_file, "--token-file"
    if path is None and not env.get("TORSHMON_TOKEN") and env.get(TOKEN_FILE_ENV):
        path, source = Path(env[TOKEN_FILE_ENV]), TOKEN_FILE_ENV
    if path is None:
        return None
    try:
        token = str(path.read_text().strip())
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise _TokenError(f"cannot read {source} {path}: {why}") from None
    if not token:
        # Else every agent is refused (or, for the aggregator, the API would take "").
        raise _TokenError(f"{source} {path} is empty; put the bearer token in it")
    redact.add(token)
    return token


#: Variables that hold a secret whole, or a URL that may carry credentials.
_SECRET_VARS = ("TORSHMON_TOKEN", "TORSHMON_WEBHOOK_TOKEN")
_URL_VARS = (
    "TORSHMON_DB_URL",
    "TORSHMON_QUERY_DB_URL",
    "TORSHMON_AGGREGATOR_URL",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


def _redactor(args: argparse.Namespace, env: Mapping[str, str]) -> Redactor:
    """The secrets this command was given on its command line and in its environment."""
    redact = Redactor()
    for var in _SECRET_VARS:
        redact.add(*(item.strip() for item in env.get(var, "").split(",")))
    for var in _URL_VARS:
        redact.add_url(env.get(var))
    for flag in ("db", "query_db", "aggregator"):
        value = getattr(args, flag, None)
        if isinstance(value, str):  # demo's --db is a file
            redact.add_url(value)
    return redact


def _run_run(args: argparse.Namespace, redact: Redactor) -> int:
    from torshmon import zerocode

    try:
        words = zerocode.resolve(args.launch)
    except ValueError as exc:
        return _fail("run", redact, str(exc), USAGE_ERROR)
    try:
        zerocode.exec_command(words)
    except OSError as exc:
        return _fail("run", redact, f"cannot run {words[0]}: {exc.strerror}", USAGE_ERROR)
    return 0  # not reached: exec replaced this process


def _fail(command: str, redact: Redactor, message: str, code: int) -> int:
    """Print ``torshmon COMMAND: message`` with the secrets scrubbed; returns ``code``."""
    print(redact(f"torshmon {command}: {message}"), file=sys.stderr)
    return code


def _db_error(exc: Exception) -> str:
    """A database failure in a few words: the driver's message, not SQLAlchemy's wrapper
    (which adds the statement and a link), on one line."""
    from sqlalchemy.exc import DBAPIError

    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return " ".join(f"{type(orig or exc).__name__}: {orig or exc}".split())


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _run_agent(args: argparse.Namespace, redact: Redactor) -> int:
    import asyncio

    from torshmon.agent.daemon import run_agent
    from torshmon.agent.settings import load_settings
    from torshmon.agent.spool import SpoolError

    token = _token(args, redact, os.environ)
    try:
        overrides = dict(
            socket_path=args.socket,
            socket_group=args.socket_group,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            aggregator_url=args.aggregator,
            token=token,
            spool_path=args.spool,
            spool_max_bytes=args.spool_max_mb * 1024 * 1024 if args.spool_max_mb else None,
            node=args.node,
            agent_id=args.agent_id,
            sample_interval_s=args.sample_interval_s,
        )
        settings = load_settings(overrides, config_file=args.config)
        # The config file may hold secrets of its own.
        redact.add(settings.token)
        redact.add_url(settings.aggregator_url)
    except ValueError as exc:
        return _fail("agent", redact, str(exc), USAGE_ERROR)
    try:
        return asyncio.run(run_agent(settings, announce=_announcer(redact)))
    except (OSError, SpoolError) as exc:
        # An unsafe folder or file (UnsafePathError), a taken port, a locked spool.
        return _fail("agent", redact, f"cannot start: {exc}", USAGE_ERROR)


def _run_demo(args: argparse.Namespace) -> int:
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


def _run_aggregator(args: argparse.Namespace, redact: Redactor) -> int:
    import asyncio

    import psycopg
    from sqlalchemy.exc import SQLAlchemyError

    from torshmon.aggregator.core.rules import RuleError
    from torshmon.aggregator.notify.targets import AlertmanagerTarget, WebhookTarget
    from torshmon.aggregator.service import run_aggregator
    from torshmon.aggregator.settings import SettingsError, load_settings
    from torshmon.history.db import DatabaseConfigError

    overrides: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "db_url": args.db,
        "query_db_url": args.query_db,
        "rules_path": args.rules,
        "aggregator_id": args.aggregator_id,
        "allowed_hosts": args.allowed_hosts,
    }
    overrides["token"] = _token(args, redact, os.environ)
    try:
        settings = load_settings(overrides, config_file=args.config)
        # The config file may hold secrets of its own.
        redact.add(settings.token)
        redact.add_url(settings.db_url)
        redact.add_url(settings.query_db_url)
        redact.add_url(settings.otlp_endpoint)
        for target in settings.notify.targets():  # a webhook URL is a secret whole
            url = target.base_url if isinstance(target, AlertmanagerTarget) else target.url
            redact.add_url(url, secret_path=True)
            if isinstance(target, WebhookTarget):
                redact.add(target.bearer_token)
        return asyncio.run(run_aggregator(settings, announce=_announcer(redact)))
    except (SettingsError, RuleError, DatabaseConfigError) as exc:
        return _fail("aggregator", redact, str(exc), USAGE_ERROR)
    except (SQLAlchemyError, psycopg.Error) as exc:
        message = f"cannot open the history {redact_url(settings.db_url)}: {_db_error(exc)}"
        return _fail("aggregator", redact, message, USAGE_ERROR)
    except OSError as exc:  # a taken port, an address not on this host, a folder
        return _fail("aggregator", redact, f"cannot start: {exc}", USAGE_ERROR)


def _run_query(args: argparse.Namespace, redact: Redactor) -> int:
    from torshmon.history.db import DatabaseConfigError, as_db_url, db_url
    from torshmon.history.query import HistoryUnreachable, QueryError, format_result, run_query
    from torshmon.history.reader import query_db_url

    try:
        explicit = as_db_url(args.query_db) if args.query_db else None
        url = query_db_url(explicit, db_url(args.db))
        result = run_query(url, args.sql, max_rows=args.max_rows)
    except (HistoryUnreachable, DatabaseConfigError) as exc:
        return _fail("query", redact, str(exc), USAGE_ERROR)
    except QueryError as exc:  # the statement itself: refused, or an SQL error
        return _fail("query", redact, str(exc), USAGE_ERROR)
    print(format_result(result, args.format))
    if result.truncated:
        print(
            f"(truncated to {len(result.rows)} rows: --max-rows {args.max_rows} "
            "or the cap on an answer's size)",
            file=sys.stderr,
        )
    return 0


def _run_flags(report: argparse.ArgumentParser) -> None:
    """``report``'s choice of runs: which launch of the job, and another beside it."""
    report.add_argument(
        "--run",
        metavar="RUN",
        help="which launch of the job: its run id, or its number (1 the first, -1 the "
        "latest); default the latest",
    )
    report.add_argument(
        "--compare",
        metavar="RUN",
        help="put this run beside the one shown (--run, else the latest): step time, "
        "throughput, communication, findings",
    )


def _run_report(args: argparse.Namespace, redact: Redactor) -> int:
    from torshmon.history.db import DatabaseConfigError, db_url
    from torshmon.history.reader import query_db_url
    from torshmon.report import ReportError, render_text
    from torshmon.report.source import (
        evidence_from_aggregator,
        evidence_from_db,
        report_from_aggregator,
        report_from_db,
        save_evidence,
    )

    try:
        if args.aggregator is not None:
            base = _aggregator_url(args, {})
            token = _token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "")
            runs = [args.run] if args.compare is None else [args.run, args.compare]
            found = [report_from_aggregator(base, args.job, token.strip() or None, r) for r in runs]
            read_evidence = evidence_from_aggregator(base, token.strip() or None)
        else:
            url = db_url(args.db)
            runs = [args.run] if args.compare is None else [args.run, args.compare]
            found = [report_from_db(query_db_url(None, url), args.job, run=r) for r in runs]
            read_evidence = evidence_from_db(url, args.evidence_dir)
    except (ReportError, DatabaseConfigError, ValueError) as exc:
        return _fail("report", redact, str(exc), USAGE_ERROR)
    report = found[0]
    if len(found) == 2:
        from torshmon.report.compare import render_comparison

        print(render_comparison(*found), end="")
    else:
        print(render_text(report), end="")
    if args.html is not None:
        from torshmon.report.page import render_page

        try:
            # The page is a file: its evidence links lead to copies beside it.
            saved = save_evidence(report, args.html, read_evidence)
            args.html.write_text(render_page(saved.report), encoding="utf-8")
        except OSError as exc:
            where = exc.filename or args.html
            return _fail("report", redact, f"cannot write {where}: {exc.strerror}", USAGE_ERROR)
        print(f"page written to {args.html}")
        if saved.written:
            print(f"evidence: {saved.written} files in {saved.folder}/, linked from the page")
        for line in saved.missing:
            print(f"evidence not copied: {line}", file=sys.stderr)
    return 0


def _run_db(args: argparse.Namespace, redact: Redactor) -> int:
    import psycopg
    from sqlalchemy.exc import SQLAlchemyError

    from torshmon.history.db import DatabaseConfigError, db_url
    from torshmon.history.migrate import upgrade

    url = db_url(args.db)
    try:
        password = None
        if args.reader_password_file is not None:
            password = args.reader_password_file.read_text().strip()
            redact.add(password)
        reader = upgrade(url, reader_role=args.reader_role, reader_password=password)
    except DatabaseConfigError as exc:
        return _fail("db upgrade", redact, str(exc), USAGE_ERROR)
    except (SQLAlchemyError, psycopg.Error, OSError) as exc:
        # A path that cannot be written, a server that is down, a login refused.
        message = f"cannot upgrade {redact_url(url)}: {_db_error(exc)}"
        return _fail("db upgrade", redact, message, USAGE_ERROR)
    except Exception as exc:  # any other failure is reported, with the URL's secrets scrubbed
        return _fail("db upgrade", redact, _db_error(exc), 1)
    print(f"history database at head: {redact_url(url)}")
    if reader is not None:
        if reader.refused:
            print(
                f"torshmon db upgrade: {reader.refused}; name another --reader-role",
                file=sys.stderr,
            )
            return USAGE_ERROR
        if reader.for_admin:
            print(
                f"queries connect as the reader role {reader.role}, which this database "
                "user may not set up; an administrator should run:"
            )
            for statement in reader.for_admin:
                print(f"  {statement}" if statement.startswith("--") else f"  {statement};")
        elif reader.done:
            print(f"reader role {reader.role} set up ({len(reader.done)} statements)")
        else:
            print(f"reader role {reader.role} up to date")
    return 0


def _http_json(
    method: str, url: str, token: str | None, body: dict[str, object] | None = None
) -> tuple[int, dict[str, object]]:
    """(status, JSON object) of one request; HTTP errors are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body if body is not None else {}).encode() if method != "GET" else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:  # the aggregator refuses any other body (a web page could send it)
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"{}")
        except ValueError:
            payload = {}
        return exc.code, payload if isinstance(payload, dict) else {}


def _aggregator_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """``--aggregator``, else ``$TORSHMON_AGGREGATOR_URL``, else the local default;
    ValueError for anything but an http(s) URL with a host."""
    import urllib.parse

    url = args.aggregator or env.get("TORSHMON_AGGREGATOR_URL") or DEFAULT_AGGREGATOR_URL
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"aggregator URL {redact_url(url)!r} is not http(s)://HOST[:PORT], "
            f"e.g. {DEFAULT_AGGREGATOR_URL}"
        )
    return url.rstrip("/")


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


def _run_tune(args: argparse.Namespace, redact: Redactor) -> int:
    import time
    import urllib.error
    import urllib.parse

    try:
        base = _aggregator_url(args, os.environ)
    except ValueError as exc:
        return _fail("tune", redact, str(exc), USAGE_ERROR)
    redact.add_url(base)
    token = _token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "").strip()
    job = urllib.parse.quote(args.job, safe="")
    body: dict[str, object] = {"pinned": list(args.pin)}
    if args.max_trials is not None:
        body["max_trials"] = args.max_trials
    try:
        refusal = _untunable(base, args.job, token or None)
        if refusal is not None:  # else a session would start, then abort on a silent job
            return _fail("tune", redact, refusal, USAGE_ERROR)
        status, reply = _http_json("POST", f"{base}/api/v1/jobs/{job}/tune", token or None, body)
    except (urllib.error.URLError, OSError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return _fail("tune", redact, f"cannot reach {redact_url(base)}: {why}", USAGE_ERROR)
    if status != 201:  # 4xx: an unknown job, a session already running, a bad token
        message = f"HTTP {status}: {reply.get('error', '')}"
        return _fail("tune", redact, message, USAGE_ERROR if 400 <= status < 500 else 1)
    session_id = str(reply["session_id"])
    print(f"tuning session {session_id} started for job {args.job}")
    if not args.wait:
        return 0
    printed: set[int] = set()
    while True:
        try:
            trials_status, trials = _http_json(
                "GET",
                f"{base}/api/v1/tuning/trials?session_id={session_id}&limit=1000",
                token or None,
            )
            sessions_status, sessions = _http_json(
                "GET", f"{base}/api/v1/tuning/sessions?job={job}", token or None
            )
        except (urllib.error.URLError, OSError) as exc:
            return _fail("tune", redact, f"lost {redact_url(base)}: {exc}", 1)
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


def _run_lifecycle(args: argparse.Namespace, redact: Redactor) -> int:
    """``alerts`` and ``silence`` (torshmon.cli_alerts) against the aggregator's API."""
    import urllib.error

    try:
        base = _aggregator_url(args, os.environ)
    except ValueError as exc:
        return _fail(args.command, redact, str(exc), USAGE_ERROR)
    redact.add_url(base)
    token = _token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "").strip()

    def call(
        method: str, path: str, body: dict[str, object] | None
    ) -> tuple[int, Mapping[str, Any]]:
        return _http_json(method, base + path, token or None, body)

    try:
        return cli_alerts.run(args, call)
    except (urllib.error.URLError, OSError) as exc:
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return _fail(args.command, redact, f"cannot reach {redact_url(base)}: {why}", USAGE_ERROR)


def _run_rules(args: argparse.Namespace) -> int:
    from torshmon.aggregator.rule_files import check_rules_cli, export_rules_cli

    if args.rules_command == "check":
        return check_rules_cli(args.file)
    return export_rules_cli(args.file, args.format)


def _announcer(redact: Redactor) -> Callable[[str], None]:
    """Where a daemon says, once, where it listens and stores: stdout, with -v or not."""

    def announce(line: str) -> None:
        print(redact(line), flush=True)

    return announce


#: The import names of the ``aggregator`` extra's packages (pyproject.toml): what the
#: aggregator, the report, ``query --db`` and ``db`` need beyond a training host's install.
AGGREGATOR_PACKAGES: frozenset[str] = frozenset(
    {"sqlalchemy", "alembic", "psycopg", "scipy", "optuna", "opentelemetry", "matplotlib", "jinja2"}
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is not None and args.command not in ("agent", "aggregator"):
        parser.error(f"--config is for agent and aggregator, not {args.command}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Alembic tells at INFO which dialect it runs on and each migration; the daemons'
    # own start line says what matters.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    redact = _redactor(args, os.environ)
    # On the handlers: every record reaches them, libraries' (SQLAlchemy, the OTLP
    # exporter, aiohttp) included, and tracebacks are scrubbed there too.
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter(redact))
    try:
        return _dispatch(args, redact)
    except _TokenError as exc:
        return _fail(args.command, redact, str(exc), USAGE_ERROR)
    except KeyboardInterrupt:
        # Ctrl-C before a daemon installed its own handler (while it imports or starts).
        return 130
    except BrokenPipeError:
        # The reader left (`torshmon report JOB | head`): nothing more to say, as cat.
        # Python would still flush stdout at exit and print its own error: point it at
        # /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for such a reader
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != "torshmon":
            # A dependency missing (an install with --no-deps or --target): say which.
            package = exc.name.partition(".")[0]
            extra = "'torshmon[aggregator]'" if package in AGGREGATOR_PACKAGES else "torshmon"
            return _fail(
                args.command,
                redact,
                f"needs the Python package {package!r}, which is not installed here "
                f"(pip install {extra} brings it)",
                1,
            )
        log.exception("torshmon %s failed", args.command)  # our own module: a broken install
        return 1
    except Exception:
        # A bug: its traceback goes through the scrubbing log handler, not straight out.
        log.exception("torshmon %s failed", args.command)
        return 1


def _dispatch(args: argparse.Namespace, redact: Redactor) -> int:
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "agent":
        return _run_agent(args, redact)
    if args.command == "aggregator":
        return _run_aggregator(args, redact)
    if args.command == "query":
        return _run_query(args, redact)
    if args.command == "db":
        return _run_db(args, redact)
    if args.command == "report":
        return _run_report(args, redact)
    if args.command == "rules":
        return _run_rules(args)
    if args.command in ("tune", "run"):
        return {"tune": _run_tune, "run": _run_run}[args.command](args, redact)
    if args.command in ("alerts", "silence"):
        return _run_lifecycle(args, redact)
    raise AssertionError(f"unhandled command {args.command}")  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
