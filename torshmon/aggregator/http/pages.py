"""The aggregator's web pages: the jobs at ``/``, a job's report at ``/jobs/{job}``.

Read-only, under the API's rule: with a token configured, a page needs it. A browser
cannot send a bearer header when it follows a link, so ``POST /login`` takes the
token once from a form and sets a cookie (HttpOnly, SameSite=Strict, never the token
itself but an HMAC of it, so it stops working when the token changes); the token is
never put in a URL. The pages run no script and say so in their
Content-Security-Policy; a report is rendered off the event loop (matplotlib takes
a few hundred milliseconds for a large job).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Final, Protocol

from aiohttp import web

from torshmon.aggregator.http.guard import (
    SESSION_COOKIE,
    RequestGuard,
    read_body,
    session_cookie,
)
from torshmon.history.store.report import UnknownRun
from torshmon.report.model import JobReport, to_json
from torshmon.report.page import (
    CONTENT_SECURITY_POLICY,
    JobLead,
    render_index,
    render_login,
    render_not_found,
    render_page,
)

LOGIN_PATH: Final = "/login"
#: How often a running job's page reloads itself, seconds; at least 3x the time the
#: page took to make.
REFRESH_S: Final = 15
#: How long a rendered page is served again to other viewers, seconds.
PAGE_REUSE_S: Final = 5.0
#: The list of jobs reads the latest report of its most recently seen jobs for as long as
#: this (seconds; at least one), each kept until its job is heard from again (a running
#: one for ``REFRESH_S``): a large job's report takes seconds to make.
LEADS_BUDGET_S: Final = 3.0
_MAX_FORM_BYTES: Final = 16 * 1024
_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class ReportSource(Protocol):
    """Reports and the list of jobs from the history (``HistoryStore``)."""

    async def job_report(
        self, job: str, now_unix_s: float, run: str | None = None
    ) -> JobReport | None: ...

    async def job_list(self) -> list[dict[str, Any]]: ...


def html_response(text: str, status: int = 200) -> web.Response:
    """An HTML page with the pages' security headers."""
    return web.Response(text=text, status=status, content_type="text/html", headers=_HEADERS)


