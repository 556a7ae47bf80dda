"""Sends firing and resolved alerts to Slack, generic webhooks and Alertmanager.

``Notifier.submit()`` is called on the ingest path, so it never blocks or raises: it
puts each alert on one bounded queue per target (dropping the oldest when full) and
returns. One worker task per target waits ``group_wait_s`` after the first alert,
groups what arrived by (alertname, job), and sends one message per group, retrying
connection errors, 5xx and 429 with exponential backoff and jitter. A dead endpoint
therefore only delays its own queue.

Targets are in ``targets``, Alertmanager's payloads in ``alertmanager``, Slack's in
``slack``. Webhook URLs and tokens are secrets (a Slack webhook URL is a credential): logs and
exception messages name a target by its ``name`` only, and anything a server or an
exception says is scrubbed of the target's URL, path and token before it is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timezone
from typing import Any, Final

import aiohttp
import msgspec

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.notify.alertmanager import (
    alertmanager_v2_alerts,
    alertmanager_webhook_payload,
    group_alerts,
    group_indices,
)
from torshmon.aggregator.notify.slack import slack_payload
from torshmon.aggregator.notify.targets import (
    AlertmanagerTarget,
    SlackTarget,
    Target,
    WebhookTarget,
)
from torshmon.aio import wait_event
from torshmon.backoff import backoff_s
from torshmon.redact import Redactor
from torshmon.version import __version__

log = logging.getLogger(__name__)

_DEDUP_CAPACITY: Final = 65536
_MAX_LOGGED_BODY_CHARS: Final = 200
#: The start of an error body that is scrubbed of secrets before it is cut for a log.
_SCRUBBED_BODY_BYTES: Final = 8192


# -- retries ------------------------------------------------------------------------------


def retry_delay_s(
    attempt: int,
    *,
    initial_s: float,
    max_s: float,
    rng: random.Random,
    retry_after_s: float | None = None,
) -> float:
    """Seconds to wait after failed ``attempt`` (1-based): ``initial_s * 2**(attempt-1)``
    capped at ``max_s``, randomised to between half and all of it. A server's
    Retry-After wins when longer, up to ``max_s``."""
    delay = backoff_s(attempt, initial_s=initial_s, max_s=max_s, rng=rng)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, max_s))
    return delay


def parse_retry_after(value: str | None, *, now_unix_s: float) -> float | None:
    """A Retry-After header (delta seconds or an HTTP date) as seconds from now, or None."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - now_unix_s
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


# -- the notifier -------------------------------------------------------------------------


#: The counters ``Notifier.stats()`` reports per target. Messages: sent, failed (given
#: up), retries (extra attempts). Alerts: dropped (queue full, or unsent at close or
#: after it), deduplicated (already delivered or queued in that state); queued (a gauge).
STAT_NAMES: Final = (
    "sent_total",
    "failed_total",
    "dropped_total",
    "retries_total",
    "deduplicated_total",
    "queued",
)


@dataclass(frozen=True, slots=True)
class _Settings:
    group_wait_s: float
    max_queue: int
    retry_initial_s: float
    retry_max_s: float
    max_attempts: int
    timeout_s: float
    external_url: str
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    rng: random.Random


@dataclass(frozen=True, slots=True)
class _Item:
    alert: Alert
    seq: int


@dataclass(frozen=True, slots=True)
class _Attempt:
    ok: bool
    retryable: bool = False
    condition: str = "ok"
    detail: str = ""
    retry_after_s: float | None = None


