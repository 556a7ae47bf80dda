"""History queries on the real PostgreSQL server attack it as a user would, and fail.

A superuser's URL is refused before the query runs; the reader role that ``db
upgrade`` makes cannot read server files, import large objects, read password
hashes, signal other sessions or reach another connection through dblink. Role
names are cluster-wide: the default reader is shared (made idempotently) and a test
that needs a role of its own makes one with a unique name and drops it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from tests.integration.aggregator_thread import AggregatorThread
from tests.pg import PG_URL, pg_database, unique_name
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.history.db import make_engine
from torshmon.history.migrate import upgrade
from torshmon.history.models import Base
from torshmon.history.query import DEFAULT_MAX_CELL_BYTES, QueryError, run_query
from torshmon.history.reader import (
    DEFAULT_READER_ROLE,
    PRIVILEGED_ROLES,
    QUERY_DB_URL_ENV,
    ensure_reader_role,
    reader_url,
)
from torshmon.redact import redact_url

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB = {
    "job": "j1",
    "world_size": 2,
    "backend": "gloo",
    "first_seen_unix_ns": 1,
    "last_seen_unix_ns": 2,
    "aggregator_id": None,
}
SUPERUSER_REFUSAL = (
    "refused: queries would run as superuser postgres; run `torshmon db upgrade` to "
    f"create the reader role {DEFAULT_READER_ROLE}, or give a reader's URL (--query-db, "
    "TORSHMON_QUERY_DB_URL)"
)

#: What a superuser answered before queries connected as a reader, and what the
#: reader is told instead. ``{db}`` is the history database's name.
ATTACKS = [
    ("SELECT pg_read_file('/etc/passwd')", "permission denied for function pg_read_file"),
    ("SELECT pg_ls_dir('/')", "permission denied for function pg_ls_dir"),
    ("SELECT * FROM pg_stat_file('/etc/passwd')", "permission denied for function pg_stat_file"),
    ("SELECT lo_import('/etc/passwd')", "permission denied for function lo_import"),
    ("SELECT rolname, rolpassword FROM pg_authid", "permission denied for table pg_authid"),
    ("SELECT set_config('role', 'postgres', false)", 'permission denied to set role "postgres"'),
    (
        "SELECT dblink_exec('dbname={db} host=127.0.0.1 user=postgres', "
        "'CREATE TABLE pwned (a int)')",
        "password is required",
    ),
    (
        "SELECT dblink_connect('dbname={db} host=127.0.0.1 user=postgres')",
        "password is required",
    ),
]


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def history_db() -> Iterator[str]:
    """An upgraded history with one job and dblink installed: its superuser URL."""
    with pg_database() as url:
        upgrade(url)
        engine = make_engine(url)
        with engine.begin() as conn:
            conn.execute(insert(Base.metadata.tables["jobs"]), [JOB])
        engine.dispose()
        with psycopg.connect(_conninfo(url), autocommit=True) as admin:
            admin.execute("CREATE EXTENSION dblink")
        yield url


@pytest.fixture(scope="module")
def database(history_db: str) -> str:
    database = make_url(history_db).database
    assert database is not None
    return database


def snapshot(url: str) -> tuple[object, ...]:
    """Everything an attack might have changed, read as the superuser."""
    with psycopg.connect(_conninfo(url), autocommit=True) as admin:
        return (
            admin.execute("SELECT * FROM jobs ORDER BY job").fetchall(),
            admin.execute(
                "SELECT schemaname, tablename FROM pg_tables "
                "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2"
            ).fetchall(),
            admin.execute("SELECT count(*) FROM pg_largeobject_metadata").fetchall(),
        )


@contextmanager
def victim_session(url: str) -> Iterator[tuple[psycopg.Connection[tuple[object, ...]], str]]:
    """Another application's session as the user of ``url``, and its application_name."""
    name = unique_name("victim")
    with psycopg.connect(_conninfo(url), autocommit=True, application_name=name) as victim:
        yield victim, name


def _kill(application_name: str) -> str:
    return (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE application_name = '{application_name}'"
    )


@contextmanager
def extra_role(history_db: str, options: str = "LOGIN") -> Iterator[str]:
    """A role with a unique name, dropped (with its grants in ``history_db``) afterwards."""
    name = unique_name("torshmon_role")
    with psycopg.connect(_conninfo(history_db), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(name)))
        try:
            yield name
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


