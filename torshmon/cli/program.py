"""``torshmon``: parse the command line, scrub secrets from what is printed and logged,
run the command, and turn its failure into an exit status (0 done, 1 failed, 2 a user's
mistake, 130 Ctrl-C, 141 a reader that left) and one line on stderr."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from torshmon.cli import alerts, daemons, history, jobs
from torshmon.cli.common import USAGE_ERROR, TokenError, fail
from torshmon.cli.parser import build_parser
from torshmon.redact import RedactingFilter, Redactor

log = logging.getLogger("torshmon.cli")

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
    except TokenError as exc:
        return fail(args.command, redact, str(exc), USAGE_ERROR)
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
            return fail(
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
        return jobs.demo(args)
    if args.command == "agent":
        return daemons.agent(args, redact)
    if args.command == "aggregator":
        return daemons.aggregator(args, redact)
    if args.command == "query":
        return history.query(args, redact)
    if args.command == "db":
        return history.db(args, redact)
    if args.command == "report":
        return history.report(args, redact)
    if args.command == "rules":
        return alerts.rules(args)
    if args.command in ("tune", "run"):
        return {"tune": jobs.tune, "run": jobs.run}[args.command](args, redact)
    if args.command in ("alerts", "silence"):
        return alerts.lifecycle(args, redact)
    raise AssertionError(f"unhandled command {args.command}")  # argparse enforces the choices
