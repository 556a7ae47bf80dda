"""A job's report as one self-contained HTML page, and the aggregator's other pages.

The page needs no network and runs no script: styles and SVG plots are inline, and
a running job's page refreshes itself with ``<meta http-equiv="refresh">``. Jinja2
escapes every value from the history (job names, alert text are user-controlled);
only the plots, which matplotlib escapes itself, go in as markup. The report's data
travels with the page as a JSON block (``<script type="application/json">``, never
executed) for whoever wants the numbers behind a plot.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import jinja2
from markupsafe import Markup

from torshmon.report.findings import finding_tree
from torshmon.report.model import JobReport, alert_groups, is_running, to_json
from torshmon.report.plots import plots
from torshmon.report.text import (
    finding_effort,
    finding_tags,
    finding_what_if,
    percent,
    seconds,
    when,
)

#: What the pages may load: inline styles (the page's and the plots' style attributes),
#: a same-origin login form, nothing else. A written page carries it in a <meta>.
PAGE_POLICY: Final = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; form-action 'self'; "
    "base-uri 'none'"
)
#: The header the aggregator sends with them (frame-ancestors works in a header only).
CONTENT_SECURITY_POLICY: Final = PAGE_POLICY + "; frame-ancestors 'none'"


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("torshmon.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.globals.update(
        page_policy=PAGE_POLICY,
        finding_tags=finding_tags,
        finding_effort=finding_effort,
        finding_what_if=finding_what_if,
        finding_tree=finding_tree,
        is_running=is_running,
    )
    env.filters.update(
        when=when,
        seconds=seconds,
        percent=percent,
        number=_number,
        path_segment=functools.partial(urllib.parse.quote, safe=""),
    )
    return env


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _json_block(data: bytes) -> Markup:
    """JSON that is safe inside ``<script>``: no ``<`` can close the element."""
    text = data.decode().replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text)  # escaped above for the script element


def render_page(
    report: JobReport, *, refresh_s: int | None = None, index_url: str | None = None
) -> str:
    """``report`` as one HTML page. ``refresh_s``: reload every so many seconds while
    the job runs; ``index_url``: a link back to the list of jobs."""
    figures = {name: Markup(svg) for name, svg in plots(report).items()}
    return (
        _environment()
        .get_template("report.html")
        .render(
            r=report,
            figures=figures,
            alerts=alert_groups(report.alerts, report.last_seen_unix_s),
            data=_json_block(to_json(report)),
            refresh_s=refresh_s if report.running else None,
            index_url=index_url,
        )
    )


@dataclass(frozen=True, slots=True)
class JobLead:
    """What the list of jobs says of one: the sentence its latest run's report leads
    with (``JobReport.headline``) and whether that run is still going."""

    headline: str
    running: bool

    @classmethod
    def of(cls, report: JobReport) -> JobLead:
        return cls(report.headline, report.running)


def render_index(
    jobs: Sequence[Mapping[str, Any]],
    now_unix_s: float,
    leads: Mapping[str, JobLead] | None = None,
) -> str:
    """The list of jobs (``jobs`` rows: job, world_size, backend, *_seen_unix_ns), each
    with its ``leads`` entry where there is one (else its state from ``last_seen``)."""
    return (
        _environment()
        .get_template("index.html")
        .render(jobs=jobs, now=now_unix_s, leads=leads or {})
    )


def render_login(*, next_url: str, failed: bool) -> str:
    """The form that takes the aggregator's bearer token once (``POST /login``)."""
    return _environment().get_template("login.html").render(next_url=next_url, failed=failed)


def render_not_found(job: str) -> str:
    return _environment().get_template("not_found.html").render(job=job)
