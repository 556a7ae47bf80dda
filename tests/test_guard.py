"""The HTTP request guard: Host names, origins, content types, gzip bodies."""

from __future__ import annotations

import gzip

import pytest
from aiohttp import web
from multidict import CIMultiDict

from torshmon.aggregator.http.guard import RequestGuard, gunzip
from torshmon.aggregator.settings import AggregatorSettings

JSON = {"Content-Type": "application/json"}


def _guard(**settings: object) -> RequestGuard:
    return RequestGuard(AggregatorSettings(port=9470, db_url="sqlite://", **settings))  # type: ignore[arg-type]


def _status(guard: RequestGuard, method: str, headers: dict[str, str]) -> int:
    try:
        guard.check(method, CIMultiDict(headers))
    except web.HTTPException as exc:
        return exc.status
    return 200


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:9470",
        "localhost:9470",
        "LOCALHOST",
        "[::1]:9470",
        "10.0.0.7:9470",  # an IP literal cannot be rebound
        "[fe80::1]",
        "torshmon.internal:9470",  # allowed_hosts
        "dash.example.org",  # external_url's host
    ],
)
def test_loopback_configured_and_ip_hosts_are_served(host: str) -> None:
    guard = _guard(
        allowed_hosts=("Torshmon.Internal",), external_url="https://dash.example.org/torshmon"
    )
    assert _status(guard, "GET", {"Host": host}) == 200
    assert _status(guard, "POST", {"Host": host, **JSON}) == 200


def test_other_host_names_are_misdirected_with_how_to_allow_them() -> None:
    guard = _guard()
    with pytest.raises(web.HTTPMisdirectedRequest) as refused:
        guard.check("GET", CIMultiDict({"Host": "evil.example:9470"}))
    assert refused.value.text == (
        "Host 'evil.example' is not a name of this aggregator; allow it with --allowed-host "
        "evil.example (TORSHMON_ALLOWED_HOSTS, allowed_hosts in the config file)"
    )
    assert _status(guard, "GET", {"Host": "localhost.evil.example"}) == 421
    for malformed in ("evil@127.0.0.1", "127.0.0.1/x", "[::1", "a b", "127.0.0.1:x"):
        assert _status(guard, "GET", {"Host": malformed}) == 400, malformed


def test_the_bearer_token_vouches_for_any_host_name() -> None:
    """Agents on other nodes reach a 0.0.0.0 aggregator by its DNS name with the token;
    a page that rebinds a name to it does not know the token."""
    guard = _guard(host="0.0.0.0", token="t0k")
    assert (
        _status(guard, "GET", {"Host": "agg-3.cluster:9470", "Authorization": "Bearer t0k"}) == 200
    )
    assert (
        _status(guard, "GET", {"Host": "agg-3.cluster:9470", "Authorization": "Bearer no"}) == 421
    )
    assert _status(guard, "GET", {"Host": "agg-3.cluster:9470"}) == 421


@pytest.mark.parametrize(
    ("method", "headers", "status"),
    [
        ("POST", {"Content-Type": "text/plain"}, 415),
        ("POST", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ("POST", {"Content-Type": "multipart/form-data; boundary=x"}, 415),
        ("POST", {}, 415),  # an empty no-cors POST is a simple request too
        ("POST", {"Content-Type": "Application/JSON; charset=utf-8"}, 200),
        ("POST", {**JSON, "Origin": "http://evil.example"}, 403),
        ("POST", {**JSON, "Origin": "null"}, 403),
        ("POST", {**JSON, "Origin": "http://127.0.0.1:8888"}, 403),  # another local port
        ("POST", {**JSON, "Origin": "http://127.0.0.1:9470"}, 200),
        ("POST", {**JSON, "Origin": "https://127.0.0.1:9470"}, 200),  # behind TLS
        ("POST", {**JSON, "Sec-Fetch-Site": "cross-site"}, 403),
        ("POST", {**JSON, "Sec-Fetch-Site": "same-site"}, 403),
        ("POST", {**JSON, "Sec-Fetch-Site": "same-origin"}, 200),
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}, 403),
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}, 403),
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}, 200),
        ("GET", {"Sec-Fetch-Site": "none"}, 200),
        ("GET", {"Origin": "http://evil.example"}, 403),
    ],
)
def test_cross_site_requests_and_bodies_that_are_not_json_are_refused(
    method: str, headers: dict[str, str], status: int
) -> None:
    assert _status(_guard(), method, {"Host": "127.0.0.1:9470", **headers}) == status


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
