"""What the commands share: exit statuses, the token, one-line failures, the API client."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from torshmon.redact import Redactor, redact_url

#: Exit status of a user error (bad flag, value, path or URL; a database or aggregator
#: that cannot be reached): one line on stderr, never a traceback. 1 is a failure.
USAGE_ERROR = 2
DEFAULT_AGGREGATOR_URL = "http://127.0.0.1:9470"
TOKEN_FILE_ENV = "TORSHMON_TOKEN_FILE"


class TokenError(Exception):
    """--token-file could not be read or is empty; the text says why."""


def read_token(args: argparse.Namespace, redact: Redactor, env: Mapping[str, str]) -> str | None:
    """The bearer token in ``--token-file``, else (with ``$TORSHMON_TOKEN`` unset, which
    the settings read themselves) in the file ``$TORSHMON_TOKEN_FILE`` names; None
    without either. From now on scrubbed by ``redact``; TokenError if unreadable or empty.

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
        raise TokenError(f"cannot read {source} {path}: {why}") from None
    if not token:
        # Else every agent is refused (or, for the aggregator, the API would take "").
        raise TokenError(f"{source} {path} is empty; put the bearer token in it")
    redact.add(token)
    return token


def fail(command: str, redact: Redactor, message: str, code: int) -> int:
    """Print ``torshmon COMMAND: message`` with the secrets scrubbed; returns ``code``."""
    print(redact(f"torshmon {command}: {message}"), file=sys.stderr)
    return code


def db_error(exc: Exception) -> str:
    """A database failure in a few words: the driver's message, not SQLAlchemy's wrapper
    (which adds the statement and a link), on one line."""
    from sqlalchemy.exc import DBAPIError

    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return " ".join(f"{type(orig or exc).__name__}: {orig or exc}".split())


def http_json(
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


def aggregator_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
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


def announcer(redact: Redactor) -> Callable[[str], None]:
    """Where a daemon says, once, where it listens and stores: stdout, with -v or not."""

    def announce(line: str) -> None:
        print(redact(line), flush=True)

    return announce
