"""Secrets never leave: real agent and aggregator processes, given tokens, URLs with
passwords and secret webhook URLs, never show them in output, logs, /metrics, API
answers or the history file, on their failure paths above all."""

from __future__ import annotations

import base64
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.integration import wire_factory as wf
from torshmon.launch import free_port

pytestmark = pytest.mark.integration

PASSWORD = "hunter2-Pw-x9"
TOKEN = "tok-S3cret-Bearer-x9"
HOOK_PATH = "/hooks/T0AA/HookS3cretPath-x9"
HOOK_QUERY = "key=QueryS3cret-x9"
SLACK_PATH = "/services/T0AA/B0BB/SlackS3cret-x9"
WEBHOOK_TOKEN = "WebhookS3cretToken-x9"
OTLP_PASSWORD = "OtlpS3cretPw-x9"
OTLP_KEY = "OtlpS3cretKey-x9"
SECRETS = (PASSWORD, TOKEN, "HookS3cretPath", "QueryS3cret", "SlackS3cret", WEBHOOK_TOKEN)
SECRETS += (OTLP_PASSWORD, OTLP_KEY)

RULES = """\
rules:
  - name: Loss Too High
    kind: threshold
    metric: loss
    op: ">"
    value: 0.5
"""


def _assert_clean(what: str, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    for secret in SECRETS:
        assert secret.encode() not in data, f"{secret!r} leaked into {what}"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _failure(
    done: subprocess.CompletedProcess[str], code: int, says: str, *, lines: int = 1
) -> None:
    assert done.returncode == code, done.stderr
    assert len(done.stderr.splitlines()) == lines, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    _assert_clean("stderr", done.stderr + done.stdout)


def _get(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read().decode()}"


def _wait_for(condition: object, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return out, err


class _FailingHook(http.server.BaseHTTPRequestHandler):
    """Answers 500, echoing the path and the Authorization header, as careless servers do."""

    seen: list[str]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(self.path)
        body = f"no route {self.path} for {self.headers.get('Authorization')}".encode()
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def failing_hook() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Hook", (_FailingHook,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


# -- the agent ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"ftp://u:{PASSWORD}@127.0.0.1:1/", "must be http:// or https://"),
        (f"http://u:{PASSWORD}@/x", "not a valid URL"),
        (f"http://u:{PASSWORD}@127.0.0.1:99999/", "not a valid URL"),
        (f"http://{PASSWORD}@[::1/", "not a valid URL"),
    ],
)
def test_the_agent_refuses_a_bad_aggregator_url_without_showing_its_password(
    url: str, says: str
) -> None:
    _failure(_cli("agent", "--aggregator", url), 2, says)


@pytest.mark.parametrize("credentials", ["url", "token"])
def test_a_running_agent_never_shows_the_aggregator_password_or_token(
    tmp_path: Path, failing_hook: tuple[str, list[str]], credentials: str
) -> None:
    """The aggregator answers 500 and echoes the request's Authorization header."""
    hook, seen = failing_hook
    args = ["--aggregator", hook.replace("://", f"://u:{PASSWORD}@") + "/"]
    if credentials == "token":
        (tmp_path / "token").write_text(TOKEN + "\n")
        args = ["--aggregator", hook + "/", "--token-file", str(tmp_path / "token")]
    metrics_port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "torshmon.cli", "-v", "agent",
            "--socket", str(tmp_path / "agent.sock"),
            "--spool", str(tmp_path / "spool.db"),
            "--metrics-port", str(metrics_port),
            *args,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{metrics_port}"
    try:
        _wait_for(lambda: len(seen) >= 2, "the agent's polls")
        _assert_clean("/metrics", _get(base + "/metrics"))
        _assert_clean("/healthz", _get(base + "/healthz"))
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err
    scheme = "Basic" if credentials == "url" else "Bearer"
    assert f"failed (500): no route /api/v1/ingest for {scheme} <redacted>" in err, err
    _assert_clean("the agent's output", out + err)
    assert base64.b64encode(f"u:{PASSWORD}".encode()).decode() not in err


def test_an_aggregator_url_with_credentials_and_a_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    url = f"http://u:{PASSWORD}@127.0.0.1:1/"
    done = _cli("agent", "--aggregator", url, "--token-file", str(tmp_path / "token"))
    _failure(done, 2, "has credentials and a token")


# -- the database URL ---------------------------------------------------------------------

DEAD_DB = f"postgresql://torshmon:{PASSWORD}@127.0.0.1:1/history"


