"""A real aggregator on a loopback port, run on its own event-loop thread for sync tests."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, func, select

from torshmon.aggregator.service import INGEST_PATH, Aggregator
from torshmon.aggregator.settings import AggregatorSettings
from torshmon.history.models import Base

T = TypeVar("T")


class AggregatorThread:
    """``with AggregatorThread(settings) as agg:``; ``agg.call(coro)`` runs on its loop."""

    def __init__(self, settings: AggregatorSettings, *, targets: Sequence[Any] = ()) -> None:
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.aggregator = Aggregator(settings, registry=CollectorRegistry(), targets=list(targets))

    def __enter__(self) -> AggregatorThread:
        self._thread.start()
        self.call(self.aggregator.start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.aggregator.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.aggregator.port}"

    def post_ingest(
        self, body: bytes, *, token: str | None = None, compress: bool = True
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json"}
        if compress:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        token = token if token is not None else self.settings.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return request(self.url + INGEST_PATH, body, headers)

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        headers = {}
        if self.settings.token:
            headers["Authorization"] = f"Bearer {self.settings.token}"
        return request(self.url + path, None, headers)

    def post_json(self, path: str, payload: Any) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json"}
        if self.settings.token:
            headers["Authorization"] = f"Bearer {self.settings.token}"
        return request(self.url + path, json.dumps(payload).encode(), headers)


def request(url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=body, headers=headers, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")}


def count(url: str, table: str) -> int:
    """Rows of ``table`` in the history database at ``url``."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(Base.metadata.tables[table])
                ).scalar_one()
            )
    finally:
        engine.dispose()
