"""The report's findings: the stored episodes (or the bottleneck report computed from
the steps), each symptom linked to its cause, in the order a person reads them, and
the one sentence (``headline``) the report leads with."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from torshmon.aggregator.core.bottleneck import (
    JobSnapshot,
    Thresholds,
    bottleneck_report,
    phase_words,
    rank_findings,
    symptom_advice,
)
from torshmon.aggregator.core.findings import (
    EXPLAINED_BY_KEY,
    EXPLAINED_BY_NAME_KEY,
    LOSS_KEY,
    STEP_KEY,
    WHAT_IF_KEY,
    cause_id,
    cause_name,
    loss_text,
    slowdown_text,
)
from torshmon.history.store.report import JobHistory
from torshmon.report.model import AlertItem, FindingItem, as_text, finite, severity_rank
from torshmon.report.series import Columns, columns, median

#: The findings that explain others (their symptoms), by kind.
CAUSE_KINDS: Final = ("straggler", "hang", "slow_link")
#: A straggler's sentence (``computes 2.40x slower``, ``waits 3x longer``, as the
#: straggler report writes it, or as its detector did): how the report knows an alert's
#: text for one (a slow link's ``0.25x the median`` is not).
_STRAGGLER_TEXT: Final = re.compile(r"\b\d+(?:\.\d+)?x (?:slower|longer)\b")
_ACTIONS: Final = {
    "straggler": "check its node",
    "hang": "see where it waits (py-spy dump, the Flight Recorder dump)",
    "slow_link": "check its network path (the link check)",
}


def stored_findings(rows: Sequence[Mapping[str, Any]]) -> list[FindingItem]:
    """The stored episodes, one item per condition (see ``FindingItem``)."""
    grouped: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (r["detected_unix_s"], r["id"])):
        key = (row["kind"], row.get("category"), row["rank"], row["metric"])
        grouped.setdefault(key, []).append(row)
    found = []
    for episodes in grouped.values():
        latest = episodes[-1]
        still_open = any(r.get("ended_unix_s") is None for r in episodes)
        found.append(
            FindingItem(
                kind=str(latest["kind"]),
                severity=max((str(r["severity"]) for r in episodes), key=severity_rank),
                rank=latest["rank"],
                summary=str(latest["summary"]),
                recommendation=str(latest["recommendation"]),
                value=finite(latest["value"]),
                since_unix_s=float(episodes[0]["since_unix_s"]),
                detected_unix_s=float(latest["detected_unix_s"]),
                ended_unix_s=None if still_open else latest.get("ended_unix_s"),
                stored=True,
                category=as_text(latest.get("category")),
                priority=latest.get("priority"),
                expected_gain_ratio=finite(latest.get("expected_gain_ratio")),
                difficulty=as_text(latest.get("difficulty")),
                episodes=len(episodes),
                **_links(str(latest["kind"]), latest),
            )
        )
    return found


def _links(kind: str, row: Mapping[str, Any]) -> dict[str, Any]:
    """The ``FindingItem`` fields a stored row's details carry (see ``findings``)."""
    stored = row.get("details")
    details: Mapping[str, Any] = stored if isinstance(stored, dict) else {}
    out: dict[str, Any] = {
        "explained_by": as_text(details.get(EXPLAINED_BY_KEY)),
        "explained_by_name": as_text(details.get(EXPLAINED_BY_NAME_KEY)),
        "step_s": finite(details.get(STEP_KEY)),
        "what_if_step_s": finite(details.get(WHAT_IF_KEY)),
        "loss_ratio": finite(details.get(LOSS_KEY)),
    }
    labels = {"node": str(details["node"])} if isinstance(details.get("node"), str) else {}
    if row.get("rank") is not None:
        labels["rank"] = str(row["rank"])
    if row.get("category"):
        labels["category"] = str(row["category"])
    out["cause_id"] = cause_id(kind, labels)
    if kind == "straggler":
        out["slowdown_ratio"] = finite(details.get("slowdown_ratio", row.get("score")))
        out["peer_median_s"] = finite(details.get("peer_median_s"))
        out["phase"] = as_text(details.get("phase")) or "compute"
    return out