@pytest.mark.parametrize(
    ("args", "code", "says", "lines"),
    [
        # A database that cannot be reached or a bad URL is a user error: exit 2 (issue 18).
        (("aggregator", "--port", "0", "--db", DEAD_DB), 2, "cannot open the history", 1),
        (("db", "upgrade", "--db", DEAD_DB), 2, "Connection refused", 1),
        (("query", "--db", DEAD_DB, "SELECT 1"), 2, "cannot connect", 1),
        (("query", "--db", f"mysql://u:{PASSWORD}@h/db", "SELECT 1"), 2, "'mysql'", 1),
        (("db", "upgrade", "--db", f"postgresql+pg8000://u:{PASSWORD}@h/db"), 2, "pg8000", 1),
        (("aggregator", "--db", f"mysql://u:{PASSWORD}@h/db"), 2, "'mysql'", 1),
    ],
)
def test_a_database_url_password_stays_out_of_errors(
    tmp_path: Path, args: Sequence[str], code: int, says: str, lines: int
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    if args[0] == "aggregator":
        args = (*args, "--token-file", str(tmp_path / "token"))
    _failure(_cli(*args), code, says, lines=lines)


def test_the_database_url_from_the_environment_stays_out_too() -> None:
    done = _cli("query", "SELECT 1", env={"TORSHMON_DB_URL": DEAD_DB})
    _failure(done, 2, "cannot connect", lines=1)


@pytest.mark.parametrize(
    "config",
    [
        f'token: "{TOKEN}\n',  # unclosed quote: YAML's message quotes the line
        f"token: {TOKEN}\n  port: [\n",
        "token: 12345678901234\n",  # a token of the wrong type
        f"db_url: postgresql://u:{PASSWORD}@h/db\nport: 99999\n",
    ],
)
def test_a_bad_config_file_does_not_echo_its_secrets(tmp_path: Path, config: str) -> None:
    (tmp_path / "conf.yaml").write_text(config)
    done = _cli("aggregator", "--config", str(tmp_path / "conf.yaml"))
    assert "12345678901234" not in done.stderr
    _failure(done, 2, "torshmon aggregator:")


# -- a running aggregator -----------------------------------------------------------------


def test_a_running_aggregator_keeps_every_secret(
    tmp_path: Path, failing_hook: tuple[str, list[str]]
) -> None:
    hook, seen = failing_hook
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "rules.yaml").write_text(RULES)
    db = tmp_path / "history.db"
    port = free_port()
    env = {
        **os.environ,
        "TORSHMON_WEBHOOK_URL": f"{hook}{HOOK_PATH}?{HOOK_QUERY}",
        "TORSHMON_WEBHOOK_TOKEN": WEBHOOK_TOKEN,
        "TORSHMON_SLACK_WEBHOOK_URL": hook + SLACK_PATH,
        # The exporter's own log quotes the URL's query: only the log filter scrubs it.
        "OTEL_EXPORTER_OTLP_ENDPOINT": (
            f"http://otel:{OTLP_PASSWORD}@127.0.0.1:{free_port()}/?api-key={OTLP_KEY}"
        ),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        # Long enough for a retry, which the exporter logs with the URL.
        "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
    }
    stderr = tmp_path / "stderr.log"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "torshmon.cli", "-v", "aggregator",
            "--port", str(port), "--db", f"sqlite:///{db}",
            "--token-file", str(tmp_path / "token"), "--rules", str(tmp_path / "rules.yaml"),
        ],
        stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    answers: list[str] = []
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.communicate()
            try:
                return '"ok"' in _get(base + "/healthz")
            except OSError:
                return False

        _wait_for(up, "the aggregator", 60)
        hello = wf.hello("leaky", 0, 1)
        body = wf.ingest_body(
            "agent", [(1, wf.record(hello, wf.batch(hello, 1, [wf.step(1, loss=1.0)])))]
        )
        request = urllib.request.Request(base + "/api/v1/ingest", data=body, method="POST")
        request.add_header("Authorization", f"Bearer {TOKEN}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
        # Both targets were tried (and failed) at least twice: retries are logged too.
        _wait_for(lambda: len(seen) >= 4, "notification attempts")
        _wait_for(lambda: "Transient error" in stderr.read_text(), "an OTLP export failure")
        for path in (
            "/healthz",
            "/metrics",
            "/api/v1/jobs",
            "/api/v1/alerts",
            "/api/v1/jobs/leaky",
        ):
            answers.append(_get(base + path, TOKEN))
        answers.append(_get(base + "/api/v1/jobs", "wrong-token"))
        answers.append(_get(base + "/api/v1/commands/999", TOKEN))
    finally:
        out, _ = _stop(proc)
    err = stderr.read_text()
    assert proc.returncode == 0, err
    assert any("Loss Too High" in answer for answer in answers)  # the alert fired
    assert "notify target webhook: HTTP 500: no route <redacted>" in err
    assert "notify target slack: HTTP 500" in err
    for answer in answers:
        _assert_clean("an API answer", answer)
    _assert_clean("the aggregator's output", out + err)
    assert "/v1/traces?<redacted>" in err  # the exporter logged its URL, scrubbed
    for path in tmp_path.glob("history.db*"):
        _assert_clean(path.name, path.read_bytes())
    assert json.loads(answers[2])["jobs"]  # the history did get written


@pytest.mark.parametrize(
    "env",
    [
        {"TORSHMON_WEBHOOK_URL": f"ftp://u:{PASSWORD}@h{HOOK_PATH}"},
        {"TORSHMON_SLACK_WEBHOOK_URL": f"http://[{SLACK_PATH}"},
        {"TORSHMON_WEBHOOK_URL": f"http://h{HOOK_PATH}", "TORSHMON_WEBHOOK_TOKEN": "a,b"},
    ],
)
def test_a_bad_notification_target_is_one_line_without_its_url(env: dict[str, str]) -> None:
    _failure(_cli("aggregator", "--port", "0", "--db", "sqlite://", env=env), 2, "TORSHMON_")
