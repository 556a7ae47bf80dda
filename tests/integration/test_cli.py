"""The ``torshmon`` command as a user meets it (issue 18): the installed console script,
run from a folder outside the source tree, against real daemons on loopback."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from torshmon.launch import free_port
from torshmon.version import __version__

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The console script pip installed beside this interpreter.
TORSHMON = Path(sys.executable).with_name("torshmon")
TOKEN = "cli-test-token-5f4e3d"


def _env(**values: str) -> dict[str, str]:
    """This environment without torshmon's own variables, running this tree's code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORSHMON_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return {**env, **values}


def torshmon(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    if not TORSHMON.is_file():
        pytest.fail(f"no console script at {TORSHMON}: install the package (pip install -e .)")
    return subprocess.run(
        [str(TORSHMON), *args],
        cwd=cwd,
        env=env if env is not None else _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert says in done.stderr, done.stderr


def test_version(tmp_path: Path) -> None:
    done = torshmon("--version", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, f"torshmon {__version__}\n"), done.stderr


def test_db_takes_a_path_or_a_url_everywhere(tmp_path: Path) -> None:
    done = torshmon("db", "upgrade", "--db", "./torshmon.db", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.splitlines()[0] == f"history database at head: sqlite:///{tmp_path}/torshmon.db"
    )
    assert (tmp_path / "torshmon.db").is_file()
    count = ("--format", "json", "SELECT count(*) AS n FROM steps")
    for db in ("./torshmon.db", "torshmon.db", f"{tmp_path}/torshmon.db", "sqlite:///torshmon.db"):
        done = torshmon("query", "--db", db, *count, cwd=tmp_path)
        assert done.returncode == 0, (db, done.stderr)
        assert json.loads(done.stdout) == [{"n": 0}], db
    # The variable takes a path too, and the help texts say so.
    done = torshmon("query", *count, cwd=tmp_path, env=_env(TORSHMON_DB_URL="torshmon.db"))
    assert done.returncode == 0 and json.loads(done.stdout) == [{"n": 0}], done.stderr
    for command in (["query", "x"], ["db", "upgrade"], ["aggregator"], ["demo"]):
        done = torshmon(*command, "--help", cwd=tmp_path)
        assert done.returncode == 0 and "path" in done.stdout, done.stdout


def test_global_flags_go_after_the_command_too(tmp_path: Path) -> None:
    quiet = torshmon("db", "upgrade", "--db", "h.db", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    for argv in (["-v", "db", "upgrade"], ["db", "upgrade", "-v"], ["db", "-v", "upgrade"]):
        loud = torshmon(*argv, "--db", "h.db", cwd=tmp_path)
        assert loud.returncode == 0, loud.stderr
        assert "INFO torshmon.history.migrate" in loud.stderr, (argv, loud.stderr)
        assert " alembic." not in loud.stderr, loud.stderr  # its loggers' chatter stays out
    (tmp_path / "conf.yaml").write_text("prot: 1234\n")
    for argv in (["--config", "conf.yaml", "aggregator"], ["aggregator", "--config", "conf.yaml"]):
        done = torshmon(*argv, cwd=tmp_path)
        _one_line_error(done, "conf.yaml:1: unknown setting 'prot'")
    done = torshmon("--config", "conf.yaml", "query", "SELECT 1", cwd=tmp_path)
    assert done.returncode == 2 and "--config is for agent and aggregator" in done.stderr


def test_user_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    dead = free_port()
    dead_pg = f"postgresql://postgres@127.0.0.1:{dead}/x"
    missing = tmp_path / "missing.db"
    cases = [
        (["query", "--db", str(missing), "SELECT 1"], f"no history database at {missing}"),
        (["query", "--db", "/nonexistent/dir/h.db", "SELECT 1"], "no history database"),
        (["db", "upgrade", "--db", "/nonexistent/dir/h.db"], "unable to open database file"),
        (["db", "upgrade", "--db", "mysql://u@h/d"], "'mysql'; supported"),
        (["query", "--db", dead_pg, "SELECT 1"], "cannot connect"),
        (["db", "upgrade", "--db", dead_pg], "Connection refused"),
        (["aggregator", "--port", "0", "--db", "/nonexistent/dir/h.db"], "cannot open the history"),
        (["aggregator", "--port", "0", "--db", "mysql://u@h/d"], "'mysql'"),
        (["tune", "job", "--url", "ftp://h"], "is not http(s)://HOST[:PORT]"),
        (["tune", "job", "--url", f"http://127.0.0.1:{dead}"], f"cannot reach http://127.0.0.1:{dead}"),
        (["agent", "--aggregator", "ftp://h"], "aggregator url"),
        (["demo", "--db", "postgresql://h/d"], "the demo keeps its history in SQLite"),
        (["tune", "job", "--token-file", str(tmp_path / "none")], "cannot read --token-file"),
    ]  # fmt: skip
    for argv, says in cases:
        _one_line_error(torshmon(*argv, cwd=tmp_path), says)
    done = torshmon("tune", "job", cwd=tmp_path, env=_env(TORSHMON_AGGREGATOR_URL="ftp://h"))
    _one_line_error(done, "'ftp://h' is not http(s)")


def test_a_port_in_use_or_an_sql_error_is_a_users_mistake(tmp_path: Path) -> None:
    """README: a mistake the user can fix is one line and exit status 2. These exited 1."""
    import socket

    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = torshmon("aggregator", "--port", port, "--db", "h.db", cwd=tmp_path)
        _one_line_error(done, "torshmon aggregator: cannot start: ")
        assert "address already in use" in done.stderr, done.stderr
        done = torshmon(
            "agent", "--metrics-port", port, cwd=tmp_path, env=_env(XDG_RUNTIME_DIR=str(runtime))
        )
        _one_line_error(done, "torshmon agent: cannot start: ")
        assert "address already in use" in done.stderr, done.stderr
    done = torshmon("query", "--db", "h.db", "SELECT nope FROM steps", cwd=tmp_path)
    _one_line_error(done, "no such column: nope")


class Daemon:
    """A ``torshmon`` daemon started from a folder; its start line read with a deadline."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [str(TORSHMON), *argv],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def first_line(self, timeout_s: float = 60) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s
            while not selector.select(timeout=0.5):
                assert self.proc.poll() is None, self.stop()
                assert time.monotonic() < deadline, "no start line"
        return self.proc.stdout.readline()

    def stop(self) -> tuple[str, str]:
        """SIGTERM; (rest of stdout, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def aggregator(tmp_path: Path) -> Iterator[tuple[str, Daemon]]:
    """``torshmon aggregator -v`` on a free port, history in ./h.db, with the token in
    the file TORSHMON_TOKEN_FILE names."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    daemon = Daemon(
        ["aggregator", "-v", "--port", "0", "--db", "h.db"],
        tmp_path,
        _env(TORSHMON_TOKEN_FILE=str(tmp_path / "token")),
    )
    try:
        line = daemon.first_line()
        pattern = r"torshmon aggregator listening on (http://127\.0\.0\.1:\d+), history in (\S+)\n"
        match = re.fullmatch(pattern, line)
        assert match, line
        assert match[2] == f"sqlite:///{tmp_path}/h.db"
        with urllib.request.urlopen(match[1] + "/healthz", timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
        yield match[1], daemon
    finally:
        daemon.stop()


def test_each_daemon_says_where_it_listens_and_stores_in_one_line(
    tmp_path: Path, aggregator: tuple[str, Daemon]
) -> None:
    url, daemon = aggregator
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    agent = Daemon(
        ["agent", "--metrics-port", "0", "--aggregator", url, "--node", "n1"],
        tmp_path,
        _env(XDG_RUNTIME_DIR=str(runtime), TORSHMON_TOKEN_FILE=str(tmp_path / "token")),
    )
    try:
        line = agent.first_line()
        folder = runtime / "torshmon"
        match = re.fullmatch(
            rf"torshmon agent listening on {folder}/agent\.sock \(probes\) and "
            rf"(http://127\.0\.0\.1:\d+)/metrics, spool in {folder}/agent-spool\.db, "
            rf"forwarding to {re.escape(url)}\n",
            line,
        )
        assert match, line
        with urllib.request.urlopen(match[1] + "/metrics", timeout=10) as response:
            assert b"torshmon_agent" in response.read()
    finally:
        out, err = agent.stop()
    assert agent.proc.returncode == 0, err
    # One line without -v: nothing else on stdout, nothing on stderr (the token came
    # from TORSHMON_TOKEN_FILE, so the aggregator took the agent's batches).
    assert (out, err) == ("", ""), (out, err)
    out, err = daemon.stop()
    assert daemon.proc.returncode == 0 and out == "", (out, err)
    # With -v (after the command) its own INFO lines, and no Alembic chatter.
    assert "INFO torshmon.aggregator.service" in err and " alembic." not in err, err


def test_tune_reads_the_same_variables(tmp_path: Path, aggregator: tuple[str, Daemon]) -> None:
    url, _ = aggregator
    (tmp_path / "wrong").write_text("not-the-token\n")
    variables = [
        ({"TORSHMON_TOKEN_FILE": str(tmp_path / "token")}, "no-such-job"),
        ({"TORSHMON_TOKEN": TOKEN}, "no-such-job"),
        ({"TORSHMON_TOKEN_FILE": str(tmp_path / "wrong")}, "401"),
        ({}, "401"),
    ]
    for env, says in variables:
        done = torshmon(
            "tune", "no-such-job", cwd=tmp_path, env=_env(TORSHMON_AGGREGATOR_URL=url, **env)
        )
        # The aggregator answered: about the job with the token, refusing without it
        # (so it read its own token from TORSHMON_TOKEN_FILE too). Both are the user's
        # to fix: exit 2.
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert says in done.stderr.lower() or says in done.stderr, (env, done.stderr)
        assert "Traceback" not in done.stderr


def test_tune_refuses_a_job_that_has_ended(tmp_path: Path, aggregator: tuple[str, Daemon]) -> None:
    """A finished job was accepted, then the session aborted ("the job refused its own
    config"); an unknown job was HTTP 404 and exit 1."""
    from sqlalchemy import insert

    from torshmon.history.db import make_engine
    from torshmon.history.models import Base
    from torshmon.report.text import when

    url, _ = aggregator
    now = time.time()
    ended_at = now - 120
    engine = make_engine(f"sqlite:///{tmp_path / 'h.db'}")
    with engine.begin() as conn:  # as the aggregator stored them
        conn.execute(
            insert(Base.metadata.tables["jobs"]),
            [
                {"job": job, "world_size": 2, "backend": "gloo",
                 "first_seen_unix_ns": int((seen - 60) * 1e9),
                 "last_seen_unix_ns": int(seen * 1e9), "aggregator_id": "a"}
                for job, seen in (("over", ended_at), ("busy", now), ("done", now))
            ],
        )  # fmt: skip
        # "done" was heard from just now, but its ranks' probes said they closed.
        conn.execute(
            insert(Base.metadata.tables["probe_sessions"]),
            [
                {"session": f"{job}{rank}", "job": job, "rank": rank,
                 "started_unix_ns": int((now - 60) * 1e9), "last_seen_unix_ns": int(now * 1e9),
                 "last_seq": 9, "dropped_records_total": 0, "closed_unix_ns": closed}
                for job, closed in (("done", int(now * 1e9)), ("busy", None))
                for rank in (0, 1)
            ],
        )  # fmt: skip
    engine.dispose()
    env = _env(TORSHMON_TOKEN_FILE=str(tmp_path / "token"))
    done = torshmon("tune", "over", "--aggregator", url, cwd=tmp_path, env=env)
    _one_line_error(done, "torshmon tune: job 'over' has ended (nothing from its ranks since ")
    assert when(ended_at) in done.stderr and "only a running job can be tuned" in done.stderr
    done = torshmon("tune", "done", "--aggregator", url, cwd=tmp_path, env=env)
    _one_line_error(done, "torshmon tune: job 'done' has ended (its ranks closed; their last")
    done = torshmon("tune", "nope", "--aggregator", url, cwd=tmp_path, env=env)
    _one_line_error(done, f"torshmon tune: no job 'nope' on the aggregator at {url}")
    # A job heard from now passes on to the aggregator, which says what it lacks.
    done = torshmon("tune", "busy", "--url", url, cwd=tmp_path, env=env)
    _one_line_error(done, "torshmon tune: HTTP 404: no config or DDP stats from job 'busy' yet")


def test_an_offline_report_through_the_aggregator_carries_its_evidence(
    tmp_path: Path, aggregator: tuple[str, Daemon]
) -> None:
    """``report --aggregator URL --html out.html``: the alert's evidence is downloaded
    beside the page and linked relatively (the page linked /api/v1/evidence/...)."""
    import gzip
    import urllib.parse

    from sqlalchemy import insert

    from tests import report_history as h
    from torshmon.history.db import make_engine
    from torshmon.history.models import Base

    url, _ = aggregator
    db = tmp_path / "h.db"
    h.make_history(db)  # the job, its steps and a Straggler alert (id 1), as stored
    trace = gzip.compress(b'{"traceEvents": []}')
    folder = tmp_path / "h.db.evidence" / "c0ffee"  # where this aggregator keeps evidence
    folder.mkdir(parents=True)
    (folder / "rank1-profiler_trace.json.gz").write_bytes(trace)
    tables = Base.metadata.tables
    engine = make_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(
            insert(tables["evidence_captures"]),
            [{"id": "c0ffee", "job": h.JOB, "alert_id": 1, "alert_fingerprint": None,
              "rule": "Straggler", "profile_ranks": [1], "created_unix_s": h.T0 + 11,
              "aggregator_id": "a1"}],
        )  # fmt: skip
        conn.execute(
            insert(tables["evidence_files"]),
            [{"capture_id": "c0ffee", "rank": 1, "name": "profiler_trace.json", "job": h.JOB,
              "size_bytes": 19, "stored_bytes": len(trace),
              "path": "c0ffee/rank1-profiler_trace.json.gz", "error": "",
              "taken_unix_s": h.T0 + 12, "received_unix_s": h.T0 + 13}],
        )  # fmt: skip
    engine.dispose()
    env = _env(TORSHMON_TOKEN_FILE=str(tmp_path / "token"))
    out = tmp_path / "out.html"
    done = torshmon("report", h.JOB, "--aggregator", url, "--html", str(out), cwd=tmp_path, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"evidence: 1 files in {tmp_path / 'out_evidence'}/" in done.stdout
    page = out.read_text()
    hrefs = re.findall(r'<a href="([^"]*)">rank 1 profiler_trace.json</a>', page)
    assert hrefs == ["out_evidence/c0ffee/rank1-profiler_trace.json.gz"], hrefs
    assert (tmp_path / urllib.parse.unquote(hrefs[0])).read_bytes() == trace
    assert "/api/v1/evidence" not in page
