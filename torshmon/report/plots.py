"""The report's plots: matplotlib figures rendered to inline SVG.

SVG, not PNG: text stays text (searchable, sharp at any zoom), a page is tens of
kilobytes, and hovering a line, bar or alert shows its values (an SVG ``<title>``),
with no JavaScript. The figures are made with matplotlib's object API (no pyplot),
so several threads may render at once. Text from the history (job names, rule names)
is never parsed as mathtext (``text.parse_math``) and matplotlib escapes it in the SVG.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, cast

import matplotlib
from matplotlib.figure import Figure

from torshmon.report.model import PHASES, JobReport
from torshmon.report.text import percent, seconds, when

if TYPE_CHECKING:  # the tuner's package imports optuna and scipy: types only
    from torshmon.aggregator.core.tuner.events import TrialDecision

_RC: Final[Mapping[str, Any]] = {
    "svg.fonttype": "none",  # <text>, not paths: small, and the values can be read
    "svg.hashsalt": "torshmon",  # stable ids: the same report renders the same bytes
    "text.parse_math": False,  # a '$' in a job or rule name is text, not TeX
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
_WIDTH_IN: Final = 9.0
_SEVERITY_COLORS: Final[Mapping[str, str]] = {
    "critical": "#b2182b",
    "high": "#ef8a62",
    "warning": "#f4a582",
    "medium": "#fddbc7",
    "info": "#92c5de",
}
#: A colour per decision the tuner stores (``tuning_trials.decision``): the names are the
#: tuner's own ``TrialDecision`` (a test checks every one has its colour).
DECISION_COLORS: Final[Mapping[TrialDecision, str]] = {
    "kept": "#1a9850",
    "not_better": "#91bfdb",
    "worse": "#d73027",
    "rolled_back": "#fc8d59",
    "rejected_error": "#762a83",
    "rejected_loss": "#c2a5cf",
    "failed": "#4d4d4d",
}
#: A trial not decided yet (it runs, or its session ended first).
UNDECIDED_COLOR: Final = "#bababa"
_PHASE_COLORS: Final[Mapping[str, str]] = {
    "input_wait": "#8c510a",
    "forward": "#4575b4",
    "backward": "#74add1",
    "comm_wait": "#d73027",
    "optimizer": "#fdae61",
    "other": "#bababa",
}


def plots(report: JobReport) -> dict[str, str]:
    """The report's figures as inline SVG (``<svg ...>`` only), by name; a figure with
    no data to show is left out."""
    out: dict[str, str] = {}
    with _style():
        for name, make in (
            ("step_time", _step_time),
            ("phases", _phases),
            ("comm_ratio", _comm_ratio),
            ("memory", _memory),
            ("alerts", _alerts),
            ("tuning", _tuning),
        ):
            drawn = make(report)
            if drawn is not None:
                figure, titles = drawn
                out[name] = _svg(figure, titles)
    return out


@contextmanager
def _style() -> Iterator[None]:
    # cast: matplotlib's stubs type rc keys as a Literal of every rcParam (3.11+).
    with matplotlib.rc_context(cast(Any, dict(_RC))):
        yield


def _elapsed(report: JobReport, unix_s: float) -> float:
    return (unix_s - report.first_seen_unix_s) / 60.0


_ELAPSED_LABEL: Final = "minutes since the job started"


def _step_time(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    """Step time per rank, and compute time under it: in a synchronous job every rank's
    step takes as long as the slowest's, so a straggler shows in its compute time."""
    if not report.series:
        return None
    figure = Figure(figsize=(_WIDTH_IN, 5.0), layout="constrained")
    step_ax, compute_ax = figure.subplots(2, 1, sharex=True)
    titles = {}
    stats = {s.rank: s for s in report.ranks}
    for series in report.series:
        x = [_elapsed(report, t) for t in series.time_unix_s]
        s = stats[series.rank]
        for ax, values, what, median in (
            (step_ax, series.duration_s, "step-time", s.median_step_s),
            (compute_ax, series.compute_s, "compute-time", s.median_compute_s),
        ):
            y = [math.nan if v is None else v * 1e3 for v in values]
            (line,) = ax.plot(x, y, label=f"rank {series.rank}", linewidth=1.1)
            gid = f"{what}-rank-{series.rank}"
            line.set_gid(gid)
            titles[gid] = (
                f"rank {series.rank}: median {what.replace('-', ' ')} {seconds(median)}"
                + (f", p95 {seconds(s.p95_step_s)}" if what == "step-time" else "")
                + f" over {s.steps} steps"
            )
    for ax, label in ((step_ax, "step time (ms)"), (compute_ax, "compute time (ms)")):
        _alert_marks(ax, report)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    step_ax.legend(loc="upper left", ncols=min(8, len(report.series)), fontsize=8)
    compute_ax.set_xlabel(_ELAPSED_LABEL)
    return figure, titles