# -- as the superuser: refused before anything runs ------------------------------------


@pytest.mark.parametrize("attack", [a for a, _ in ATTACKS] + ["SELECT count(*) FROM jobs"])
def test_a_superuser_url_is_refused_before_the_query_runs(
    history_db: str, database: str, attack: str
) -> None:
    before = snapshot(history_db)
    with pytest.raises(QueryError) as info:
        run_query(history_db, attack.format(db=database))
    assert str(info.value) == SUPERUSER_REFUSAL
    assert snapshot(history_db) == before


def test_a_superuser_url_cannot_signal_another_session(history_db: str) -> None:
    with victim_session(history_db) as (victim, name):
        with pytest.raises(QueryError, match="superuser postgres"):
            run_query(history_db, _kill(name))
        assert victim.execute("SELECT 1").fetchone() == (1,)


# -- as the reader role: every attack fails ----------------------------------------------


@pytest.mark.parametrize(("attack", "expected"), ATTACKS)
def test_the_reader_role_cannot_reach_past_the_history(
    history_db: str, database: str, attack: str, expected: str
) -> None:
    before = snapshot(history_db)
    with pytest.raises(QueryError, match=r"^(refused|query failed): ") as info:
        run_query(reader_url(history_db), attack.format(db=database))
    assert expected in str(info.value)
    assert "root:" not in str(info.value)
    assert snapshot(history_db) == before


def test_the_reader_role_cannot_signal_another_session(history_db: str) -> None:
    reader = reader_url(history_db)
    # A superuser's session, as a service often runs, and another application's role.
    with extra_role(history_db) as other:
        other_url = make_url(history_db).set(username=other).render_as_string(False)
        for url, terminate, cancel in (
            (
                history_db,
                "must be a superuser to terminate superuser process",
                "must be a superuser to cancel superuser query",
            ),
            (
                other_url,
                "must be a member of the role whose process is being terminated",
                "must be a member of the role whose query is being canceled",
            ),
        ):
            with victim_session(url) as (victim, name):
                with pytest.raises(QueryError, match=terminate):
                    run_query(reader, _kill(name))
                with pytest.raises(QueryError, match=cancel):
                    run_query(reader, _kill(name).replace("terminate", "cancel"))
                assert victim.execute("SELECT 1").fetchone() == (1,)


def test_the_reader_role_reads_the_history_and_nothing_more(history_db: str) -> None:
    assert run_query(reader_url(history_db), "SELECT job FROM jobs").rows == [("j1",)]
    with psycopg.connect(_conninfo(history_db), autocommit=True) as admin:
        row = admin.execute(
            "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolreplication, "
            "rolbypassrls, ARRAY(SELECT b.rolname FROM pg_roles b "
            "  WHERE pg_has_role(r.oid, b.oid, 'MEMBER') AND b.oid <> r.oid), "
            "(SELECT setconfig FROM pg_db_role_setting "
            "  WHERE setrole = r.oid AND setdatabase = 0) "
            "FROM pg_roles r WHERE rolname = %s",
            [DEFAULT_READER_ROLE],
        ).fetchone()
        assert row == (
            True,
            False,
            False,
            False,
            False,
            False,
            [],
            ["default_transaction_read_only=on"],
        )
        tables = (
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'S') AND "
        )
        writable = admin.execute(
            tables + "has_table_privilege(%s, c.oid, "
            "'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER')",
            [DEFAULT_READER_ROLE],
        ).fetchall()
        assert writable == []
        unreadable = admin.execute(
            tables + "c.relkind = 'r' AND NOT has_table_privilege(%s, c.oid, 'SELECT')",
            [DEFAULT_READER_ROLE],
        ).fetchall()
        # Alembic's bookkeeping is no history table.
        assert unreadable == [("alembic_version",)]


# -- roles that could do more than read are refused --------------------------------------


@pytest.mark.parametrize("builtin", ["pg_read_server_files", "pg_signal_backend"])
def test_a_member_of_a_privileged_builtin_role_is_refused(history_db: str, builtin: str) -> None:
    assert builtin in PRIVILEGED_ROLES
    with extra_role(history_db, f"LOGIN IN ROLE {builtin}") as role:
        ensure_readable(history_db, role)
        with pytest.raises(QueryError, match=f"refused: queries would run as {role}, a member"):
            run_query(reader_url(history_db, role), "SELECT pg_read_file('/etc/passwd')")


