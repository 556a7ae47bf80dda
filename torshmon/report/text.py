"""A job's report for the terminal: plain text, one section per part of the report."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence

from torshmon.aggregator.core.findings import loss_text
from torshmon.report.findings import finding_tree
from torshmon.report.model import FindingItem, JobReport, alert_groups

_WIDTH = 100


def render_text(report: JobReport) -> str:
    """``report`` as text for a terminal (about 100 columns wide)."""
    sections = [
        _header(report),
        _ranks(report),
        _phases(report),
        _findings(report),
        _alerts(report),
        _tuning(report),
        _configs(report),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def when(unix_s: float | None) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS``; ``-`` for None."""
    if unix_s is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def seconds(value: float | None) -> str:
    """A duration with a unit that suits it: ``850 µs``, ``12.3 ms``, ``1.25 s``."""
    if value is None:
        return "-"
    if value == 0.0:
        return "0 s"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1.0:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.3g} s"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned under ``header``, the first left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        parts = [first.ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _title(text: str) -> str:
    return f"{text}\n{'=' * len(text)}"


def _header(r: JobReport) -> str:
    state = "running" if r.running else "ended"
    lines = [
        _title(f"torshmon report: job {r.job}"),
        f"world size {r.world_size if r.world_size is not None else '?'}, backend "
        f"{r.backend or '?'}, {state}; first seen {when(r.first_seen_unix_s)}, "
        f"last seen {when(r.last_seen_unix_s)}",
    ]
    if r.runs:
        lines.append(runs_line(r))
    if r.steps_truncated:
        lines.append(f"(the latest {r.steps_read} step records only)")
    if r.headline:
        lines.append(_wrap(f"In short: {r.headline}", ""))
    return "\n".join(lines)


def runs_line(r: JobReport) -> str:
    """``run 2 of 2 (b31f...), started ...; other runs: 1 a9e0... (--run)``."""
    ids = [run.run_id for run in r.runs]
    n = ids.index(r.run_id) + 1 if r.run_id in ids else 0
    started = next((run.started_unix_s for run in r.runs if run.run_id == r.run_id), None)
    others = ", ".join(f"{i} {rid}" for i, rid in enumerate(ids, 1) if rid != r.run_id)
    line = f"run {n} of {len(ids)} ({r.run_id}), started {when(started)}"
    return line + (f"; other runs: {others} (--run)" if others else "")


def _ranks(r: JobReport) -> str:
    if not r.ranks:
        return _title("Ranks") + "\nno steps recorded"
    header = ("rank", "node", "steps", "median step", "p95 step", "compute", "comm wait",
              "comm %", "samples/s")  # fmt: skip
    rows = [
        (
            str(s.rank),
            s.node,
            str(s.steps),
            seconds(s.median_step_s),
            seconds(s.p95_step_s),
            seconds(s.median_compute_s),
            seconds(s.median_comm_wait_s),
            percent(s.median_comm_ratio),
            _number(s.median_samples_per_s),
        )
        for s in r.ranks
    ]
    return _title("Ranks (medians over the steps)") + "\n" + table(header, rows)


def _phases(r: JobReport) -> str:
    if not r.phases:
        return ""
    header = ("rank", "input wait", "forward", "backward", "comm wait", "optimizer", "other")
    rows = [
        (
            str(p.rank),
            seconds(p.input_wait_s),
            seconds(p.forward_s),
            seconds(p.backward_s),
            seconds(p.comm_wait_s),
            seconds(p.optimizer_s),
            seconds(p.other_s),
        )
        for p in r.phases
    ]
    note = "backward is compute only: the communication it waited for is under comm wait"
    return _title("Phases of a step (medians)") + "\n" + table(header, rows) + "\n" + note


def _wrap(text: str, indent: str) -> str:
    """``text`` filled to the width, its first line after ``indent`` (a bullet, say),
    the others under the first's text."""
    return textwrap.fill(text, _WIDTH, initial_indent=indent, subsequent_indent=" " * len(indent))


def finding_tags(f: FindingItem) -> list[str]:
    """``critical``, ``bottleneck``, ``communication``, ``priority 1``, ``3 episodes``, ..."""
    tags = [f.severity, f.kind]
    if f.category and f.category != f.kind:
        tags.append(f.category)
    if f.priority is not None:
        tags.append(f"priority {f.priority}")
    if f.episodes > 1:
        tags.append(f"{f.episodes} episodes")
    return tags


def finding_effort(f: FindingItem) -> str:
    """``expected gain 25% of the step, difficulty easy``; empty where neither is known.
    A symptom with no gain of its own says which cause it goes with."""
    if f.explained_by_name and not f.expected_gain_ratio:
        return f"no gain of its own: it goes with {f.explained_by_name}"
    parts = []
    if f.expected_gain_ratio is not None and f.what_if_step_s is None:
        # A cause's gain is its what-if line's loss: said once, there.
        parts.append(f"expected gain {f.expected_gain_ratio:.0%} of the step")
    if f.difficulty:
        parts.append(f"difficulty {f.difficulty}")
    return ", ".join(parts)


