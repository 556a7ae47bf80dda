"""Reading request bodies: gzip."""

from __future__ import annotations

import gzip

import pytest
from aiohttp import web

from torshmon.aggregator.guard import gunzip


def test_gunzip_takes_exactly_one_bounded_gzip_stream() -> None:
    body = b'{"sql": "SELECT 1"}'
    assert gunzip(gzip.compress(body), 1024) == body
    for broken in (
        body,  # not gzip at all
        gzip.compress(body) + b"garbage",
        gzip.compress(body)[:-3],
        gzip.compress(body) + gzip.compress(body),  # a second member: trailing bytes here
    ):
        with pytest.raises(web.HTTPBadRequest):
            gunzip(broken, 1024)
    with pytest.raises(web.HTTPRequestEntityTooLarge):
        gunzip(gzip.compress(b"\0" * 10_000), 1024)