class Pages:
    """The handlers of the pages and of ``/api/v1/jobs/{job}/summary`` (the report as
    JSON, for ``torshmon report --aggregator``)."""

    def __init__(
        self,
        token: str | None,
        guard: RequestGuard,
        reports: ReportSource,
        clock: Callable[[], float],
    ) -> None:
        self._token = token
        self._guard = guard
        self._reports = reports
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._pages: dict[str, tuple[float, str]] = {}  # job -> (made at, page)
        self._refresh_s: dict[str, int] = {}  # job -> 3x its latest render time
        self._leads: dict[str, tuple[float, float, JobLead]] = {}  # job -> (at, last seen, lead)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/", self.index)
        router.add_get("/jobs/{job}", self.job)
        router.add_get(LOGIN_PATH, self.login_form)
        router.add_post(LOGIN_PATH, self.login)
        router.add_get("/api/v1/jobs/{job}/summary", self.summary)

    def _signed_in(self, request: web.Request) -> bool:
        return self._guard.signed_in(request.headers, request.cookies)

    def _login_page(self, request: web.Request, *, failed: bool = False) -> web.Response:
        return html_response(render_login(next_url=request.path_qs, failed=failed), 401)

    async def index(self, request: web.Request) -> web.Response:
        if not self._signed_in(request):
            return self._login_page(request)
        jobs = await self._reports.job_list()
        async with self._locks.setdefault("\0index", asyncio.Lock()):
            leads = await self._read_leads(jobs)
        return html_response(render_index(jobs, self._clock(), leads))

    async def _read_leads(self, jobs: list[dict[str, Any]]) -> dict[str, JobLead]:
        """Each job's ``JobLead`` as its latest report has it, from ``_leads`` while it is
        current, else read (the most recently seen first) within ``LEADS_BUDGET_S``."""
        started = time.monotonic()
        leads: dict[str, JobLead] = {}
        for row in jobs:
            job, seen = row["job"], row["last_seen_unix_ns"] / 1e9
            now = self._clock()
            kept = self._leads.get(job)
            current = kept is not None and kept[1] == seen
            if kept is not None and current and (not kept[2].running or now - kept[0] < REFRESH_S):
                leads[job] = kept[2]
                continue
            if leads and time.monotonic() - started > LEADS_BUDGET_S:
                continue  # the next visit reads it
            try:
                report = await self._reports.job_report(job, now)
            except UnknownRun:
                report = None
            if report is not None:
                leads[job] = self._keep_lead(report, now)
        return leads

    def _keep_lead(self, report: JobReport, now: float) -> JobLead:
        lead = JobLead.of(report)
        if not report.run_id or report.run_id == (report.runs[-1].run_id if report.runs else ""):
            self._leads[report.job] = (now, report.last_seen_unix_s, lead)
        return lead

    async def job(self, request: web.Request) -> web.Response:
        if not self._signed_in(request):
            return self._login_page(request)
        job = request.match_info["job"]
        run = request.query.get("run") or None
        key = job if run is None else f"{job}\0{run}"
        # One render per job (and run) at a time, reused for a while: each open browser
        # reloads a running job's page, and a render takes a core for a second or more.
        now = self._clock()
        self._pages = {k: v for k, v in self._pages.items() if now - v[0] < PAGE_REUSE_S}
        async with self._locks.setdefault(key, asyncio.Lock()):
            cached = self._pages.get(key)
            if cached is not None and self._clock() - cached[0] < PAGE_REUSE_S:
                return html_response(cached[1])
            started = time.monotonic()
            try:
                report = await self._reports.job_report(job, self._clock(), run)
            except UnknownRun:
                report = None
            if report is None:
                self._locks.pop(key, None)  # else every unknown name would stay here
                return html_response(render_not_found(job), 404)
            self._keep_lead(report, self._clock())  # the list of jobs says the same
            loop = asyncio.get_running_loop()
            page = await loop.run_in_executor(None, _render, report, self._refresh_s.get(job))
            # A large job's page takes long to make: its viewers reload it less often.
            self._refresh_s[job] = max(REFRESH_S, math.ceil(3 * (time.monotonic() - started)))
            self._pages[key] = (self._clock(), page)
        return html_response(page)

    async def summary(self, request: web.Request) -> web.Response:
        if not self._guard.authorized(request.headers):
            raise web.HTTPUnauthorized(text="missing or wrong bearer token")
        job = request.match_info["job"]
        try:
            report = await self._reports.job_report(
                job, self._clock(), request.query.get("run") or None
            )
        except UnknownRun as exc:
            raise web.HTTPNotFound(text=f"job {job!r}: {exc}") from None
        if report is None:
            raise web.HTTPNotFound(text=f"no job {job!r} in the history")
        return web.Response(body=to_json(report), content_type="application/json")

    async def login_form(self, request: web.Request) -> web.Response:
        next_url = _local_path(request.query.get("next", "/"))
        return html_response(render_login(next_url=next_url, failed=False), 200)

    async def login(self, request: web.Request) -> web.Response:
        body = await read_body(request, _MAX_FORM_BYTES)
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
        given = form.get("token", [""])[0].strip()
        next_url = _local_path(form.get("next", ["/"])[0])
        response = web.Response(status=303, headers={**_HEADERS, "Location": next_url})
        if self._token is None:
            return response
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return html_response(render_login(next_url=next_url, failed=True), 401)
        response.set_cookie(
            SESSION_COOKIE,
            session_cookie(self._token),
            httponly=True,
            samesite="Strict",
            secure=request.secure,
            path="/",
        )
        return response


def _render(report: JobReport, refresh_s: int | None) -> str:
    return render_page(report, refresh_s=refresh_s or REFRESH_S, index_url="/")


def _local_path(url: str) -> str:
    """``url`` if it is a path on this server (``/jobs/x``), else ``/``: a login never
    sends the browser to another site."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme or parts.netloc or not url.startswith("/") or url.startswith("//"):
        return "/"
    if "\\" in url:
        return "/"
    return url
