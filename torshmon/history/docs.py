"""The history tables as Markdown, generated from the models (``docs/tables.md``).

Regenerate after changing a model: ``python -m torshmon.history.docs docs/tables.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sqlalchemy import Column, Table

from torshmon.history.models import ROLLUP_SOURCES, Base

_INTRO = """\
# History tables

torshmon stores what it sees and decides in SQL: SQLite (`./torshmon.db`) on one
machine, PostgreSQL beyond (`TORSHMON_DB_URL`, any SQLAlchemy URL). This page is
generated from `torshmon/history/models/`; do not edit it by hand
(`python -m torshmon.history.docs docs/tables.md`).

## Querying

```
torshmon query "SELECT ..." [--db URL] [--query-db URL] [--format table|csv|json]
```

The database is `--db`, else `TORSHMON_DB_URL`, else `sqlite:///torshmon.db`.

Queries are read-only, enforced by the database itself: SQLite is opened read-only
and refuses writes, `ATTACH` and pragma writes. On PostgreSQL the query connects as
a reader role that may only SELECT the history tables (`--query-db`, else
`TORSHMON_QUERY_DB_URL`, else the history URL as the user `torshmon_reader`, which
`torshmon db upgrade` makes; see [postgresql.md](postgresql.md)), and is refused if
that role could do more (a superuser, the tables' owner); it runs in a read-only
transaction with a statement timeout. One statement per query. An answer holds at
most 10 000 rows and 64 MiB (more is cut and said to be truncated), and no value
over 4 MiB (refused: select a part, e.g. `substr(column, 1, 1000)`).
The same over HTTP: `POST /api/v1/query {"sql": "...", "format": "json"}`. JSON output,
from either, is strict JSON: NaN and infinities come out as `null`, bytes as hex text.

Times are Unix nanoseconds in `*_unix_ns` columns (probe and agent data) and Unix
seconds in `*_unix_s` columns (aggregator data). To read them as dates use
`datetime(end_unix_ns / 1e9, 'unixepoch')` on SQLite and
`to_timestamp(end_unix_ns / 1e9)` on PostgreSQL.

Mean step time and communication wait per rank of a job:

```sql
SELECT rank, count(*) AS steps, avg(duration_s) AS mean_step_s,
       avg(comm_wait_s) AS mean_comm_wait_s, avg(compute_s) AS mean_compute_s
FROM steps WHERE job = 'demo' GROUP BY rank ORDER BY rank
```

Alerts that fired, newest first:

```sql
SELECT rule, severity, job, rank, value, fired_at_unix_s, ends_at_unix_s
FROM alerts WHERE fired_at_unix_s IS NOT NULL ORDER BY fired_at_unix_s DESC LIMIT 20
```

Bus bandwidth per collective and process group:

```sql
SELECT op, pg, sum(count) AS calls, sum(size_bytes) / sum(duration_s) AS algbw_bytes_per_s,
       avg(busbw_bytes_per_s) AS mean_busbw_bytes_per_s
FROM collectives WHERE job = 'demo' GROUP BY op, pg ORDER BY calls DESC
```

Step time per minute from the rollups (kept after the raw rows are deleted):

```sql
SELECT bucket_start_unix_s, sum / count AS mean_step_s, min, max
FROM rollups WHERE key = 'demo' AND rank = 0 AND metric = 'duration_s'
  AND resolution_s = 60 ORDER BY bucket_start_unix_s
```

## Retention

Raw measurement tables keep one day by default; before rows are deleted they are
rolled up into `rollups` (count, sum, min, max per minute), kept for 30 days.
"""


def render_tables_markdown() -> str:
    """Markdown describing every history table and column (type, NULL, comment)."""
    parts = [_INTRO, _rollup_sources(), "## Tables\n"]
    parts.extend(_table_markdown(table) for table in Base.metadata.tables.values())
    return "\n".join(parts)


def _rollup_sources() -> str:
    lines = ["Rolled-up columns (`rollups.metric`):", ""]
    for source in ROLLUP_SOURCES.values():
        rank = f"rank = `{source.rank_column}`" if source.rank_column else "rank = -1"
        metrics = ", ".join(f"`{m}`" for m in source.metrics)
        lines.append(
            f"- `{source.table}` (key = `{source.key_column}`, {rank}, "
            f"time = `{source.time_column}`): {metrics}"
        )
    return "\n".join(lines) + "\n"


def _table_markdown(table: Table) -> str:
    lines = [f"### `{table.name}`", "", _escape(table.comment or ""), ""]
    keys = ", ".join(f"`{c.name}`" for c in table.primary_key.columns)
    lines.append(f"Primary key: {keys}.")
    indexes = sorted(
        "(" + ", ".join(c.name for c in index.columns) + ")" for index in table.indexes
    )
    if indexes:
        lines.append(f"Indexes: {', '.join(indexes)}.")
    for fk in sorted(table.foreign_keys, key=lambda f: f.parent.name):
        lines.append(f"`{fk.parent.name}` references `{fk.target_fullname}`.")
    lines.extend(["", "| column | type | null | description |", "|---|---|---|---|"])
    lines.extend(_column_row(column) for column in table.columns)
    return "\n".join(lines) + "\n"


def _column_row(column: Column[object]) -> str:
    null = "yes" if column.nullable else "no"
    return f"| `{column.name}` | {column.type} | {null} | {_escape(column.comment or '')} |"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Write the rendering to the path given (default docs/tables.md); exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m torshmon.history.docs",
        description="Write the history tables as a Markdown page.",
    )
    parser.add_argument("path", nargs="?", default="docs/tables.md", type=Path)
    path: Path = parser.parse_args(argv).path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_tables_markdown(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
