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
import numpy as np
from matplotlib.figure import Figure

from torshmon.report.model import PHASES, AlertItem, JobReport, RankSeries
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


class _Clock:
    """Step <-> time for a job: every series' points (step, end time), as two increasing
    arrays. The plots' x axis is the step; time goes on a second axis and in hovers."""

    def __init__(self, report: JobReport) -> None:
        steps = np.array([s for r in report.series for s in r.step], dtype=float)
        times = np.array([t for r in report.series for t in r.time_unix_s], dtype=float)
        order = np.argsort(times, kind="stable")
        self.times = times[order]
        self.steps = np.maximum.accumulate(steps[order]) if len(order) else steps
        self.origin = report.first_seen_unix_s
        span = (self.times[-1] - self.origin) if len(self.times) else 0.0
        #: seconds below ten minutes, else minutes: the demo's 20 s is not "0.3"
        self.unit_s, self.unit = (1.0, "s") if span < 600 else (60.0, "min")

    def step(self, unix_s: float) -> float:
        if len(self.times) == 0:
            return 0.0
        return float(np.interp(unix_s, self.times, self.steps))

    def usable(self) -> bool:
        return len(self.times) > 1 and self.steps[-1] > self.steps[0]

    def to_time(self, steps: Any) -> Any:
        return (np.interp(steps, self.steps, self.times) - self.origin) / self.unit_s

    def to_step(self, elapsed: Any) -> Any:
        return np.interp(np.asarray(elapsed) * self.unit_s + self.origin, self.times, self.steps)


_STEP_LABEL: Final = "step"
#: More ranks than this: each plot draws the spread of all ranks as bands, and the
#: worst ``_WORST`` ranks as lines.
MAX_LINES: Final = 8
_WORST: Final = 4
#: The y axis ends at ``_HEADROOM`` x the pooled ``_TYPICAL_Q`` quantile when a value
#: lies above that: the outliers are marked on the edge, the typical range stays readable.
_TYPICAL_Q: Final = 0.95
_HEADROOM: Final = 1.5
_MAX_LABELS: Final = 12


def _time_axis(ax: Any, clock: _Clock) -> None:
    if clock.usable():
        top = ax.secondary_xaxis("top", functions=(clock.to_time, clock.to_step))
        top.set_xlabel(f"time since the job started ({clock.unit})", fontsize=8)
        top.tick_params(labelsize=7)


def _drawn(report: JobReport, key: str) -> tuple[list[RankSeries], bool]:
    """The series drawn as lines, and whether the others go into bands."""
    if len(report.series) <= MAX_LINES:
        return list(report.series), False
    stats = {s.rank: s for s in report.ranks}

    def badness(series: RankSeries) -> float:
        s = stats.get(series.rank)
        value = None if s is None else getattr(s, key)
        return -1.0 if value is None else float(value)

    worst = sorted(report.series, key=badness, reverse=True)[:_WORST]
    return sorted(worst, key=lambda s: s.rank), True


def _values(series: RankSeries, what: str, scale: float) -> np.ndarray:
    values = getattr(series, what)
    return np.array([math.nan if v is None else v * scale for v in values], dtype=float)


#: The ``RankSeries`` field that keeps each span's peak of a plotted one.
_PEAKS: Final = {"duration_s": "duration_peak", "compute_s": "compute_peak"}


def _peaks(series: RankSeries, what: str, scale: float) -> list[tuple[int, float]]:
    """(step, value) of each point's longest step: a span's peak where the points are
    medians of several steps (``RankSeries.duration_peak``), else the points themselves."""
    peaks = getattr(series, _PEAKS[what]) if what in _PEAKS else ()
    if peaks:
        return [(step, v * scale) for v, step in peaks if v is not None]
    y = _values(series, what, scale)
    return [(s, float(v)) for s, v in zip(series.step, y, strict=True) if not math.isnan(v)]


def _limit(
    report: JobReport, what: str, scale: float, lines: list[RankSeries]
) -> tuple[float, float] | None:
    """(top of the y axis, largest value) when outliers must be clipped, else None. The
    top: ``_HEADROOM`` x the larger of all ranks' ``_TYPICAL_Q`` quantile and each drawn
    line's 90th percentile, so a straggler among 1 000 ranks stays on the axis."""
    pooled = np.concatenate([_values(s, what, scale) for s in report.series] or [np.zeros(0)])
    pooled = pooled[~np.isnan(pooled)]
    if len(pooled) < 4:
        return None
    typical = float(np.quantile(pooled, _TYPICAL_Q))
    for series in lines:
        own = _values(series, what, scale)
        own = own[~np.isnan(own)]
        if len(own) >= 4:
            typical = max(typical, float(np.quantile(own, 0.9)))
    top = max(typical * _HEADROOM, float(np.median(pooled)) * 2.0)
    # a span's longest step counts too: one hang among 5 000 steps is no median
    highest = max(
        [float(pooled.max())] + [v for s in report.series for _, v in _peaks(s, what, scale)]
    )
    return (top, highest) if highest > top and top > 0 else None