def test_a_role_that_may_write_the_history_is_refused(history_db: str) -> None:
    with extra_role(history_db) as role:
        ensure_readable(history_db, role)
        with psycopg.connect(_conninfo(history_db), autocommit=True) as admin:
            admin.execute(sql.SQL("GRANT INSERT ON jobs TO {}").format(sql.Identifier(role)))
        with pytest.raises(QueryError, match=f"as {role}, who may write table jobs"):
            run_query(reader_url(history_db, role), "SELECT count(*) FROM jobs")


def ensure_readable(history_db: str, role: str) -> None:
    """Grant ``role`` what the reader role has (it keeps its other powers)."""
    with psycopg.connect(_conninfo(history_db)) as conn:
        assert ensure_reader_role(conn, role).for_admin == ()


def test_a_missing_reader_role_says_how_to_make_it(history_db: str) -> None:
    role = unique_name("torshmon_missing")
    with pytest.raises(QueryError) as info:
        run_query(reader_url(history_db, role), "SELECT 1")
    message = str(info.value)
    assert message.startswith(f"cannot connect to the history database as {role}: ")
    assert f'role "{role}" does not exist' in message
    assert message.endswith(
        "run `torshmon db upgrade` to create the reader role "
        "torshmon_reader, or give a reader's URL (--query-db, "
        "TORSHMON_QUERY_DB_URL)"
    )
    assert "\n" not in message


def test_the_cli_refuses_in_one_line_and_takes_a_query_url(history_db: str) -> None:
    def query(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != QUERY_DB_URL_ENV}
        return subprocess.run(
            [sys.executable, "-m", "torshmon.cli", "query", "--db", history_db, *args],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip

    # The default query URL is the history URL as the reader role.
    done = query("--format", "csv", "SELECT job FROM jobs")
    assert (done.returncode, done.stdout) == (0, "job\nj1\n\n"), done.stderr
    done = query("SELECT pg_read_file('/etc/passwd')")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "torshmon query: refused: queries may only read the history "
        "(permission denied for function pg_read_file)\n"
    )
    done = query("--query-db", history_db, "SELECT pg_read_file('/etc/passwd')")
    # A superuser for the query URL is a mistake the user fixes: exit 2, one line.
    assert (done.returncode, done.stderr) == (2, f"torshmon query: {SUPERUSER_REFUSAL}\n")
    missing = reader_url(history_db, unique_name("torshmon_missing"))
    done = query("--query-db", missing, "SELECT 1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1  # cannot connect: exit 2
    assert "does not exist; run `torshmon db upgrade`" in done.stderr


def test_upgrades_of_two_databases_make_one_new_reader_role_at_once() -> None:
    code = (
        "import sys; from torshmon.history.migrate import upgrade\n"
        "print(upgrade(sys.argv[1], reader_role=sys.argv[2]).for_admin)"
    )
    with (
        dropped_role(unique_name("torshmon_reader_t")) as reader,
        pg_database() as first,
        pg_database() as second,
    ):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, url, reader],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for url in (first, second)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert outputs == ["()\n", "()\n"]
        for url in (first, second):
            query = run_query(reader_url(url, reader), "SELECT count(*) FROM jobs")
            assert query.rows == [(0,)]


# -- db upgrade by a user who may not create roles ---------------------------------------


