"""``agent`` and ``aggregator``: the two daemons, from settings to a running service."""

from __future__ import annotations

import argparse
import os

from torshmon.cli.common import USAGE_ERROR, announcer, db_error, fail, read_token
from torshmon.redact import Redactor, redact_url


def agent(args: argparse.Namespace, redact: Redactor) -> int:
    import asyncio

    from torshmon.agent.daemon import run_agent
    from torshmon.agent.settings import load_settings
    from torshmon.agent.spool import SpoolError

    token = read_token(args, redact, os.environ)
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
        return fail("agent", redact, str(exc), USAGE_ERROR)
    try:
        return asyncio.run(run_agent(settings, announce=announcer(redact)))
    except (OSError, SpoolError) as exc:
        # An unsafe folder or file (UnsafePathError), a taken port, a locked spool.
        return fail("agent", redact, f"cannot start: {exc}", USAGE_ERROR)


def aggregator(args: argparse.Namespace, redact: Redactor) -> int:
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
    overrides["token"] = read_token(args, redact, os.environ)
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
        return asyncio.run(run_aggregator(settings, announce=announcer(redact)))
    except (SettingsError, RuleError, DatabaseConfigError) as exc:
        return fail("aggregator", redact, str(exc), USAGE_ERROR)
    except (SQLAlchemyError, psycopg.Error) as exc:
        message = f"cannot open the history {redact_url(settings.db_url)}: {db_error(exc)}"
        return fail("aggregator", redact, message, USAGE_ERROR)
    except OSError as exc:  # a taken port, an address not on this host, a folder
        return fail("aggregator", redact, f"cannot start: {exc}", USAGE_ERROR)
