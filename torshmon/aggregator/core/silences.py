"""Silences: who muted which alerts, until when.

A silence holds label matchers (``{"alertname": "Straggler", "job": "llm"}``): an alert
matches when each named label has exactly that value. While a silence is active
(``starts_at_unix_s <= now < ends_at_unix_s``) the aggregator notifies no target of a
matching alert's firing or resolution; the alert is still evaluated, stored and
listed, so nothing is lost, and a still-firing alert is notified once its silences
end. Silences always end: a request names a duration (at most ``MAX_DURATION_S``) or
an end time, and expiring one early sets its end to now.

``parse_request`` checks an API request body and says in one line what is wrong;
``SilenceBook`` is the aggregator's in-memory copy of the stored silences that have
not ended. Pure: no I/O, times are arguments.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["MAX_DURATION_S", "Silence", "SilenceBook", "SilenceRequest", "parse_request"]

#: The longest a silence may last: a forgotten silence must not hide alerts for ever.
MAX_DURATION_S: Final = 30 * 86400.0
MAX_MATCHERS: Final = 16
MAX_ACTIVE: Final = 1000
_LABEL: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_MAX_VALUE_CHARS: Final = 200
_MAX_WHO_CHARS: Final = 200
_MAX_COMMENT_CHARS: Final = 1000


@dataclass(frozen=True, slots=True)
class Silence:
    """One stored silence (``silences`` row)."""

    id: int
    matchers: Mapping[str, str]
    starts_at_unix_s: float
    ends_at_unix_s: float
    created_by: str
    comment: str

    def active(self, now_unix_s: float) -> bool:
        return self.starts_at_unix_s <= now_unix_s < self.ends_at_unix_s

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(name) == value for name, value in self.matchers.items())


@dataclass(frozen=True, slots=True)
class SilenceRequest:
    """A checked request to create a silence."""

    matchers: Mapping[str, str]
    starts_at_unix_s: float
    ends_at_unix_s: float
    created_by: str
    comment: str


def parse_request(body: Mapping[str, Any], now_unix_s: float) -> SilenceRequest:
    """The silence ``body`` asks for; ValueError with a one-line reason otherwise.

    ``matchers``: a non-empty object of label name -> string value (a number is taken
    as its text, so ``{"rank": 3}`` works); ``created_by``: who (required);
    ``comment``: why (optional); ``duration_s`` (seconds from the start) or
    ``ends_at_unix_s``; ``starts_at_unix_s`` (optional, default now).
    """
    unknown = set(body) - {
        "matchers",
        "created_by",
        "comment",
        "duration_s",
        "starts_at_unix_s",
        "ends_at_unix_s",
    }
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    matchers = _matchers(body.get("matchers"))
    created_by = body.get("created_by")
    if not isinstance(created_by, str) or not created_by.strip():
        raise ValueError("created_by: say who creates the silence (a non-empty string)")
    if len(created_by) > _MAX_WHO_CHARS:
        raise ValueError(f"created_by: at most {_MAX_WHO_CHARS} characters")
    comment = body.get("comment", "")
    if not isinstance(comment, str) or len(comment) > _MAX_COMMENT_CHARS:
        raise ValueError(f"comment: a string of at most {_MAX_COMMENT_CHARS} characters")
    # A start in the past means now (as in Alertmanager): a silence does not reach back.
    starts = max(_time(body, "starts_at_unix_s", now_unix_s), now_unix_s)
    if ("duration_s" in body) == ("ends_at_unix_s" in body):
        raise ValueError("give exactly one of duration_s and ends_at_unix_s")
    if "duration_s" in body:
        ends = starts + _positive(body["duration_s"], "duration_s")
    else:
        ends = _time(body, "ends_at_unix_s", now_unix_s)
        if ends <= starts:
            raise ValueError("ends_at_unix_s must be after the start")
    if ends - starts > MAX_DURATION_S:
        raise ValueError(f"a silence lasts at most {MAX_DURATION_S / 86400:g} days")
    return SilenceRequest(
        matchers=matchers,
        starts_at_unix_s=starts,
        ends_at_unix_s=ends,
        created_by=created_by.strip(),
        comment=comment,
    )


def _matchers(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not value:
        raise ValueError('matchers: a non-empty object of label -> value, e.g. {"job": "llm"}')
    if len(value) > MAX_MATCHERS:
        raise ValueError(f"matchers: at most {MAX_MATCHERS} labels")
    out: dict[str, str] = {}
    for name, raw in value.items():
        if not isinstance(name, str) or not _LABEL.match(name):
            raise ValueError(f"matchers: {name!r} is not a label name")
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            raise ValueError(f"matchers: the value of {name} must be a string")
        text = str(raw)
        if not text or len(text) > _MAX_VALUE_CHARS:
            raise ValueError(f"matchers: the value of {name} must have 1..{_MAX_VALUE_CHARS} chars")
        out[name] = text
    return out


def _positive(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name} must be a positive number of seconds")
    return seconds


def _time(body: Mapping[str, Any], name: str, default: float) -> float:
    if name not in body:
        return default
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a Unix time in seconds")
    if not math.isfinite(float(value)) or value < 0:
        raise ValueError(f"{name} must be a Unix time in seconds")
    return float(value)


class SilenceBook:
    """The silences that have not ended, by id. Not thread safe: the event loop's."""

    def __init__(self, silences: Iterable[Silence] = ()) -> None:
        self._silences: dict[int, Silence] = {s.id: s for s in silences}

    def __len__(self) -> int:
        return len(self._silences)

    def add(self, silence: Silence) -> None:
        self._silences[silence.id] = silence

    def expire(self, silence_id: int) -> None:
        self._silences.pop(silence_id, None)

    def prune(self, now_unix_s: float) -> None:
        """Forget the silences that have ended."""
        ended = [i for i, s in self._silences.items() if s.ends_at_unix_s <= now_unix_s]
        for silence_id in ended:
            del self._silences[silence_id]

    def silencing(self, labels: Mapping[str, str], now_unix_s: float) -> list[int]:
        """The ids of the active silences that match ``labels``, ascending."""
        return sorted(
            s.id for s in self._silences.values() if s.active(now_unix_s) and s.matches(labels)
        )
