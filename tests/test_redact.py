"""redact_url, url_secrets, Redactor and the log filter."""

from __future__ import annotations

import base64
import io
import logging

import pytest

from torshmon.agent.daemon import AgentSettings
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.redact import MASK, RedactingFilter, Redactor, redact_url, url_secrets


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:hunter2@db:5432/hist", f"postgresql://u:{MASK}@db:5432/hist"),
        (
            "postgresql+psycopg://u:p%40ss@db/h?sslkey=x",
            f"postgresql+psycopg://u:{MASK}@db/h?{MASK}",
        ),
        ("http://tok3n@host:9470/", f"http://{MASK}@host:9470/"),  # a lone user is a token
        # ... but in a database URL a role name, shown and not scrubbed from text.
        ("postgresql://postgres@db/h", "postgresql://postgres@db/h"),
        ("http://u:p@ss@host/", f"http://u:{MASK}@host/"),  # an unescaped @ in the password
        ("https://host/x#frag", f"https://host/x#{MASK}"),
        ("sqlite:///var/lib/torshmon.db", "sqlite:///var/lib/torshmon.db"),
        ("http://[::1", "<invalid URL>"),
    ],
)
def test_redact_url_hides_credentials_query_and_fragment(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_webhook_url_hides_its_path() -> None:
    url = "https://hooks.slack.com/services/T0AAA/B0BBB/XyZsecretXyZ"
    assert redact_url(url, secret_path=True) == f"https://hooks.slack.com/{MASK}"
    assert redact_url("https://h", secret_path=True) == "https://h"


def test_url_secrets_are_the_pieces_a_message_may_echo() -> None:
    basic = base64.b64encode(b"u:p@ss").decode()  # as an Authorization header holds it
    assert url_secrets("postgresql://u:p%40ss@db/h") == {"p%40ss", "p@ss", basic}
    assert url_secrets("postgresql://postgres@db/h") == set()
    assert url_secrets("http://host:1/") == set()
    hook = url_secrets("https://h/services/T0AAA/B0BBB/XyZsecretXyZ?x=1", secret_path=True)
    assert {"XyZsecretXyZ", "services", "/services/T0AAA/B0BBB/XyZsecretXyZ", "x=1"} <= hook
    assert "T0AAA" not in hook  # too short to tell from ordinary text


def test_redactor_scrubs_longest_first_and_skips_short_secrets() -> None:
    redact = Redactor(["abcdef", "abcdefghij", None, "tok"])  # type: ignore[list-item]
    assert redact("x abcdefghij y abcdef z tok token") == f"x {MASK} y {MASK} z tok token"
    redact.add_url("postgresql://u:hunter2@db/h")
    assert redact("auth failed for hunter2") == f"auth failed for {MASK}"


def test_log_filter_scrubs_message_arguments_and_traceback() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter(Redactor(["hunter2"])))
    logger = logging.getLogger("tests.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("cannot reach %s", "http://u:hunter2@h/")
        try:
            raise RuntimeError("password hunter2 refused")
        except RuntimeError:
            logger.exception("failed")
        logger.warning("bad %d arguments %s", "hunter2")  # logging's own error path
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    text = stream.getvalue()
    assert "cannot reach http://u:<redacted>@h/" in text
    assert "RuntimeError: password <redacted> refused" in text
    assert "hunter2" not in text


def test_settings_reprs_leave_secrets_out() -> None:
    with_url = AgentSettings(aggregator_url="http://u:hunter2@h:1/")
    with_token = AgentSettings(aggregator_url="http://h:1/", token="agent-secret-token")
    aggregator = AggregatorSettings(
        db_url="postgresql://u:hunter2@h/db",
        token="agg-secret-token",
        otlp_endpoint="http://u:hunter2@otel:4318",
    )
    for text in (repr(with_url), repr(with_token), repr(aggregator)):
        assert "hunter2" not in text and "secret-token" not in text


@pytest.mark.parametrize("token", ["", "  \n"])
def test_an_empty_token_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        AgentSettings(token=token)
    with pytest.raises(ValueError, match="empty"):
        AggregatorSettings(token=token)
