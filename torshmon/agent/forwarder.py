"""Forwards the agent's spool to the aggregator over HTTP, and fetches its commands.

One task loops: peek the oldest spooled records, POST them as one IngestBatch
(gzip, bearer token), and on a 200 delete what the aggregator acknowledged and
hand its reply (commands for the probes) to ``on_reply``. Nothing is deleted
unless the aggregator said it stored it: on any failure the same records are
sent again, strictly in seq order, after an exponential backoff with jitter.
The aggregator de-duplicates by (agent id, seq), so a batch it stored but whose
reply was lost is harmless to resend. When nothing is spooled the loop still
polls every ``poll_interval_s`` with an empty batch so commands arrive.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gzip
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
import msgspec
from yarl import URL

from torshmon.agent.spool import Spool
from torshmon.aio import wait_event
from torshmon.backoff import backoff_s
from torshmon.redact import Redactor, redact_url, url_secrets
from torshmon.wire import SCHEMA_VERSION, IngestReply, WireError, decode_json

log = logging.getLogger(__name__)

_MAX_RECORDS_PER_BATCH: Final = 10_000
#: The least time between POSTs when urgent records cut the gathering wait short: at
#: 0.1 s an urgent step of a 60 ms job waited most of a step here on average.
URGENT_MIN_INTERVAL_S: Final = 0.05
#: After an urgent record, how long the agent still gathers before it POSTs: the
#: records of the same step from the node's other ranks (their shippers send as the
#: step ends while the lane is open) join the batch. Steps are only scored once every
#: rank's record is in, so without it a step's last record waited for the next POST.
#: The gather ends as soon as the node's records of the step are all in (``notify``'s
#: ``complete``).
URGENT_GATHER_S: Final = 0.015
_MAX_LOGGED_BODY_CHARS: Final = 500
#: The start of an error body that is scrubbed of secrets before it is cut for a log.
_SCRUBBED_BODY_BYTES: Final = 8192
#: zlib level 1: about half the CPU of the default 6 on the agent's JSON, which
#: still shrinks it more than tenfold (the agent's budget is CPU, not bandwidth).
GZIP_LEVEL: Final = 1


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One batch ready to POST: the gzipped body and the seqs it carries."""

    body_gz: bytes
    seqs: tuple[int, ...]
    raw_bytes: int

    @property
    def count(self) -> int:
        return len(self.seqs)

    @property
    def first_seq(self) -> int:
        return self.seqs[0]

    @property
    def last_seq(self) -> int:
        return self.seqs[-1]


@dataclass(frozen=True, slots=True)
class _Failure:
    """Why a POST did not deliver; ``state`` groups failures for log-once-per-change."""

    state: str
    error: str
    delay_s: float | None = None  # None: the usual exponential backoff


def check_aggregator_url(url: str, token: str | None = None) -> None:
    """ValueError unless ``url`` is http(s) with a host, and without credentials when a
    bearer ``token`` is given too; the message hides the credentials."""
    try:
        parsed = URL(url)
        host = parsed.host
    except (TypeError, ValueError) as exc:
        # ``from None``: the chained exception would show the URL in a traceback.
        reason = Redactor(url_secrets(url))(str(exc))
        raise ValueError(f"aggregator url {redact_url(url)} is not a valid URL: {reason}") from None
    if parsed.scheme not in ("http", "https") or not host:
        raise ValueError(
            f"aggregator url must be http:// or https:// with a host, got {redact_url(url)}"
        )
    if token is not None and (parsed.user is not None or parsed.password is not None):
        # aiohttp refuses such a request: both would be the Authorization header.
        raise ValueError(
            f"aggregator url {redact_url(url)} has credentials and a token is given too; "
            "give one of them"
        )