def computed_bottlenecks(job: str, history: JobHistory, now: float) -> list[FindingItem]:
    """The bottleneck report (``bottleneck_report``, ranked) on the medians of the
    job's steps and the fullest of its nodes, for a history that stored none."""
    duration, comm, compute, input_wait = (
        median(np.array(history.steps.get(n, []), dtype=float))
        for n in ("duration_s", "comm_wait_s", "compute_s", "input_wait_s")
    )
    period = (duration or 0.0) + (input_wait or 0.0)

    def share(value: float | None) -> float | None:
        """``value`` as a share of the step period (step time plus input wait)."""
        return _ratio(value / period) if value is not None and period > 0 else None

    nodes = columns(history.node_samples, ("memory_utilization_ratio", "io_wait_ratio"))
    memory = nodes["memory_utilization_ratio"][np.isfinite(nodes["memory_utilization_ratio"])]
    snapshot = JobSnapshot(
        communication_time_ratio=share(comm),
        training_efficiency_ratio=share(compute),
        input_wait_ratio=share(input_wait),
        memory_utilization_ratio=_ratio(float(np.max(memory)) if memory.size else None),
        io_wait_ratio=_ratio(median(nodes["io_wait_ratio"])),
        step_s=period or None,
    )
    since = history.job["first_seen_unix_ns"] / 1e9
    ranked = rank_findings(bottleneck_report(job, snapshot, now), [], snapshot)
    return [
        FindingItem(
            kind=f.kind,
            severity=f.severity,
            rank=None,
            summary=f.summary,
            recommendation=f.recommendation,
            value=f.value,
            since_unix_s=since,
            detected_unix_s=now,
            ended_unix_s=None,
            stored=False,
            category=f.category,
            priority=f.priority,
            expected_gain_ratio=f.expected_gain_ratio,
            difficulty=f.difficulty,
            **_links(f.kind, {"details": dict(f.details), "category": f.category}),
        )
        for f in ranked
    ]


def linked(findings: Sequence[FindingItem]) -> list[FindingItem]:
    """``findings`` with the symptoms a cause explains linked to it, for a history whose
    aggregator stored no links (or a report computed from the steps): the efficiency
    roll-up under the largest cause at the same time (else under the largest
    communication or input finding), the communication wait under a hang, or under a
    straggler or slow link without which it would be below the high threshold."""
    ids = {f.cause_id for f in findings if f.cause_id}
    causes = sorted(
        (f for f in findings if f.kind in CAUSE_KINDS),
        key=lambda f: (f.kind != "hang", -(f.loss_ratio or 0.0)),
    )
    out = []
    for f in findings:
        if f.kind != "bottleneck" or f.category not in ("communication", "efficiency"):
            out.append(f)
            continue
        if f.explained_by and f.explained_by in ids:
            out.append(f)
            continue
        cause = next((c for c in causes if _overlap(c, f) and _explains(c, f)), None)
        if cause is not None:
            name = cause_name(
                cause.kind, {"rank": str(cause.rank)} if cause.rank is not None else {}
            )
            out.append(_under(f, cause, name, symptom_advice(f.category, name), 0.0))
            continue
        others = [c for c in findings if c.category in ("communication", "input") and c is not f]
        if f.category == "efficiency" and others:
            top = max(others, key=lambda c: c.expected_gain_ratio or 0.0)
            out.append(_under(f, top, f"the {top.category} finding", f.recommendation, None))
            continue
        out.append(f)
    return out


def _explains(cause: FindingItem, symptom: FindingItem) -> bool:
    if symptom.category == "efficiency" or cause.kind == "hang":
        return True
    loss, comm = cause.loss_ratio, symptom.value
    if loss is None or comm is None or loss >= 1.0:
        return False
    return max(0.0, comm - loss) / (1.0 - loss) <= Thresholds().communication_high_ratio


def _overlap(a: FindingItem, b: FindingItem) -> bool:
    a_end = a.ended_unix_s if a.ended_unix_s is not None else math.inf
    b_end = b.ended_unix_s if b.ended_unix_s is not None else math.inf
    return a.since_unix_s <= b_end and b.since_unix_s <= a_end


def _under(
    symptom: FindingItem, cause: FindingItem, name: str, advice: str, gain: float | None
) -> FindingItem:
    """``symptom`` listed under ``cause``: named, no more severe than it."""
    severity = min(symptom.severity, cause.severity, key=severity_rank)
    return dataclasses.replace(
        symptom,
        severity=severity,
        explained_by=cause.cause_id,
        explained_by_name=name,
        recommendation=advice,
        expected_gain_ratio=gain if gain is not None else symptom.expected_gain_ratio,
    )


def finding_tree(findings: Sequence[FindingItem]) -> list[tuple[FindingItem, int]]:
    """``findings`` (in ``reading_order``) with each one's depth: 0 for a cause or an
    independent finding, 1 for what it explains, 2 for what that explains."""
    ids = {f.cause_id: f for f in findings if f.cause_id}
    out = []
    for f in findings:
        depth, seen, parent = 0, {f.cause_id}, f.explained_by
        while parent in ids and parent not in seen and depth < 3:
            depth += 1
            seen.add(parent)
            parent = ids[parent].explained_by
        out.append((f, depth))
    return out


