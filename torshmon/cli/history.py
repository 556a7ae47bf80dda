"""``query``, ``report`` and ``db``: the commands that read or keep the history.

They import the aggregator extra's packages (SQLAlchemy, the report's) when they run,
never at import, so that a training host's install still starts every other command."""

from __future__ import annotations

import argparse
import os
import sys

from torshmon.cli.common import USAGE_ERROR, aggregator_url, db_error, fail, read_token
from torshmon.redact import Redactor, redact_url


def query(args: argparse.Namespace, redact: Redactor) -> int:
    from torshmon.history.db import DatabaseConfigError, as_db_url, db_url
    from torshmon.history.query import HistoryUnreachable, QueryError, format_result, run_query
    from torshmon.history.reader import query_db_url

    try:
        explicit = as_db_url(args.query_db) if args.query_db else None
        url = query_db_url(explicit, db_url(args.db))
        result = run_query(url, args.sql, max_rows=args.max_rows)
    except (HistoryUnreachable, DatabaseConfigError) as exc:
        return fail("query", redact, str(exc), USAGE_ERROR)
    except QueryError as exc:  # the statement itself: refused, or an SQL error
        return fail("query", redact, str(exc), USAGE_ERROR)
    print(format_result(result, args.format))
    if result.truncated:
        print(
            f"(truncated to {len(result.rows)} rows: --max-rows {args.max_rows} "
            "or the cap on an answer's size)",
            file=sys.stderr,
        )
    return 0


def report(args: argparse.Namespace, redact: Redactor) -> int:
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
            base = aggregator_url(args, {})
            token = read_token(args, redact, os.environ) or os.environ.get("TORSHMON_TOKEN", "")
            runs = [args.run] if args.compare is None else [args.run, args.compare]
            found = [report_from_aggregator(base, args.job, token.strip() or None, r) for r in runs]
            read_evidence = evidence_from_aggregator(base, token.strip() or None)
        else:
            url = db_url(args.db)
            runs = [args.run] if args.compare is None else [args.run, args.compare]
            found = [report_from_db(query_db_url(None, url), args.job, run=r) for r in runs]
            read_evidence = evidence_from_db(url, args.evidence_dir)
    except (ReportError, DatabaseConfigError, ValueError) as exc:
        return fail("report", redact, str(exc), USAGE_ERROR)
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
            return fail("report", redact, f"cannot write {where}: {exc.strerror}", USAGE_ERROR)
        print(f"page written to {args.html}")
        if saved.written:
            print(f"evidence: {saved.written} files in {saved.folder}/, linked from the page")
        for line in saved.missing:
            print(f"evidence not copied: {line}", file=sys.stderr)
    return 0


def db(args: argparse.Namespace, redact: Redactor) -> int:
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
        return fail("db upgrade", redact, str(exc), USAGE_ERROR)
    except (SQLAlchemyError, psycopg.Error, OSError) as exc:
        # A path that cannot be written, a server that is down, a login refused.
        message = f"cannot upgrade {redact_url(url)}: {db_error(exc)}"
        return fail("db upgrade", redact, message, USAGE_ERROR)
    except Exception as exc:  # any other failure is reported, with the URL's secrets scrubbed
        return fail("db upgrade", redact, db_error(exc), 1)
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
