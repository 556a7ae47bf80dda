"""The OTLP endpoint's traces URL."""

from __future__ import annotations

import pytest

from torshmon.aggregator.notify.otel import traces_url


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://otel:4318", "http://otel:4318/v1/traces"),
        ("http://otel:4318/", "http://otel:4318/v1/traces"),
        ("https://otel/v1/traces", "https://otel/v1/traces"),
        # The path goes before the query (an API key there stays a query parameter).
        ("https://u:pw@otel/tenant/?api-key=k", "https://u:pw@otel/tenant/v1/traces?api-key=k"),
    ],
)
def test_traces_url_adds_the_signal_path_to_the_path(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url
