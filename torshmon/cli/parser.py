"""The command tree: every command, flag, help text and example of ``torshmon``."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from torshmon.cli import alerts
from torshmon.cli.common import DEFAULT_AGGREGATOR_URL, TOKEN_FILE_ENV
from torshmon.version import __version__


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
    of its commands' parsers (``alerts list``: made in alerts)."""
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
    alerts.add_commands(command, _aggregator_flags)
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


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


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
