"""Silences: what a request may ask for, and which alerts a silence holds back."""

from __future__ import annotations

from typing import Any

import pytest

from torshmon.aggregator.core.silences import (
    MAX_DURATION_S,
    Silence,
    SilenceBook,
    parse_request,
)

NOW = 1_800_000_000.0


def _body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"matchers": {"job": "llm"}, "duration_s": 600, "created_by": "ann"}
    body.update(overrides)
    return body


def test_a_request_becomes_a_silence_from_now_for_its_duration() -> None:
    req = parse_request(_body(matchers={"job": "llm", "rank": 3}, comment="node3 repair"), NOW)
    assert (req.starts_at_unix_s, req.ends_at_unix_s) == (NOW, NOW + 600)
    assert req.matchers == {"job": "llm", "rank": "3"}
    assert (req.created_by, req.comment) == ("ann", "node3 repair")


def test_a_start_in_the_past_means_now_and_an_end_time_may_replace_the_duration() -> None:
    body = _body(starts_at_unix_s=NOW - 3600, ends_at_unix_s=NOW + 60)
    del body["duration_s"]
    req = parse_request(body, NOW)
    assert (req.starts_at_unix_s, req.ends_at_unix_s) == (NOW, NOW + 60)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"matchers": {}}, "matchers"),
        ({"matchers": ["job"]}, "matchers"),
        ({"matchers": {"job": ""}}, "value of job"),
        ({"matchers": {"job": True}}, "value of job"),
        ({"matchers": {"1job": "x"}}, "label name"),
        ({"created_by": "  "}, "created_by"),
        ({"created_by": "x" * 201}, "created_by"),
        ({"comment": 3}, "comment"),
        ({"duration_s": 0}, "duration_s"),
        ({"duration_s": float("inf")}, "duration_s"),
        ({"duration_s": "1h"}, "duration_s"),
        ({"duration_s": MAX_DURATION_S + 1}, "at most 30 days"),
        ({"ends_at_unix_s": NOW + 5}, "exactly one"),
        ({"starts_at_unix_s": "now"}, "starts_at_unix_s"),
        ({"surprise": 1}, "unknown field"),
    ],
)
def test_a_bad_request_says_what_is_wrong(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_request(_body(**overrides), NOW)


def test_an_end_before_the_start_is_refused() -> None:
    body = _body(ends_at_unix_s=NOW - 1)
    del body["duration_s"]
    with pytest.raises(ValueError, match="after the start"):
        parse_request(body, NOW)


def _silence(silence_id: int, matchers: dict[str, str], start: float, end: float) -> Silence:
    return Silence(silence_id, matchers, start, end, "ann", "")


def test_the_book_names_the_active_silences_whose_every_matcher_is_equal() -> None:
    book = SilenceBook(
        [
            _silence(1, {"job": "llm"}, NOW - 10, NOW + 10),
            _silence(2, {"job": "llm", "rank": "3"}, NOW - 10, NOW + 10),
            _silence(3, {"job": "llm"}, NOW + 5, NOW + 10),  # not yet
            _silence(4, {"job": "other"}, NOW - 10, NOW + 10),
        ]
    )
    assert book.silencing({"job": "llm", "rank": "3", "alertname": "Straggler"}, NOW) == [1, 2]
    assert book.silencing({"job": "llm", "rank": "2"}, NOW) == [1]
    assert book.silencing({"rank": "3"}, NOW) == []
    assert book.silencing({"job": "llm", "rank": "3"}, NOW + 6) == [1, 2, 3]
    assert book.silencing({"job": "llm"}, NOW + 10) == []  # the end is exclusive
    book.expire(1)
    assert book.silencing({"job": "llm", "rank": "3"}, NOW) == [2]
    book.prune(NOW + 10)
    assert len(book) == 0