def _gaps(steps: np.ndarray) -> list[tuple[int, int]]:
    """The runs of missing steps: (last step before, first step after)."""
    if len(steps) < 3:
        return []
    stride = np.diff(steps)
    typical = max(1.0, float(np.median(stride)))
    return [(int(steps[i]), int(steps[i + 1])) for i in np.flatnonzero(stride > 2.5 * typical)]


def _broken(steps: np.ndarray, y: np.ndarray, top: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A line that does not join across missing steps (a NaN between) and leaves out the
    points above ``top`` (they are marked on the edge instead)."""
    if top is not None:
        y = np.where(y > top, np.nan, y)
    gaps = {a for a, _ in _gaps(steps)}
    xs: list[float] = []
    ys: list[float] = []
    for step, value in zip(steps, y, strict=True):
        xs.append(float(step))
        ys.append(float(value))
        if int(step) in gaps:
            xs.append(float(step) + 0.5)
            ys.append(math.nan)
    return np.array(xs), np.array(ys)


def _bands(ax: Any, report: JobReport, what: str, scale: float, top: float | None) -> str:
    """All ranks' spread per step: min to max light, the middle 80 % darker, the median
    a line. Returns the hover text."""
    steps = np.concatenate([np.asarray(s.step, dtype=float) for s in report.series])
    values = np.concatenate([_values(s, what, scale) for s in report.series])
    keep = ~np.isnan(values)
    steps, values = steps[keep], values[keep]
    if not len(steps):
        return ""
    order = np.lexsort((values, steps))
    steps, values = steps[order], values[order]
    unique, first = np.unique(steps, return_index=True)
    groups = np.split(values, first[1:])
    q = np.array([np.quantile(g, [0.0, 0.1, 0.5, 0.9, 1.0]) for g in groups])
    # a step above the axis or missing is a gap in the bands too, never a ramp
    x, q = (
        _broken(unique, q[:, 2], top)[0],
        np.column_stack([_broken(unique, q[:, i], top)[1] for i in range(5)]),
    )
    if top is not None:  # the spread reaches the edge where only some ranks are above it
        q[:, 4] = np.where(np.isnan(q[:, 4]) & ~np.isnan(q[:, 0]), top, q[:, 4])
        q[:, 3] = np.where(np.isnan(q[:, 3]) & ~np.isnan(q[:, 1]), top, q[:, 3])
    low = ax.fill_between(x, q[:, 0], q[:, 4], color="#9ecae1", alpha=0.35, linewidth=0)
    mid = ax.fill_between(x, q[:, 1], q[:, 3], color="#4292c6", alpha=0.45, linewidth=0)
    (median,) = ax.plot(x, q[:, 2], color="#08519c", linewidth=1.0, label="median of ranks")
    low.set_gid(f"{what}-band-all")
    mid.set_gid(f"{what}-band-p10-p90")
    median.set_gid(f"{what}-median")
    low.set_label(f"all {len(report.series)} ranks: min-max")
    mid.set_label("p10-p90")
    return f"{len(report.series)} ranks"


def _outliers(
    ax: Any,
    report: JobReport,
    what: str,
    scale: float,
    top: float,
    unit: str,
    titles: dict[str, str],
    clock: _Clock,
) -> None:
    """A marker on the top edge at each step with a value above ``top`` (a span's longest
    step where points are medians), labelled with the step and the largest value there
    (the ``_MAX_LABELS`` largest labelled)."""
    worst: dict[int, tuple[float, int]] = {}
    for series in report.series:
        for step, value in _peaks(series, what, scale):
            if value > top and value > worst.get(step, (-1.0, 0))[0]:
                worst[step] = (float(value), series.rank)
    if not worst:
        return
    steps = sorted(worst)
    markers = ax.scatter(
        steps,
        [top] * len(steps),
        marker="^",
        color="#b2182b",
        s=28,
        zorder=5,
        clip_on=False,
        label="above the axis (value on the label)",
    )
    markers.set_gid(f"{what}-outliers")
    titles[f"{what}-outliers"] = "; ".join(
        f"step {s}: {_ms(worst[s][0], unit)} on rank {worst[s][1]}" for s in steps[:50]
    )
    near = max(1.0, (steps[-1] - steps[0]) / 12) if len(steps) > 1 else 1.0
    labelled: list[int] = []
    for step in sorted(steps, key=lambda s: worst[s][0], reverse=True):
        if len(labelled) >= _MAX_LABELS or any(abs(step - o) < near for o in labelled):
            continue  # the largest of a cluster speaks for it; the hover lists them all
        labelled.append(step)
        value, rank = worst[step]
        text = ax.annotate(
            f"step {step}: {_ms(value, unit)} (rank {rank})",
            (step, top), xytext=(4, -10), textcoords="offset points",
            fontsize=7, color="#b2182b", annotation_clip=False,
        )  # fmt: skip
        gid = f"{what}-outlier-step-{step}"
        text.set_gid(gid)
        titles[gid] = (
            f"step {step}: {_ms(value, unit)} on rank {rank}, "
            f"{when(float(clock.to_time(step)) * clock.unit_s + clock.origin)}"
        )


def _ms(value: float, unit: str) -> str:
    return seconds(value / 1e3) if unit == "ms" else f"{value:.3g} {unit}"


def _gap_labels(ax: Any, report: JobReport, titles: dict[str, str], prefix: str) -> None:
    """A label over each run of steps no rank recorded."""
    seen: set[tuple[int, int]] = set()
    for series in report.series:
        for before, after in _gaps(np.asarray(series.step, dtype=float)):
            if (before, after) in seen or len(seen) >= _MAX_LABELS:
                continue
            seen.add((before, after))
            ax.axvspan(before, after, color="#eeeeee", alpha=0.8, linewidth=0, zorder=0)
            text = ax.text(
                (before + after) / 2, 0.5, f"no steps {before + 1}-{after - 1}",
                transform=ax.get_xaxis_transform(), ha="center", va="center",
                rotation=90, fontsize=7, color="#555555",
            )  # fmt: skip
            gid = f"{prefix}-gap-{before}-{after}"
            text.set_gid(gid)
            titles[gid] = f"no step recorded between step {before} and step {after}"


def _step_time(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    """Step time per rank, and compute time under it, against the step: in a synchronous
    job every rank's step takes as long as the slowest's, so a straggler shows in its
    compute time. With many ranks: bands of all ranks and the worst ranks' lines."""
    if not report.series:
        return None
    clock = _Clock(report)
    figure = Figure(figsize=(_WIDTH_IN, 5.6), layout="constrained")
    step_ax, compute_ax = figure.subplots(2, 1, sharex=True)
    titles: dict[str, str] = {}
    stats = {s.rank: s for s in report.ranks}
    for ax, field, what, key in (
        (step_ax, "duration_s", "step-time", "median_step_s"),
        (compute_ax, "compute_s", "compute-time", "median_compute_s"),
    ):
        lines, banded = _drawn(report, key)
        limit = _limit(report, field, 1e3, lines)
        top = None if limit is None else limit[0]
        if banded:
            titles[f"{field}-band-all"] = _bands(ax, report, field, 1e3, top)
        for series in lines:
            s = stats[series.rank]
            median = getattr(s, key)
            x, y = _broken(np.asarray(series.step, dtype=float), _values(series, field, 1e3), top)
            (line,) = ax.plot(x, y, label=f"rank {series.rank}", linewidth=1.1)
            gid = f"{what}-rank-{series.rank}"
            line.set_gid(gid)
            titles[gid] = (
                f"rank {series.rank}: median {what.replace('-', ' ')} {seconds(median)}"
                + (f", p95 {seconds(s.p95_step_s)}" if what == "step-time" else "")
                + f" over {s.steps} steps"
            )
        if top is not None:
            ax.set_ylim(0, top)
            _outliers(ax, report, field, 1e3, top, "ms", titles, clock)
        else:
            ax.set_ylim(bottom=0)
        _gap_labels(ax, report, titles, what)
    _alert_marks(step_ax, report, clock, titles, labelled=True)
    _alert_marks(compute_ax, report, clock, titles, labelled=False)
    _config_marks(step_ax, report, clock, titles)
    step_ax.set_ylabel("step time (ms)")
    compute_ax.set_ylabel("compute time (ms)")
    # under the plots, not over the lines, and every figure as wide as the others
    figure.legend(
        handles=step_ax.get_legend_handles_labels()[0], loc="outside lower center",
        ncols=min(6, len(report.series) + 3), fontsize=7,
    )  # fmt: skip
    compute_ax.set_xlabel(_STEP_LABEL)
    _time_axis(step_ax, clock)
    return figure, titles


def _alert_marks(
    ax: Any, report: JobReport, clock: _Clock, titles: dict[str, str], *, labelled: bool
) -> None:
    """A shaded span per firing alert behind a step plot, labelled with its rule and rank
    (the first ``_MAX_LABELS`` episodes of each rule and rank)."""
    labels = 0
    for i, alert in enumerate(a for a in report.alerts if a.fired_at_unix_s is not None):
        end = alert.ends_at_unix_s or report.last_seen_unix_s
        start_step = clock.step(alert.starts_at_unix_s)
        end_step = max(clock.step(max(end, alert.starts_at_unix_s)), start_step + 0.5)
        span = ax.axvspan(
            start_step, end_step,
            color=_SEVERITY_COLORS.get(alert.severity, "#cccccc"),
            alpha=0.12,  # light: several alerts often fire at once (they stack)
            linewidth=0,
        )  # fmt: skip
        if not labelled:
            continue
        rank = "" if alert.rank is None else f" rank {alert.rank}"
        span.set_gid(f"alert-span-{alert.id}")
        titles[f"alert-span-{alert.id}"] = (
            f"{alert.rule}{rank} ({alert.severity}): steps {start_step:.0f}-{end_step:.0f}, "
            f"{when(alert.starts_at_unix_s)} to {when(alert.ends_at_unix_s)}"
        )
        if labels >= _MAX_LABELS:
            continue
        labels += 1
        text = ax.text(
            start_step, 0.88 - 0.08 * (i % 4), f" {alert.rule}{rank}",  # under the outliers' labels
            transform=ax.get_xaxis_transform(), ha="left", va="top", fontsize=7,
            color="#67001f", clip_on=True,
        )  # fmt: skip
        text.set_gid(f"alert-label-{alert.id}")


def _config_marks(ax: Any, report: JobReport, clock: _Clock, titles: dict[str, str]) -> None:
    """A dashed line at each config the job applied (the tuner's trials, its rollbacks,
    the user's requests), labelled with that config and who asked for it; with no config
    versions stored, each tuning trial's start."""
    first, last = report.first_seen_unix_s - 30, report.last_seen_unix_s + 30
    changes = [c for c in report.configs if first <= c.applied_unix_s <= last]
    marks: list[tuple[str, float, str, str]] = []  # gid, step, label, hover
    for change in changes:
        trial = next(
            (
                t
                for t in report.trials
                if t.started_unix_s is not None
                and abs(t.started_unix_s - change.applied_unix_s) < 5
            ),
            None,
        )
        asked = change.requested_by
        if not asked and trial is not None:  # a report made before configs said who asked
            asked = f"autotuner trial {trial.trial_index}"
        decided = (
            f", {trial.decision or 'undecided'}"
            if trial is not None and asked.startswith("autotuner trial")
            else ""
        )
        marks.append((
            f"config-v{change.version}", float(change.effective_step),
            f" v{change.version}" + (f" ({asked})" if asked else "") + f": {change.config_text}",
            f"step {change.effective_step}, {when(change.applied_unix_s)}: config version "
            f"{change.version} applied, {change.config_text}"
            + (f" ({asked}{decided})" if asked else ""),
        ))  # fmt: skip
    if not changes:
        for trial in report.trials:
            if trial.started_unix_s is None:
                continue
            step = clock.step(trial.started_unix_s)
            marks.append((
                f"config-{trial.session_id}-{trial.trial_index}", step,
                f" #{trial.trial_index} {trial.config_text}",
                f"step {step:.0f}, {when(trial.started_unix_s)}: trial {trial.trial_index} "
                f"applies {trial.config_text} ({trial.decision or 'undecided'})",
            ))  # fmt: skip
    for gid, step, label, hover in marks[: 4 * _MAX_LABELS]:
        line = ax.axvline(step, color="#542788", linestyle="--", linewidth=0.8)
        line.set_gid(gid)
        titles[gid] = hover
        text = ax.text(
            step, 0.03, label,
            transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="bottom",
            fontsize=6.5, color="#542788",
        )  # fmt: skip
        text.set_gid(gid + "-label")


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
    clock = _Clock(report)
    figure = Figure(figsize=(_WIDTH_IN, 2.8), layout="constrained")
    ax = figure.add_subplot()
    titles: dict[str, str] = {}
    stats = {s.rank: s for s in report.ranks}
    lines, banded = _drawn(report, "median_comm_ratio")
    if banded:
        titles["comm_ratio-band-all"] = _bands(ax, report, "comm_ratio", 100.0, None)
    for series in lines:
        x, y = _broken(
            np.asarray(series.step, dtype=float), _values(series, "comm_ratio", 100.0), None
        )
        (line,) = ax.plot(x, y, label=f"rank {series.rank}", linewidth=1.2)
        gid = f"comm-ratio-rank-{series.rank}"
        line.set_gid(gid)
        median = percent(stats[series.rank].median_comm_ratio)
        titles[gid] = f"rank {series.rank}: median {median} of the step waiting on communication"
    ax.axhline(30, color="#ef8a62", linestyle="--", linewidth=1)
    ax.axhline(50, color="#b2182b", linestyle="--", linewidth=1)
    ax.set_ylim(0, 100)
    _alert_marks(ax, report, clock, titles, labelled=False)
    _config_marks(ax, report, clock, titles)
    ax.set_xlabel(_STEP_LABEL)
    ax.set_ylabel("comm wait (% of step)")
    figure.legend(loc="outside lower center", ncols=min(6, len(lines) + 3), fontsize=7)
    _time_axis(ax, clock)
    return figure, titles


def _memory(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    kinds = [k for k in ("node", "rank") if any(m.kind == k for m in report.memory)]
    if not kinds:
        return None
    clock = _Clock(report)
    figure = Figure(figsize=(_WIDTH_IN, 2.4 * len(kinds)), layout="constrained")
    axes = figure.subplots(len(kinds), 1, squeeze=False)[:, 0]
    titles = {}
    for ax, kind in zip(axes, kinds, strict=True):
        scale = 100.0 if kind == "node" else 1 / 2**20
        of_kind = [m for m in report.memory if m.kind == kind]
        if len(of_kind) > MAX_LINES:  # the largest: a leak is the one that grows
            of_kind.sort(key=lambda m: max((v for v in m.value if v is not None), default=0.0))
            of_kind = of_kind[-_WORST:]
        for series in of_kind:
            x = [clock.step(t) for t in series.time_unix_s]
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
    axes[-1].set_xlabel(_STEP_LABEL)
    _time_axis(axes[0], clock)
    return figure, titles


def _alerts(report: JobReport) -> tuple[Figure, dict[str, str]] | None:
    if not report.alerts:
        return None
    clock = _Clock(report)
    rows = sorted({_alert_row(a) for a in report.alerts})
    if len(rows) > 3 * MAX_LINES:  # 1 000 ranks: the rows whose alerts fired longest
        firing: dict[str, float] = {}
        for a in report.alerts:
            end = a.ends_at_unix_s or report.last_seen_unix_s
            firing[_alert_row(a)] = firing.get(_alert_row(a), 0.0) + end - a.starts_at_unix_s
        rows = sorted(sorted(rows, key=lambda r: -firing[r])[: 3 * MAX_LINES])
    figure = Figure(figsize=(_WIDTH_IN, 1.0 + 0.3 * len(rows)), layout="constrained")
    ax = figure.add_subplot()
    titles = {}
    end_of_job = max(clock.step(report.last_seen_unix_s), 1.0)
    for alert in report.alerts:
        if _alert_row(alert) not in rows:
            continue
        start = clock.step(alert.starts_at_unix_s)
        end = clock.step(alert.ends_at_unix_s) if alert.ends_at_unix_s else end_of_job
        width = max(end - start, end_of_job / 200)
        (bar,) = ax.barh(
            rows.index(_alert_row(alert)),
            width,
            left=start,
            color=_SEVERITY_COLORS.get(alert.severity, "#cccccc"),
            edgecolor="#333333",
            linewidth=0.5,
            alpha=1.0 if alert.fired_at_unix_s is not None else 0.3,  # pending: faint
        )
        gid = f"alert-{alert.id}"
        bar.set_gid(gid)
        rank = "" if alert.rank is None else f" rank {alert.rank}"
        titles[gid] = (
            f"{alert.rule}{rank} ({alert.severity}, {alert.state}"
            f"{'' if alert.fired_at_unix_s is not None else ', never fired'}): "
            f"{when(alert.starts_at_unix_s)} to {when(alert.ends_at_unix_s)}, "
            f"steps {start:.0f}-{start + width:.0f}. {alert.summary}"
        )
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlim(0, end_of_job)
    ax.set_xlabel(_STEP_LABEL)
    _time_axis(ax, clock)
    return figure, titles


def _alert_row(alert: AlertItem) -> str:
    return alert.rule if alert.rank is None else f"{alert.rule} · rank {alert.rank}"


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