def finding_what_if(f: FindingItem) -> str:
    """``without it a step would take 110 ms instead of 210 ms: the job loses ~48% of
    its throughput``; empty for a finding that is no cause or was not measured."""
    if f.what_if_step_s is None or f.step_s is None:
        return ""
    lost = ""
    if f.loss_ratio is not None:
        lost = f": the job loses {loss_text(f.loss_ratio)} of its throughput"
    scope = "the run" if f.kind == "hang" else "its episode"
    return (
        f"without it a step would take {seconds(f.what_if_step_s)} instead of "
        f"{seconds(f.step_s)} (means over {scope}){lost}"
    )


def _findings(r: JobReport, top: int = 5) -> str:
    """The first ``top`` causes and independent findings, each with what it explains
    indented under it."""
    if not r.findings:
        return _title("Findings") + "\nnone: nothing crossed a threshold"
    tree = finding_tree(r.findings)
    roots = sum(depth == 0 for _, depth in tree)
    lines = [_title(f"Top findings ({min(top, roots)} of {roots}, with what they explain)")]
    shown = 0
    for f, depth in tree:
        shown += depth == 0
        if shown > top:
            break
        bullet = "  " * depth + "- "
        under = " " * len(bullet)
        explained = (
            f" (explained by {f.explained_by_name})" if depth and f.explained_by_name else ""
        )
        lines.append(_wrap(f"[{', '.join(finding_tags(f))}] {f.summary}{explained}", bullet))
        when_text = f"since {when(f.since_unix_s)}" + (
            f", ended {when(f.ended_unix_s)}" if f.ended_unix_s is not None else ""
        )
        effort = finding_effort(f)
        lines.append(_wrap(f"{when_text}; {effort}" if effort else when_text, under))
        if finding_what_if(f):
            lines.append(_wrap(finding_what_if(f), under))
        if f.recommendation:
            lines.append(_wrap(f"what to do: {f.recommendation}", under))
    return "\n".join(lines)


def _alerts(r: JobReport) -> str:
    if not r.alerts:
        return _title("Alerts") + "\nnone"
    groups = alert_groups(r.alerts, r.last_seen_unix_s)
    header = ("rule", "rank", "severity", "episodes", "fired", "firing", "first", "last ended",
              "now")  # fmt: skip
    rows = [
        (
            g.rule,
            "-" if g.rank is None else str(g.rank),
            g.severity,
            str(g.episodes),
            str(g.fired),
            seconds(g.firing_s),
            when(g.first_start_unix_s),
            when(g.last_end_unix_s) if g.last_end_unix_s is not None else "open",
            g.state,
        )
        for g in groups
    ]
    lines = [_title(f"Alerts ({len(r.alerts)} episodes)"), table(header, rows)]
    for g in groups:
        rank = "" if g.rank is None else f" (rank {g.rank})"
        lines.append(_wrap(f"{g.rule}{rank}: {g.summary}", "- "))
        lines += [f"  evidence: {e.name} {e.url}" for e in g.evidence]
    return "\n".join(lines)


def _tuning(r: JobReport) -> str:
    if not r.sessions:
        return _title("Tuning sessions") + "\nnone"
    lines = [_title("Tuning sessions")]
    for s in r.sessions:
        lines.append(
            f"session {s.id} ({s.trigger}): {s.state}, {when(s.started_unix_s)} to "
            f"{when(s.ended_unix_s)}; baseline {_number(s.baseline_score)}, best "
            f"{_number(s.best_score)} {s.unit}".rstrip()
        )
        if s.summary or s.reason:
            lines.append(_wrap(s.summary or s.reason, "  "))
        trials = [t for t in r.trials if t.session_id == s.id]
        if trials:
            header = ("trial", "config", "throughput", "decision", "reason")
            rows = [
                (str(t.trial_index), t.config_text, _number(t.score), t.decision or "-",
                 t.reason[:50])
                for t in trials
            ]  # fmt: skip
            lines.append(textwrap.indent(table(header, rows), "  "))
    return "\n".join(lines)


def _configs(r: JobReport) -> str:
    """The config versions the job applied and who asked for each; empty if none."""
    if not r.configs:
        return ""
    header = ("version", "from step", "applied", "config", "requested by")
    rows = [
        (f"v{c.version}", str(c.effective_step), when(c.applied_unix_s), c.config_text,
         c.requested_by or "-")
        for c in r.configs
    ]  # fmt: skip
    return _title("Config changes") + "\n" + table(header, rows)