def _alert_marks(ax: Any, report: JobReport) -> None:
    """A shaded span per firing alert behind a time plot."""
    for alert in report.alerts:
        if alert.fired_at_unix_s is None:
            continue
        end = alert.ends_at_unix_s or report.last_seen_unix_s
        ax.axvspan(
            _elapsed(report, alert.starts_at_unix_s),
            _elapsed(report, max(end, alert.starts_at_unix_s)),
            color=_SEVERITY_COLORS.get(alert.severity, "#cccccc"),
            alpha=0.12,  # light: several alerts often fire at once (they stack)
            linewidth=0,
        )


def _phases(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    rows = [p for p in report.phases if any(getattr(p, f"{n}_s") for n in PHASES)]
    if not rows:
        return None
    figure = Figure(figsize=(_WIDTH_IN, 1.0 + 0.35 * len(rows)), layout="constrained")
    ax = figure.add_subplot()
    titles = {}
    labels = [f"rank {p.rank}" for p in rows]
    left = [0.0] * len(rows)
    for name in PHASES:
        widths = [(getattr(p, f"{name}_s") or 0.0) * 1e3 for p in rows]
        if not any(widths):
            continue
        bars = ax.barh(
            labels, widths, left=left, label=name.replace("_", " "), color=_PHASE_COLORS[name]
        )
        for p, bar, width in zip(rows, bars, widths, strict=True):
            gid = f"phase-{name}-rank-{p.rank}"
            bar.set_gid(gid)
            titles[gid] = f"rank {p.rank}: {name.replace('_', ' ')} {seconds(width / 1e3)}"
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("median time in a step (ms)")
    figure.legend(loc="outside lower center", ncols=len(PHASES), fontsize=8)
    return figure, titles


def _comm_ratio(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    if not any(any(r is not None for r in s.comm_ratio) for s in report.series):
        return None
    figure = Figure(figsize=(_WIDTH_IN, 2.6), layout="constrained")
    ax = figure.add_subplot()
    titles = {}
    stats = {s.rank: s for s in report.ranks}
    for series in report.series:
        x = [_elapsed(report, t) for t in series.time_unix_s]
        y = [math.nan if r is None else r * 100 for r in series.comm_ratio]
        (line,) = ax.plot(x, y, label=f"rank {series.rank}", linewidth=1.2)
        gid = f"comm-ratio-rank-{series.rank}"
        line.set_gid(gid)
        median = percent(stats[series.rank].median_comm_ratio)
        titles[gid] = f"rank {series.rank}: median {median} of the step waiting on communication"
    ax.axhline(30, color="#ef8a62", linestyle="--", linewidth=1)
    ax.axhline(50, color="#b2182b", linestyle="--", linewidth=1)
    ax.set_ylim(0, 100)
    ax.set_xlabel(_ELAPSED_LABEL)
    ax.set_ylabel("comm wait (% of step)")
    ax.legend(loc="upper left", ncols=min(8, len(report.series)), fontsize=8)
    return figure, titles


def _memory(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    kinds = [k for k in ("node", "rank") if any(m.kind == k for m in report.memory)]
    if not kinds:
        return None
    figure = Figure(figsize=(_WIDTH_IN, 2.4 * len(kinds)), layout="constrained")
    axes = figure.subplots(len(kinds), 1, squeeze=False)[:, 0]
    titles = {}
    for ax, kind in zip(axes, kinds, strict=True):
        scale = 100.0 if kind == "node" else 1 / 2**20
        for series in (m for m in report.memory if m.kind == kind):
            x = [_elapsed(report, t) for t in series.time_unix_s]
            y = [math.nan if v is None else v * scale for v in series.value]
            label = f"node {series.name}" if kind == "node" else f"rank {series.name}"
            (line,) = ax.plot(x, y, label=label, linewidth=1.2)
            gid = f"memory-{kind}-{series.name}"
            line.set_gid(gid)
            peak = max((v for v in y if not math.isnan(v)), default=None)
            unit = "% of the node's memory" if kind == "node" else "MiB resident"
            titles[gid] = f"{label}: peak {peak:.4g} {unit}" if peak is not None else label
        ax.set_ylabel("node memory (%)" if kind == "node" else "process RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8, ncols=4)
    axes[-1].set_xlabel(_ELAPSED_LABEL)
    return figure, titles


def _alerts(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    if not report.alerts:
        return None
    rules = sorted({a.rule for a in report.alerts})
    figure = Figure(figsize=(_WIDTH_IN, 0.8 + 0.35 * len(rules)), layout="constrained")
    ax = figure.add_subplot()
    titles = {}
    end_of_job = _elapsed(report, report.last_seen_unix_s)
    for alert in report.alerts:
        start = _elapsed(report, alert.starts_at_unix_s)
        end = _elapsed(report, alert.ends_at_unix_s) if alert.ends_at_unix_s else end_of_job
        width = max(end - start, end_of_job / 200 if end_of_job > 0 else 0.01)
        (bar,) = ax.barh(
            rules.index(alert.rule),
            width,
            left=start,
            color=_SEVERITY_COLORS.get(alert.severity, "#cccccc"),
            edgecolor="#333333",
            linewidth=0.5,
        )
        gid = f"alert-{alert.id}"
        bar.set_gid(gid)
        rank = "" if alert.rank is None else f" rank {alert.rank}"
        titles[gid] = (
            f"{alert.rule}{rank} ({alert.severity}, {alert.state}): "
            f"{when(alert.starts_at_unix_s)} to {when(alert.ends_at_unix_s)}. {alert.summary}"
        )
    ax.set_yticks(range(len(rules)), rules)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end_of_job, 0.01))
    ax.set_xlabel(_ELAPSED_LABEL)
    return figure, titles


def _tuning(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    trials = [t for t in report.trials if t.score is not None]
    if not trials:
        return None
    figure = Figure(figsize=(_WIDTH_IN, 3.4), layout="constrained")
    ax = figure.add_subplot()
    titles = {}
    labels = []
    for i, trial in enumerate(trials):
        color = _decision_color(trial.decision)
        (bar,) = ax.bar(i, trial.score or 0.0, color=color)
        gid = f"trial-{i}"
        bar.set_gid(gid)
        titles[gid] = (
            f"trial {trial.trial_index}: {trial.config_text}: {trial.score:.4g}, "
            f"{trial.decision or 'undecided'}. {trial.reason}"
        )
        labels.append(f"#{trial.trial_index} {trial.config_text}")
    ax.set_xticks(range(len(trials)), labels, rotation=30, ha="right", fontsize=7)
    unit = next((s.unit for s in report.sessions if s.unit), "samples/s")
    ax.set_ylabel(f"throughput ({unit})")
    shown = {t.decision for t in trials}
    for decision, color in DECISION_COLORS.items():
        if decision in shown:
            ax.bar(0, 0, color=color, label=decision.replace("_", " "))
    if shown - set(DECISION_COLORS):
        ax.bar(0, 0, color=UNDECIDED_COLOR, label="undecided")
    ax.legend(loc="lower right", fontsize=8)
    return figure, titles


def _decision_color(decision: str | None) -> str:
    return DECISION_COLORS.get(cast("TrialDecision", decision), UNDECIDED_COLOR)


def _svg(figure: Figure, titles: Mapping[str, str]) -> str:
    """``figure`` as an inline ``<svg>`` element, each artist with a gid in ``titles``
    carrying that text as its hover title."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]
    for gid, title in titles.items():
        opening = f'<g id="{gid}">'
        svg = svg.replace(opening, f"{opening}<title>{html.escape(title)}</title>", 1)
    return svg