class Notifier:
    """Delivers alerts to ``targets``; ``async with`` or start()/aclose().

    Each target has its own queue of at most ``max_queue`` alerts and its own worker,
    which sends a message at most ``max_attempts`` times, waiting ``retry_delay_s()``
    between attempts; each attempt is limited to ``timeout_s``. ``clock`` (monotonic
    seconds) schedules Alertmanager re-sends; ``wall_clock`` (Unix seconds) stamps
    ``endsAt``; ``external_url`` (the aggregator's URL) goes into the payloads.

    ``submit()`` must be called on the event loop's thread (it is not thread-safe);
    it may be called before ``start()``: alerts wait in the queues.
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        group_wait_s: float = 0.2,
        max_queue: int = 10000,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        max_attempts: int = 8,
        timeout_s: float = 5.0,
        external_url: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        for name, value in (
            ("retry_initial_s", retry_initial_s),
            ("retry_max_s", retry_max_s),
            ("timeout_s", timeout_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (group_wait_s >= 0 and math.isfinite(group_wait_s)):
            raise ValueError(f"group_wait_s must be zero or more seconds, got {group_wait_s}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        names = [t.name for t in targets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"target names must be unique; repeated: {', '.join(duplicates)}")
        self._settings = _Settings(
            group_wait_s=group_wait_s,
            max_queue=max_queue,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            max_attempts=max_attempts,
            timeout_s=timeout_s,
            external_url=external_url,
            clock=clock,
            wall_clock=wall_clock,
            rng=rng if rng is not None else random.Random(),
        )
        self._workers = [_Worker(target, self._settings) for target in targets]
        self._session: aiohttp.ClientSession | None = None
        self._started = False
        self._closed = False

    def set_external_url(self, url: str) -> None:
        """Messages from now on link to ``url``: the aggregator's address once it
        listens (a configured port 0 is known only then), not ``http://host:0``."""
        self._settings = replace(self._settings, external_url=url)
        for worker in self._workers:
            worker._s = self._settings

    async def start(self) -> None:
        """Start one worker task per target. RuntimeError if started before."""
        if self._started or self._closed:
            raise RuntimeError("Notifier.start() called twice or after aclose()")
        self._started = True
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.timeout_s),
            headers={"Content-Type": "application/json", "User-Agent": f"torshmon/{__version__}"},
        )
        for worker in self._workers:
            worker.start(self._session)

    async def aclose(self, flush_timeout_s: float = 5.0) -> None:
        """Deliver what is queued for up to ``flush_timeout_s``, then stop; safe to call twice.

        Alerts still undelivered at the deadline are counted as dropped.
        """
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.close()
        tasks = [w.task for w in self._workers if w.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=flush_timeout_s)
            for task in late:
                task.cancel()
            # Every task is awaited even if one of them failed: none is left orphaned.
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for worker in self._workers:
            worker.abandon()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Notifier:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def submit(self, alerts: Sequence[Alert]) -> None:
        """Queue firing and resolved alerts for every target; never blocks or raises.

        Pending alerts, alerts whose rule has no ``notify`` action and alerts submitted
        after ``aclose()`` are not sent. A resolved alert without an end time ends now.
        """
        try:
            batch = list(alerts)
        except TypeError:
            log.error("submitting alerts for notification failed: not a sequence of alerts")
            return
        for alert in batch:
            # One bad item costs only itself: the ingest path must not fail, and the other
            # alerts of the batch must still go out, because of a notification problem.
            try:
                if alert.state not in ("firing", "resolved") or "notify" not in alert.actions:
                    continue
                if alert.state == "resolved" and alert.ends_at_unix_s is None:
                    alert = replace(alert, ends_at_unix_s=self._settings.wall_clock())
                for worker in self._workers:
                    worker.offer(alert, closed=self._closed)
            except Exception:
                log.exception("submitting an alert for notification failed")

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters (STAT_NAMES) per target name, for the torshmon_notifications_* metrics."""
        return {worker.target.name: worker.stats() for worker in self._workers}


class _Worker:
    """The queue, de-duplication state, delivery loop and counters of one target."""

    def __init__(self, target: Target, settings: _Settings) -> None:
        self.target = target
        self._s = settings
        self._queue: deque[_Item] = deque()
        self._inflight: list[_Item] = []
        self._seq = 0
        # fingerprint -> (state, seq) of the newest alert accepted for this target, and
        # fingerprint -> state last delivered; both bounded, oldest forgotten first.
        self._accepted: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._delivered: OrderedDict[str, str] = OrderedDict()
        # Alertmanager only: firing alerts delivered, re-sent so they do not time out.
        self._active: dict[str, Alert] = {}
        self._next_resend_s: float | None = None
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self.task: asyncio.Task[None] | None = None
        self._condition = "ok"
        self._url, headers = _endpoint(target)
        self._headers = headers
        self._redact = _redactor(target)
        self.sent_total = 0
        self.failed_total = 0
        self.dropped_total = 0
        self.retries_total = 0
        self.deduplicated_total = 0

    def stats(self) -> dict[str, int]:
        return {
            "sent_total": self.sent_total,
            "failed_total": self.failed_total,
            "dropped_total": self.dropped_total,
            "retries_total": self.retries_total,
            "deduplicated_total": self.deduplicated_total,
            "queued": len(self._queue) + len(self._inflight),
        }

    # -- queue ----------------------------------------------------------------------------

    def offer(self, alert: Alert, *, closed: bool) -> None:
        if closed:
            self.dropped_total += 1
            return
        accepted = self._accepted.get(alert.fingerprint)
        if accepted is not None and accepted[0] == alert.state:
            self.deduplicated_total += 1
            return
        if len(self._queue) >= self._s.max_queue:
            self._forget(self._queue.popleft())
            self.dropped_total += 1
            if self.dropped_total == 1 or self.dropped_total % 1000 == 0:
                log.warning(
                    "notify target %s: queue full (%d alerts), %d oldest alerts dropped so far",
                    self.target.name,
                    self._s.max_queue,
                    self.dropped_total,
                )
        self._seq += 1
        self._remember(self._accepted, alert.fingerprint, (alert.state, self._seq))
        self._queue.append(_Item(alert, self._seq))
        self._wake.set()

    def _forget(self, item: _Item) -> None:
        """An alert that will never be delivered: a re-submission of it may go again."""
        fingerprint = item.alert.fingerprint
        if self._accepted.get(fingerprint, ("", -1))[1] != item.seq:
            return  # a newer state of the same alert is queued; it decides
        delivered = self._delivered.get(fingerprint)
        if delivered is None:
            self._accepted.pop(fingerprint, None)
        else:
            self._accepted[fingerprint] = (delivered, -1)

    @staticmethod
    def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > _DEDUP_CAPACITY:
            table.popitem(last=False)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self.task = asyncio.create_task(self._run(), name=f"torshmon-notify-{self.target.name}")

    def close(self) -> None:
        self._closing.set()
        self._wake.set()

    def abandon(self) -> None:
        """After the flush deadline: count what was never delivered."""
        lost = len(self._queue) + len(self._inflight)
        if lost:
            log.warning(
                "notify target %s: stopped with %d alerts undelivered", self.target.name, lost
            )
            self.dropped_total += lost
        self._queue.clear()
        self._inflight = []

    async def _run(self) -> None:
        while True:
            try:
                if not await self._step():
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The worker must outlive a bug; what it was sending is given up.
                log.error(
                    "notify target %s: internal error %s", self.target.name, self._redact(repr(exc))
                )
                self.failed_total += 1
                for item in self._inflight:
                    self._forget(item)
                self._inflight = []
                await asyncio.sleep(self._s.retry_initial_s)

    async def _step(self) -> bool:
        """Send one round (new alerts or a re-send); False once closed and drained."""
        if not self._queue:
            if self._closing.is_set():
                return False
            await _wait(self._wake, self._resend_wait_s())
            self._wake.clear()
            if not self._queue:
                if self._resend_due():
                    await self._resend()
                return True
        # Let the rest of a burst arrive so it goes as one message; closing cuts it short.
        await _wait(self._closing, self._s.group_wait_s)
        self._wake.clear()
        drained = self._inflight = list(self._queue)
        self._queue.clear()
        batch = [item.alert for item in drained]
        for key, indices in group_indices(batch):
            ok = await self._deliver(key, [batch[i] for i in indices])
            items = [drained[i] for i in indices]
            for item in items:
                if ok:
                    self._delivered_one(item.alert)
                else:
                    self._forget(item)
            done = {item.seq for item in items}
            self._inflight = [item for item in self._inflight if item.seq not in done]
        return True

    def _delivered_one(self, alert: Alert) -> None:
        self._remember(self._delivered, alert.fingerprint, alert.state)
        if not isinstance(self.target, AlertmanagerTarget):
            return
        if alert.state == "firing":
            self._active[alert.fingerprint] = alert
        else:
            self._active.pop(alert.fingerprint, None)
        if self._active and self._next_resend_s is None:
            self._next_resend_s = self._s.clock() + self.target.resend_interval_s

    def _resend_wait_s(self) -> float | None:
        if self._next_resend_s is None:
            return None
        return max(0.0, self._next_resend_s - self._s.clock())

    def _resend_due(self) -> bool:
        return self._next_resend_s is not None and self._s.clock() >= self._next_resend_s

    async def _resend(self) -> None:
        if not isinstance(self.target, AlertmanagerTarget) or not self._active:
            self._next_resend_s = None
            return
        self._next_resend_s = self._s.clock() + self.target.resend_interval_s
        for key, alerts in group_alerts(list(self._active.values())):
            await self._deliver(key, alerts)

    # -- delivery -------------------------------------------------------------------------

    def _body(self, key: str, alerts: Sequence[Alert]) -> bytes:
        target = self.target
        payload: object
        if isinstance(target, SlackTarget):
            payload = slack_payload(alerts, group_key=key, external_url=self._s.external_url)
        elif isinstance(target, WebhookTarget):
            payload = alertmanager_webhook_payload(
                alerts, receiver=target.name, group_key=key, external_url=self._s.external_url
            )
        else:
            ends_at = self._s.wall_clock() + 4 * target.resend_interval_s
            payload = alertmanager_v2_alerts(
                alerts, generator_url=self._s.external_url, firing_ends_at_unix_s=ends_at
            )
        return msgspec.json.encode(payload)

    async def _deliver(self, key: str, alerts: Sequence[Alert]) -> bool:
        """POST one message, retrying what may heal; True once delivered."""
        body = self._body(key, alerts)
        for attempt in range(1, self._s.max_attempts + 1):
            result = await self._post(body)
            if result.ok:
                self.sent_total += 1
                if self._condition != "ok":
                    log.info("notify target %s: delivering again", self.target.name)
                    self._condition = "ok"
                return True
            if not result.retryable:
                self.failed_total += 1
                self._note(result, f"permanent failure, {len(alerts)} alerts not sent")
                return False
            if attempt == self._s.max_attempts:
                self.failed_total += 1
                self._note(result, f"gave up after {attempt} attempts")
                return False
            delay_s = retry_delay_s(
                attempt,
                initial_s=self._s.retry_initial_s,
                max_s=self._s.retry_max_s,
                rng=self._s.rng,
                retry_after_s=result.retry_after_s,
            )
            self.retries_total += 1
            self._note(
                result, f"retrying in {delay_s:.2f} s (attempt {attempt} of {self._s.max_attempts})"
            )
            await asyncio.sleep(delay_s)
        return False  # unreachable: the loop returns on its last attempt

    async def _post(self, body: bytes) -> _Attempt:
        if self._session is None:
            raise RuntimeError("Notifier is not started")
        try:
            async with self._session.post(
                self._url, data=body, headers=self._headers, allow_redirects=False
            ) as resp:
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
                text = (await resp.content.read(_SCRUBBED_BODY_BYTES)).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            # Only the exception's type: aiohttp's messages can quote the request URL.
            return _Attempt(False, True, "unreachable", f"cannot connect ({type(exc).__name__})")
        if 200 <= status < 300:
            return _Attempt(True)
        # Scrubbed before it is cut short: a cut could leave half a secret unmatched.
        detail = f"HTTP {status}: {self._redact(text)[:_MAX_LOGGED_BODY_CHARS].strip()}"
        if status == 429 or status >= 500:
            after = parse_retry_after(retry_after, now_unix_s=self._s.wall_clock())
            return _Attempt(False, True, f"http-{status}", detail, after)
        return _Attempt(False, False, f"http-{status}", detail)

    def _note(self, result: _Attempt, what: str) -> None:
        """Log a failure at warning when its kind changed, at debug while it repeats."""
        level = logging.WARNING if result.condition != self._condition else logging.DEBUG
        self._condition = result.condition
        log.log(level, "notify target %s: %s; %s", self.target.name, result.detail, what)


async def _wait(event: asyncio.Event, timeout_s: float | None) -> None:
    """Until ``event`` is set or ``timeout_s`` passed (None: no limit)."""
    if timeout_s is None:
        await event.wait()
    else:
        await wait_event(event, timeout_s)


def _endpoint(target: Target) -> tuple[str, dict[str, str]]:
    if isinstance(target, AlertmanagerTarget):
        return target.alerts_url, {}
    if isinstance(target, WebhookTarget) and target.bearer_token is not None:
        return target.url, {"Authorization": f"Bearer {target.bearer_token}"}
    return target.url, {}


def _redactor(target: Target) -> Redactor:
    """Scrubs the target's URL (path and query included: a webhook URL is a credential)
    and token out of what a server or an exception says."""
    redact = Redactor()
    redact.add_url(
        target.base_url if isinstance(target, AlertmanagerTarget) else target.url,
        secret_path=True,
    )
    if isinstance(target, WebhookTarget):
        redact.add(target.bearer_token)
    return redact


__all__ = ["STAT_NAMES", "Notifier", "parse_retry_after", "retry_delay_s"]
