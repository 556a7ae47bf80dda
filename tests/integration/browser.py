"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client),
for tests of pages as a browser shows them: load a URL, collect console errors and
exceptions, evaluate an expression in the page."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

_LISTENING = re.compile(rb"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)")
START_TIMEOUT_S = 60.0


def chromium() -> str:
    """The Chromium executable (Debian's ``chromium``); RuntimeError if there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")


class Browser:
    """One headless Chromium with one page; ``async with Browser(tmp) as b``."""

    def __init__(self, profile: Path) -> None:
        self._profile = profile
        self._process: subprocess.Popen[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    async def __aenter__(self) -> Browser:
        self._process = subprocess.Popen(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}",
             "--window-size=1280,2000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        port = await asyncio.to_thread(self._port)
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
            targets = await response.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        for domain in ("Page", "Runtime", "Log"):
            await self.call(f"{domain}.enable")
        return self

    def _port(self) -> int:
        assert self._process is not None and self._process.stderr is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        seen = b""
        while time.monotonic() < deadline:
            line = self._process.stderr.readline()
            if not line and self._process.poll() is not None:
                break
            seen += line
            match = _LISTENING.search(line)
            if match:
                return int(match.group(2))
        raise RuntimeError(f"chromium did not start: {seen.decode(errors='replace')[-2000:]}")

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._process is not None:
            self._process.terminate()
            try:
                await asyncio.to_thread(self._process.wait, 20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                await asyncio.to_thread(self._process.wait)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command; its result (events meanwhile go to ``events``)."""
        assert self._ws is not None
        self._next_id += 1
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        while True:
            message = await self._receive(60.0)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    async def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self._ws is not None
        message = await self._ws.receive_json(timeout=timeout_s)
        if "method" in message:
            self.events.append(message)
        return dict(message)

    async def load(self, url: str, timeout_s: float = 60.0) -> None:
        """Navigate to ``url`` and wait for its load event."""
        self.events.clear()
        await self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{url} did not load in {timeout_s} s")
            await self._receive(left)

    async def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (JSON-serialisable)."""
        result = await self.call(
            "Runtime.evaluate", expression=f"JSON.stringify({expression})", returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return json.loads(result["result"]["value"])

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (a CSP violation,
        a resource that failed to load) since the last ``load``."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(str(params["exceptionDetails"]))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(str(params.get("args")))
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                found.append(f"{params['entry']['source']}: {params['entry']['text']}")
        return found
