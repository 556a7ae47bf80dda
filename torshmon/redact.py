"""Keeping secrets out of what torshmon prints, logs, stores and answers.

Secrets are bearer tokens, the credentials in a URL (a database, aggregator or OTLP
URL's password or lone user name) and whole webhook URLs (a Slack webhook URL is
itself the credential). Two tools, used wherever text leaves the process:

- ``redact_url`` writes a URL so that a person can still tell which one it is.
- ``Redactor`` holds the secrets a process was given and scrubs them out of any
  text: messages, exception text, log records (``RedactingFilter``).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable
from typing import Final
from urllib.parse import unquote, urlsplit

__all__ = ["MASK", "RedactingFilter", "Redactor", "redact_url", "url_secrets"]

MASK: Final = "<redacted>"
#: Shorter secrets are not scrubbed from free text: they cannot be told from words
#: ("tok" in "token"). ``redact_url`` still masks them where a URL holds them.
MIN_SECRET_CHARS: Final = 4
#: Shorter path segments of a secret URL ("hooks", "v1") are not secret themselves.
_MIN_SEGMENT_CHARS: Final = 6


def redact_url(url: str, *, secret_path: bool = False) -> str:
    """``url`` fit to show: the password masked (in an HTTP URL a lone user name too,
    often a token; in a database URL it is a role name, and stays),
    the query and fragment masked, and with ``secret_path`` (webhooks) the path too.

    Never raises; an unparseable URL comes back as ``<invalid URL>``.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid URL>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        if colon:
            hostport = f"{user}:{MASK}@{hostport}"
        else:
            hostport = f"{MASK if _is_http(parts.scheme) else user}@{hostport}"
    path = parts.path
    if secret_path and path not in ("", "/"):
        path = "/" + MASK
    # By hand, not urlunsplit: that drops the "//" of sqlite:///PATH.
    head = f"{parts.scheme}:" if parts.scheme else ""
    if url[len(head) :].startswith("//"):
        head += "//"
    query = f"?{MASK}" if parts.query else ""
    fragment = f"#{MASK}" if parts.fragment else ""
    return f"{head}{hostport}{path}{query}{fragment}"


def url_secrets(url: str, *, secret_path: bool = False) -> set[str]:
    """The pieces of ``url`` no text may show: its password, or an HTTP URL's lone user
    name (as written, decoded and in a Basic Authorization header), query and fragment; with
    ``secret_path`` the URL itself,
    its path and the path's longer segments (a server may echo any of them)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return {url}  # what cannot be parsed cannot be shown in part either
    found: set[str] = {parts.query, parts.fragment}
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        # A database URL's lone user is a role name ("postgres"): not a secret, and
        # scrubbing it would mangle every "postgresql" in a message.
        if colon or _is_http(parts.scheme):
            found.add(password if colon else user)
            # As an HTTP client sends them, which a server may echo back.
            basic = f"{unquote(user)}:{unquote(password)}".encode("latin-1", "replace")
            found.add(base64.b64encode(basic).decode())
    if secret_path:
        found.update((url, parts.path, parts.path.strip("/")))
        found.update(s for s in parts.path.split("/") if len(s) >= _MIN_SEGMENT_CHARS)
    found |= {unquote(s) for s in found}
    return {s for s in found if s}


def _is_http(scheme: str) -> bool:
    return scheme.lower() in ("http", "https")


class Redactor:
    """The secrets one process knows, and ``__call__`` to scrub them out of text.

    Add secrets as they become known (``add``, ``add_url``); thread-safe enough for
    that: the set is replaced, not mutated, so a reader sees the old or the new one.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets: tuple[str, ...] = ()
        self.add(*secrets)

    def add(self, *secrets: str | None) -> None:
        """Scrub each of ``secrets`` (None and short ones are skipped)."""
        known = set(self._secrets)
        known.update(s for s in secrets if s is not None and len(s) >= MIN_SECRET_CHARS)
        # Longest first, so that a whole URL goes before the path inside it.
        self._secrets = tuple(sorted(known, key=len, reverse=True))

    def add_url(self, url: str | None, *, secret_path: bool = False) -> None:
        """Scrub the secret pieces of ``url`` (see ``url_secrets``)."""
        if url:
            self.add(*url_secrets(url, secret_path=secret_path))

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text


class RedactingFilter(logging.Filter):
    """A handler filter that scrubs a record's message, traceback and stack.

    Install it on handlers, not loggers: a logger's filters miss the records its
    children propagate. The record is rendered here, so later handlers see the
    scrubbed text too.
    """

    _traceback: Final = logging.Formatter()

    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: logging reports it
            message = f"{record.msg} {record.args}"
        record.msg = self._redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._traceback.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self._redact(record.stack_info)
        return True
