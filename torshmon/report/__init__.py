"""``torshmon report``: a job's history as a summary for the terminal and as a page.

``model`` holds the report's records and ``build`` fills them (pure, from ``series``,
``findings`` and ``what_if``), ``text`` and ``page`` render it, ``plots`` draws its
figures, ``source`` reads it from a history database or an aggregator. ``page`` (which
imports matplotlib) is not imported here: the terminal summary does without.
"""

from torshmon.report.build import build_report
from torshmon.report.model import JobReport, from_json, to_json
from torshmon.report.source import ReportError, report_from_aggregator, report_from_db
from torshmon.report.text import render_text

__all__ = [
    "JobReport",
    "ReportError",
    "build_report",
    "from_json",
    "render_text",
    "report_from_aggregator",
    "report_from_db",
    "to_json",
]
