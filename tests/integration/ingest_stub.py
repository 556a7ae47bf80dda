"""A small real HTTP receiver standing in for the aggregator's ingest API in agent tests.

It checks the bearer token, gunzips and validates every body against the wire
schema, stores each record once per (agent id, seq) and answers with the
highest seq stored plus any commands queued for the agent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from aiohttp import web

from torshmon.wire import (
    SCHEMA_VERSION,
    Batch,
    Command,
    IngestBatch,
    IngestReply,
    SpoolRecord,
    WireError,
    decode_json,
    encode_json,
)


class IngestStub:
    """``start()`` / ``stop()`` any number of times on a fixed port, from a plain thread."""

    def __init__(self, port: int, token: str | None = "secret") -> None:
        self.port = port
        self.token = token
        self.records: dict[tuple[str, int], SpoolRecord] = {}
        self.duplicates = 0
        self.rejected_auth = 0
        self.commands: list[Command] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> IngestStub:
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/api/v1/ingest", self._ingest)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _ingest(self, request: web.Request) -> web.Response:
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            self.rejected_auth += 1
            return web.json_response({"error": "bad token"}, status=401)
        if request.headers.get("Content-Encoding") != "gzip":
            return web.json_response({"error": "expected a gzip body"}, status=400)
        body = await request.read()  # aiohttp has already undone the gzip encoding
        try:
            batch = decode_json(body, IngestBatch)
        except WireError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        with self._lock:
            for item in batch.records:
                key = (batch.agent_id, item.seq)
                if key in self.records:
                    self.duplicates += 1
                self.records.setdefault(key, item.record)
            acked = max((seq for agent, seq in self.records if agent == batch.agent_id), default=0)
            commands, self.commands = self.commands, []
        reply = IngestReply(v=SCHEMA_VERSION, acked_seq=acked, commands=commands)
        return web.Response(body=encode_json(reply), content_type="application/json")

    def batches(self) -> Iterator[Batch]:
        with self._lock:
            records = [self.records[k] for k in sorted(self.records)]
        for record in records:
            for message in record.messages:
                if isinstance(message, Batch):
                    yield message

    def steps(self, job: str) -> dict[int, list[int]]:
        """Step numbers received per rank of ``job``, in arrival order."""
        out: dict[int, list[int]] = {}
        for batch in self.batches():
            if batch.job == job:
                out.setdefault(batch.rank, []).extend(s.step for s in batch.steps)
        return out