@contextmanager
def dropped_role(name: str) -> Iterator[str]:
    """``name``, a role a test may make, dropped at the end if it was made (its grants
    must be gone by then: made in a database dropped first)."""
    try:
        yield name
    finally:
        with psycopg.connect(_conninfo(PG_URL), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def test_upgrade_by_an_owner_without_createrole_prints_the_admin_sql() -> None:
    with (
        dropped_role(unique_name("torshmon_reader_t")) as reader,
        extra_role(PG_URL, "LOGIN NOCREATEROLE") as owner,
        pg_database() as admin_url,
    ):
        with psycopg.connect(_conninfo(admin_url), autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
                    sql.Identifier(str(make_url(admin_url).database)), sql.Identifier(owner)
                )
            )
        owner_url = make_url(admin_url).set(username=owner).render_as_string(False)
        done = subprocess.run(
            [
                sys.executable, "-m", "torshmon.cli", "db", "upgrade",
                "--db", owner_url, "--reader-role", reader,
            ],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[:2] == [
            f"history database at head: {redact_url(owner_url)}",
            f"queries connect as the reader role {reader}, which this database user may "
            "not set up; an administrator should run:",
        ]
        statements = [line.strip().removesuffix(";") for line in lines[2:]]
        assert statements[0].startswith(f'CREATE ROLE "{reader}" LOGIN NOSUPERUSER')
        assert f'GRANT SELECT ON TABLE "public"."jobs" TO "{reader}"' in statements
        with psycopg.connect(_conninfo(admin_url), autocommit=True) as admin:
            for statement in statements:
                admin.execute(statement)
        query = run_query(reader_url(admin_url, reader), "SELECT count(*) FROM jobs")
        assert query.rows == [(0,)]
        # The owner may not query as itself: it could write.
        with pytest.raises(QueryError, match=f"as {owner}, the owner of table"):
            run_query(owner_url, "SELECT count(*) FROM jobs")


def test_upgrade_leaves_a_superuser_and_itself_alone(history_db: str) -> None:
    # Roles of the test's own: were the guard broken, postgres would lose its powers.
    with (
        extra_role(history_db, "LOGIN SUPERUSER") as superuser,
        extra_role(history_db, "LOGIN CREATEROLE") as admin,
    ):
        with psycopg.connect(_conninfo(history_db)) as conn:
            setup = ensure_reader_role(conn, superuser, password="x")
        assert setup.refused == f"refused to make role {superuser} a reader: it is a superuser"
        assert (setup.done, setup.for_admin) == ((), ())
        admin_url = make_url(history_db).set(username=admin).render_as_string(False)
        with psycopg.connect(_conninfo(admin_url)) as conn:
            setup = ensure_reader_role(conn, admin)
        assert setup.refused == (
            f"refused to make role {admin} a reader: it is the user running the upgrade"
        )
        done = subprocess.run(
            [
                sys.executable, "-m", "torshmon.cli", "db", "upgrade",
                "--db", history_db, "--reader-role", superuser,
            ],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2
        assert done.stderr == (
            f"torshmon db upgrade: refused to make role {superuser} a reader: it is a "
            "superuser; name another --reader-role\n"
        )
        with psycopg.connect(_conninfo(history_db), autocommit=True) as conn:
            roles = conn.execute(
                "SELECT rolname, rolsuper, rolcreaterole, rolpassword IS NULL FROM pg_authid "
                "WHERE rolname IN (%s, %s) ORDER BY rolsuper",
                [superuser, admin],
            ).fetchall()
        assert roles == [(admin, False, True, True), (superuser, True, False, True)]


def test_the_aggregator_makes_the_reader_of_its_query_url_with_its_password() -> None:
    with (
        dropped_role(unique_name("torshmon_reader_t")) as reader,
        pg_database() as url,
    ):
        query_url = make_url(url).set(username=reader, password="s3cret")
        settings = AggregatorSettings(
            port=0,
            db_url=url,
            query_db_url=query_url.render_as_string(hide_password=False),
            token="t",
            aggregator_id="reader-test",
        )
        with AggregatorThread(settings) as agg:
            status, reply = agg.post_json("/api/v1/query", {"sql": "SELECT current_user"})
            assert (status, reply["rows"]) == (200, [[reader]]), reply
        with psycopg.connect(_conninfo(url), autocommit=True) as admin:
            row = admin.execute(
                "SELECT rolsuper, rolpassword LIKE 'SCRAM-SHA-256$%%' FROM pg_authid "
                "WHERE rolname = %s",
                [reader],
            ).fetchone()
        assert row == (False, True)


# -- the cap on an answer's size -----------------------------------------------------------


def test_a_value_over_the_cell_cap_is_refused_before_it_is_sent(history_db: str) -> None:
    url = reader_url(history_db)
    with pytest.raises(QueryError, match=r"over the 4 MiB cap on one value \(one is 50000000"):
        run_query(url, "SELECT 1 AS a, repeat('x', 50000000) AS b")
    with pytest.raises(QueryError, match="over the 100 byte cap on one value"):
        run_query(url, "SELECT repeat('x', 101)", max_cell_bytes=100)
    assert run_query(url, "SELECT repeat('x', 100) AS b", max_cell_bytes=100).rows == [("x" * 100,)]
    # EXPLAIN cannot be measured before it is sent: its rows are, as they arrive.
    explain = "EXPLAIN SELECT * FROM jobs WHERE job = repeat('x', 2000)"
    with pytest.raises(QueryError, match=r"over the 1000 byte cap on one value \(one is 20"):
        run_query(url, explain, max_cell_bytes=1000)
    assert run_query(url, explain).columns == ("QUERY PLAN",)
    # Measured as sent (text), whatever the type: bytea goes as hex.
    with pytest.raises(QueryError, match="cap on one value"):
        run_query(url, "SELECT decode(repeat('ab', 60), 'hex')", max_cell_bytes=100)


def test_the_answer_cap_truncates_and_keeps_order_names_and_types(history_db: str) -> None:
    url = reader_url(history_db)
    rows = "SELECT i, i AS i, repeat('x', 991) AS pad FROM generate_series(1, 100) AS g(i)"
    # Each row is about 1000 bytes as text: ten fit in 10 000 bytes.
    result = run_query(url, rows + " ORDER BY i DESC;  -- newest first", max_answer_bytes=10_000)
    assert result.columns == ("i", "i", "pad")
    assert [r[0] for r in result.rows] == list(range(100, 90, -1))
    assert result.truncated
    whole = run_query(url, rows, max_answer_bytes=200_000)
    assert len(whole.rows) == 100 and not whole.truncated
    with pytest.raises(QueryError, match="one row of the answer is over the 500 byte cap"):
        run_query(url, "SELECT repeat('x', 400), repeat('y', 400)", max_answer_bytes=500)
    assert run_query(url, "VALUES (1, 'a'), (2, NULL)").rows == [(1, "a"), (2, None)]
    assert run_query(url, "TABLE jobs", max_rows=1).rows[0][0] == "j1"
    assert run_query(url, "WITH w AS (SELECT 2 AS n) SELECT n FROM w").rows == [(2,)]


def test_breaking_out_of_the_measuring_subquery_is_a_syntax_error(history_db: str) -> None:
    url = reader_url(history_db)
    for attack in (
        "SELECT 1) AS _u OFFSET 0) AS _q(c1) UNION ALL SELECT repeat('x', 50000000) --",
        "SELECT 1 AS a; -- ) x",
        "SELECT ';' AS a; /* ; */",
        "SELECT '; --' AS a",
    ):
        try:
            result = run_query(url, attack)
        except QueryError as exc:
            assert "cap" not in str(exc)
        else:
            assert all(len(str(v)) < 100 for row in result.rows for v in row), attack


def test_an_oversized_value_is_not_received(history_db: str) -> None:
    """The client's memory stays far below the value's size (measured in a child), and
    grows by it where the caps are raised above it."""
    code = (
        "import sys\n"
        "from torshmon.history.query import DEFAULT_MAX_CELL_BYTES, QueryError, run_query\n"
        "cap = int(sys.argv[3])\n"
        "try:\n"
        "    run_query(sys.argv[1], sys.argv[2], max_cell_bytes=cap, max_answer_bytes=cap)\n"
        "    print('answered')\n"
        "except QueryError as exc:\n"
        "    print('refused' if 'cap on one value' in str(exc) else exc)\n"
        # VmHWM is this process's own peak (KiB): ru_maxrss keeps the peak of the
        # forked parent (pytest, hundreds of MB) across exec.
        "status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        "print(int(status.split()[0]))\n"
    )

    def peak_kib(statement: str, cap: int = DEFAULT_MAX_CELL_BYTES) -> tuple[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", code, reader_url(history_db), statement, str(cap)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outcome, peak = done.stdout.split()
        return outcome, int(peak)

    big = "SELECT repeat('x', 100000000)"
    small_outcome, small = peak_kib("SELECT repeat('x', 10)")
    capped_outcome, capped = peak_kib(big)
    received_outcome, received = peak_kib(big, cap=2**30)
    assert (small_outcome, capped_outcome, received_outcome) == ("answered", "refused", "answered")
    # 100 MB received is held at least twice (libpq's buffer, the str).
    assert received - small > 150_000, (small, received)
    assert capped - small < 20_000, (small, capped)