def reading_order(findings: Sequence[FindingItem]) -> list[FindingItem]:
    """``findings`` as a person reads them, ``priority`` renumbered 1..n to match:
    causes and independent findings open before ended, most severe, largest loss or
    gain first; each followed by what it explains (the efficiency roll-up last)."""
    ids = {f.cause_id for f in findings if f.cause_id}
    children: dict[str, list[FindingItem]] = {}
    top = []
    for f in findings:
        if f.explained_by and f.explained_by in ids and f.explained_by != f.cause_id:
            children.setdefault(f.explained_by, []).append(f)
        else:
            top.append(f)
    ordered: list[FindingItem] = []

    def visit(f: FindingItem, depth: int) -> None:
        ordered.append(f)
        below = sorted(
            children.pop(f.cause_id, []) if f.cause_id and depth < 3 else [],
            key=lambda c: (c.category == "efficiency", *_finding_order(c)),
        )
        for child in below:
            visit(child, depth + 1)

    for f in sorted(top, key=_finding_order):
        visit(f, 0)
    ordered.extend(f for rest in children.values() for f in rest)  # a cycle: never lost
    return [dataclasses.replace(f, priority=i) for i, f in enumerate(ordered, start=1)]


def alerts_of_findings(
    alerts: Sequence[AlertItem], findings: Sequence[FindingItem], last_seen: float
) -> list[AlertItem]:
    """``alerts``, a straggler's with its finding's latest sentence: an alert's text is
    written when it fires (and when it resolves), while the ratio it quotes is measured
    over the whole episode, so a job that ends with the alert open would show the
    figure of its first steps beside the finding's."""
    stragglers = [f for f in findings if f.kind == "straggler" and f.rank is not None]
    out = []
    for alert in alerts:
        ends = alert.ends_at_unix_s if alert.ends_at_unix_s is not None else last_seen
        match = next(
            (
                f
                for f in stragglers
                if f.rank == alert.rank
                and f.since_unix_s <= ends
                and alert.starts_at_unix_s <= (f.ended_unix_s or math.inf)
            ),
            None,
        )
        if match is not None and _STRAGGLER_TEXT.search(alert.summary):
            alert = dataclasses.replace(alert, summary=match.summary)
        out.append(alert)
    return out


def headline(findings: Sequence[FindingItem], steps: Mapping[int, Columns]) -> str:
    """One sentence for the run: its first finding (in reading order) and what the job
    loses to it: ``rank 1 on node vm computes 1.70x slower than its peers: the job
    loses ~42% of its throughput; check its node``."""
    if not findings:
        durations = [c["duration_s"] for c in steps.values()]
        if not durations:
            return "no steps recorded yet"
        typical = median(np.concatenate(durations))
        step = f", median step {typical * 1e3:.3g} ms" if typical is not None else ""
        return f"no problem found: {len(steps)} ranks{step}"
    top = findings[0]
    ended = top.ended_unix_s is not None
    cost = ""
    if top.loss_ratio is not None:
        scope = " over the run" if top.kind == "hang" else (" while it lasted" if ended else "")
        lost = "lost" if ended else "loses"
        cost = f": the job {lost} {loss_text(top.loss_ratio)} of its throughput{scope}"
    action = _ACTIONS.get(top.kind, "")
    if top.kind == "straggler" and top.slowdown_ratio is not None:
        verb, comparative = phase_words(top.phase)
        on = f" on node {top.node}" if top.node else ""
        ratio = slowdown_text(top.slowdown_ratio)
        what = f"rank {top.rank}{on} {verb} {ratio} {comparative}"
        return f"{what}{cost}; {action}"
    if top.kind in CAUSE_KINDS:
        return f"{top.summary.split(': the job loses')[0]}{cost}" + (
            f"; {action}" if action else ""
        )
    gain = top.expected_gain_ratio
    saving = f": fixing it may save {gain:.0%} of the step time" if gain else ""
    return f"{top.summary}{saving}"


def _finding_order(f: FindingItem) -> tuple[float, ...]:
    """Open before ended, then most severe, largest expected gain, the report's priority."""
    gain = f.expected_gain_ratio if f.expected_gain_ratio is not None else -1.0
    priority = f.priority if f.priority is not None else 1_000_000
    return (f.ended_unix_s is not None, -severity_rank(f.severity), -gain, priority)


def _ratio(value: float | None) -> float | None:
    return min(1.0, max(0.0, value)) if value is not None else None