class Forwarder:
    """Sends spooled records to the aggregator at ``url``. ``async with`` or start()/aclose().

    All methods must be called from the event loop that ran ``start()``;
    ``notify()`` is not thread-safe (use ``loop.call_soon_threadsafe`` from
    another thread). Spool reads, acks and gzip run in worker threads.
    The counters below are for metrics; they are read without locking.
    """

    def __init__(
        self,
        spool: Spool,
        *,
        url: str,
        token: str | None,
        agent_id: str,
        node: str,
        on_reply: Callable[[IngestReply], None] | None = None,
        batch_max_bytes: int = 1 << 20,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        timeout_s: float = 10.0,
        poll_interval_s: float = 1.0,
        min_interval_s: float = 0.5,
        rng: random.Random | None = None,
    ) -> None:
        check_aggregator_url(url, token)
        parsed = URL(url)
        for name, value in (
            ("batch_max_bytes", batch_max_bytes),
            ("backoff_initial_s", backoff_initial_s),
            ("backoff_max_s", backoff_max_s),
            ("timeout_s", timeout_s),
            ("poll_interval_s", poll_interval_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self._spool = spool
        self._url = url
        # What logs may show: no credentials, query string or fragment.
        self.safe_url = str(parsed.with_user(None).with_query(None).with_fragment(None))
        # aiohttp's messages may quote the URL, as given or as yarl spells it, and a
        # failing server may echo the Authorization header.
        self._redact = Redactor([token] if token is not None else [])
        self._redact.add_url(url)
        self._redact.add_url(str(parsed))
        self._token = token
        self._batch_head = b'{"v":%d,"agent_id":%s,"node":%s,"records":[' % (
            SCHEMA_VERSION,
            msgspec.json.encode(agent_id),
            msgspec.json.encode(node),
        )
        self._on_reply = on_reply
        self.batch_max_bytes = batch_max_bytes
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._timeout_s = timeout_s
        self._poll_interval_s = poll_interval_s
        self._min_interval_s = min_interval_s
        self._rng = rng if rng is not None else random.Random()
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._complete = asyncio.Event()
        self._pacing = False
        self._closing = False
        self._poll_due = False
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._state = "ok"
        # Metrics.
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.auth_failed = False
        self.batches_sent = 0
        self.records_sent = 0
        self.failures_total = 0
        self.last_success_unix: float | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("Forwarder.start() called twice")
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self._timeout_s)
        )
        self._task = asyncio.create_task(self._run(), name="torshmon-forwarder")

    async def aclose(self, flush_timeout_s: float = 5.0) -> None:
        """Send what is spooled for up to ``flush_timeout_s``, then stop; safe to call twice.

        Whatever was not delivered stays in the spool for the next start.
        """
        task, self._task = self._task, None
        if task is not None:
            self._closing = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), flush_timeout_s)
            except asyncio.TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                log.warning(
                    "stopped forwarding to %s with %d records still spooled",
                    self.safe_url,
                    self._spool.records,
                )
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Forwarder:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def notify(self, *, urgent: bool = False, complete: bool = False) -> None:
        """New records were appended: send now rather than at the next poll, and when
        ``urgent`` also without waiting out ``min_interval_s`` to gather more; when
        ``complete`` (the node's records of the newest step are all in) without
        gathering the rest of that step (``URGENT_GATHER_S``) either."""
        self._wake.set()
        if urgent:
            self._urgent.set()
        if complete:
            self._complete.set()

    # -- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                delay = await self._step()
            except Exception as exc:
                # The forwarder must outlive anything unexpected (a full disk, a bug):
                # the data stays spooled and the next attempt may succeed.
                failure = _Failure(
                    "internal", f"forwarding to {self.safe_url} failed: {self._redact(repr(exc))}"
                )
                self._failed(failure, exc_info=True)
                delay = self._backoff_s()
            if delay is None:
                return
            if delay > 0 and self._pacing:
                # Gathering records between POSTs: an urgent record cuts it short, to
                # URGENT_MIN_INTERVAL_S at the least (a node of busy ranks would POST per
                # step otherwise). A backoff after a failure is never cut short.
                waited = time.monotonic()
                if await wait_event(self._urgent, delay):
                    # The node's other ranks finish the same step within a few ms:
                    # their records join this POST instead of waiting for the next.
                    await wait_event(self._complete, URGENT_GATHER_S)
                rest = URGENT_MIN_INTERVAL_S - (time.monotonic() - waited)
                if rest > 0:
                    await asyncio.sleep(rest)
            elif delay > 0:
                await asyncio.sleep(delay)

    async def _step(self) -> float | None:
        """One attempt; the seconds to wait before the next one, or None to stop."""
        self._wake.clear()
        self._urgent.clear()
        self._complete.clear()
        self._pacing = False
        prepared = await asyncio.to_thread(self._prepare)
        if prepared.count == 0:
            if self._closing:
                return None
            if not self._poll_due:
                self._poll_due = not await self._wait_for_wake(self._poll_interval_s)
                return 0.0
        self._poll_due = False
        outcome = await self._post(prepared)
        if not isinstance(outcome, _Failure):
            self._succeeded(outcome)
            # Let records gather between POSTs (each costs a request, a gzip and a
            # spool transaction). A batch at least half the size bound is a backlog
            # (the next record may simply not have fitted): go on at once.
            full = 2 * prepared.raw_bytes >= self.batch_max_bytes
            full = full or prepared.count >= _MAX_RECORDS_PER_BATCH
            if full or self._closing:
                return 0.0
            self._pacing = True
            return self._min_interval_s
        self._failed(outcome)
        return outcome.delay_s if outcome.delay_s is not None else self._backoff_s()

    async def _wait_for_wake(self, timeout_s: float) -> bool:
        """True if notify() woke us, False after ``timeout_s``."""
        return await wait_event(self._wake, timeout_s)

    def _prepare(self) -> _Prepared:
        """Peek the oldest records and splice them, undecoded, into a gzipped IngestBatch."""
        records = self._spool.peek(_MAX_RECORDS_PER_BATCH, self.batch_max_bytes)
        body = b"".join(
            (
                self._batch_head,
                b",".join(b'{"seq":%d,"record":%s}' % (seq, payload) for seq, payload in records),
                b"]}",
            )
        )
        seqs = tuple(seq for seq, _ in records)
        return _Prepared(gzip.compress(body, compresslevel=GZIP_LEVEL), seqs, len(body))

    async def _post(self, prepared: _Prepared) -> int | _Failure:
        """POST one batch; the number of records the aggregator stored, or why none were."""
        if self._session is None:
            raise RuntimeError("Forwarder is not started")
        try:
            async with self._session.post(self._url, data=prepared.body_gz) as resp:
                status = resp.status
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            detail = self._redact(str(exc).replace(self._url, self.safe_url)) or "timed out"
            return _Failure("unreachable", f"cannot reach {self.safe_url}: {detail}")
        if status == 200:
            return await self._accept(prepared, body)
        return self._classify(status, body, prepared)

    async def _accept(self, prepared: _Prepared, body: bytes) -> int | _Failure:
        try:
            reply = decode_json(body, IngestReply)
        except WireError as exc:
            return _Failure("bad-reply", f"aggregator at {self.safe_url} sent a bad reply: {exc}")
        if prepared.count:
            if reply.acked_seq < prepared.first_seq:
                # Not stored: sending the same batch again at once would spin.
                return _Failure(
                    "not-acked",
                    f"aggregator at {self.safe_url} acknowledged seq {reply.acked_seq}, "
                    f"below the batch's first seq {prepared.first_seq}",
                )
            # Never trust an ack beyond what was sent: a spool recreated with
            # restarted seqs must not lose its records to an old high-water mark.
            through = min(reply.acked_seq, prepared.last_seq)
            await asyncio.to_thread(self._spool.ack, through)
            acked = bisect.bisect_right(prepared.seqs, through)
        else:
            acked = 0
        if self._on_reply is not None:
            try:
                self._on_reply(reply)
            except Exception:
                log.exception("on_reply failed for a reply from %s", self.safe_url)
        return acked

    def _classify(self, status: int, body: bytes, prepared: _Prepared) -> _Failure:
        # Scrubbed before it is cut short: a cut could leave half a secret unmatched.
        text = self._redact(body[:_SCRUBBED_BODY_BYTES].decode("utf-8", "replace"))
        text = text[:_MAX_LOGGED_BODY_CHARS].strip()
        if status in (401, 403):
            return _Failure(
                "auth",
                f"aggregator at {self.safe_url} rejected the agent's token ({status}); "
                "data stays in the spool",
                delay_s=self._backoff_max_s,
            )
        if status == 413:
            if prepared.count > 1:
                self.batch_max_bytes = max(1, self.batch_max_bytes // 2)
                # A smaller batch is a different request: retry it at once.
                return _Failure(
                    "too-large",
                    f"aggregator at {self.safe_url} refused a batch of {prepared.count} records "
                    f"as too large (413); batches are now at most {self.batch_max_bytes} bytes",
                    delay_s=0.0,
                )
            return _Failure(
                "too-large",
                f"aggregator at {self.safe_url} refused single record seq {prepared.first_seq} "
                "as too large (413); it stays in the spool and blocks the ones after it",
                delay_s=self._backoff_max_s,
            )
        if status >= 500:
            return _Failure(
                "server-error", f"aggregator at {self.safe_url} failed ({status}): {text}"
            )
        return _Failure(
            f"rejected-{status}",
            f"aggregator at {self.safe_url} rejected a batch ({status}): {text}; "
            "data stays in the spool",
        )

    # -- state ----------------------------------------------------------------------------

    def _succeeded(self, acked: int) -> None:
        if self._state != "ok":
            log.info(
                "forwarding to %s works again after %d failed attempts",
                self.safe_url,
                self.consecutive_failures,
            )
        self._state = "ok"
        self.consecutive_failures = 0
        self.last_error = None
        self.auth_failed = False
        self.last_success_unix = time.time()
        if acked:
            self.batches_sent += 1
            self.records_sent += acked

    def _failed(self, failure: _Failure, *, exc_info: bool = False) -> None:
        """Count a failure; log it when the kind of failure changed (not every retry)."""
        self.consecutive_failures += 1
        self.failures_total += 1
        self.last_error = failure.error
        self.auth_failed = failure.state == "auth"
        if failure.state != self._state:
            # Errors need a person (a token, a limit, a bug); warnings heal themselves.
            heals = failure.state in ("unreachable", "server-error", "bad-reply", "not-acked")
            level = logging.WARNING if heals else logging.ERROR
            log.log(level, "%s", failure.error, exc_info=exc_info)
        elif failure.state == "too-large":
            log.warning("%s", failure.error)
        self._state = failure.state

    def _backoff_s(self) -> float:
        """Exponential in the failures so far, capped, with half of it randomised."""
        return backoff_s(
            self.consecutive_failures,
            initial_s=self._backoff_initial_s,
            max_s=self._backoff_max_s,
            rng=self._rng,
        )


__all__ = ["Forwarder", "check_aggregator_url"]
