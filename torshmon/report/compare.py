"""Two runs of a job side by side (``torshmon report JOB --compare RUN``): their step
time, throughput, communication and findings, each figure computed as the report
computes it for one run."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from torshmon.report.model import JobReport
from torshmon.report.text import percent, seconds, table, when

#: Findings listed per run.
_TOP: int = 3


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _steps(r: JobReport) -> int:
    return sum(rank.steps for rank in r.ranks)


def _throughput(r: JobReport) -> float | None:
    """The job's samples/s: the sum over ranks of each rank's median."""
    known = [rank.median_samples_per_s for rank in r.ranks]
    return sum(v for v in known if v is not None) if any(v is not None for v in known) else None


def _rows(a: JobReport, b: JobReport) -> list[list[str]]:
    def med(field: str) -> Callable[[JobReport], float | None]:
        return lambda r: _median([getattr(rank, field) for rank in r.ranks])

    def number(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    def delta(x: float | None, y: float | None) -> str:
        if x is None or y is None or x == 0:
            return "-"
        return f"{(y - x) / x:+.0%}"

    figures: list[tuple[str, Callable[[JobReport], float | None], Callable[..., str]]] = [
        ("median step time", med("median_step_s"), seconds),
        ("median compute", med("median_compute_s"), seconds),
        ("median communication wait", med("median_comm_wait_s"), seconds),
        ("communication share of step", med("median_comm_ratio"), percent),
        ("throughput (samples/s, all ranks)", _throughput, number),
    ]
    rows = [
        ["started", when(_started(a)), when(_started(b)), ""],
        ["ranks", str(len(a.ranks)), str(len(b.ranks)), ""],
        ["step records", str(_steps(a)), str(_steps(b)), ""],
        ["alerts", str(len(a.alerts)), str(len(b.alerts)), ""],
    ]
    for name, get, show in figures:
        rows.append([name, show(get(a)), show(get(b)), delta(get(a), get(b))])
    return rows


def _started(r: JobReport) -> float | None:
    return next((run.started_unix_s for run in r.runs if run.run_id == r.run_id), None)


def _findings(r: JobReport) -> str:
    if not r.findings:
        return "  (no findings)"
    lines = [f"  - {f.severity} {f.kind}: {f.summary}" for f in r.findings[:_TOP]]
    if len(r.findings) > _TOP:
        lines.append(f"  ({len(r.findings) - _TOP} more)")
    return "\n".join(lines)


def render_comparison(a: JobReport, b: JobReport) -> str:
    """``a`` and ``b`` (two runs of one job) side by side, as text."""
    title = f"torshmon report: job {a.job}, run {a.run_id} vs run {b.run_id}"
    header = ["", f"run {a.run_id}", f"run {b.run_id}", "change"]
    parts = [
        f"{title}\n{'=' * len(title)}",
        table(header, _rows(a, b)),
        f"Findings of run {a.run_id}:\n{_findings(a)}",
        f"Findings of run {b.run_id}:\n{_findings(b)}",
    ]
    return "\n\n".join(parts) + "\n"
