"""The bottleneck report: where a job's step time goes, and what to do about it.

``bottleneck_report`` judges one snapshot of a job's recent means (``JobSnapshot``)
against ``Thresholds`` (the documented defaults: communication > 30% of the step
high, > 50% critical; input wait > 40% high; efficiency < 0.7 critical; host or GPU
memory > 0.95 critical; GPU utilisation < 0.8 medium; node I/O wait > 0.1 high where
the probe measures no input wait). ``rank_findings`` adds the straggler and slow-link
detectors' findings, gives each finding its category, expected gain and difficulty,
and numbers them in the order to act on them. The live state runs both at every rule
evaluation, so the report is continuous: its findings are stored as episodes, exported
and matched by ``kind: bottleneck`` rules.

Shares are of the step *period*: the step's wall time plus the input wait before it
(the time the data loader kept the rank idle), so input wait, communication wait and
compute add up to the whole. Advice fits the job's kind: DDP (bucket cap, static_graph,
compression, the autotuner), FSDP2 (reshard_after_forward, prefetch, mixed precision;
no DDP bucket advice) or plain collectives.

Expected gain (``expected_gain_ratio``) is the share of the step period the advice
would save if it brought the phase back to the level the thresholds call healthy
(communication to the high threshold; input wait to nothing, as enough loader workers
keep a batch ready; compute back to the efficiency threshold; a straggler's extra
compute, which every peer waits for; a slow link's lost bandwidth on the
communication share). ``details["gain_basis"]`` says which. None for memory, where the
advice prevents a failure rather than saving time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Final, Literal

from torshmon.aggregator.core.findings import (
    EXPLAINED_BY_KEY,
    EXPLAINED_BY_NAME_KEY,
    LOSS_KEY,
    SEVERITIES,
    STEP_KEY,
    WHAT_IF_KEY,
    Finding,
    cause_id,
    cause_name,
    loss_text,
    slowdown_text,
)

JobKind = Literal["ddp", "fsdp2", "collectives"]
JOB_KINDS: Final[tuple[str, ...]] = ("ddp", "fsdp2", "collectives")

_COMMUNICATION_ADVICE: Final[dict[str | None, tuple[str, str]]] = {
    "ddp": (
        "easy",
        "Communication takes too much of the step: raise the DDP bucket cap (bucket_cap_mb) "
        "so fewer, larger all-reduces run; compress gradients (fp16 or bf16, PowerSGD); "
        "let communication overlap backward compute (static_graph=True, no needless "
        "synchronisation). torshmon's autotuner searches bucket size and codec for you "
        "(the rule action 'autotune').",
    ),
    "fsdp2": (
        "medium",
        "Communication takes too much of the step: keep parameters gathered between "
        "forward and backward (fully_shard(..., reshard_after_forward=False) on the "
        "blocks that fit in memory) to skip the backward all-gather; prefetch the next "
        "blocks' all-gathers (set_modules_to_forward_prefetch / "
        "set_modules_to_backward_prefetch); all-gather and reduce-scatter in bf16 "
        "(MixedPrecisionPolicy(param_dtype=torch.bfloat16)); shard coarser units so "
        "fewer, larger collectives run.",
    ),
    "collectives": (
        "medium",
        "Communication takes too much of the step: send fewer, larger collectives "
        "(flatten or coalesce small tensors), issue them with async_op=True and wait as "
        "late as possible so they overlap compute, send lower-precision payloads where "
        "the result allows, and check the network path (the link check).",
    ),
}
_COMMUNICATION_ADVICE[None] = _COMMUNICATION_ADVICE["ddp"]
_MEMORY_ADVICE: Final[dict[str | None, str]] = {
    "ddp": (
        "Memory is nearly exhausted: reduce the per-rank batch size (keep the global batch "
        "with gradient accumulation), enable activation checkpointing, train in mixed "
        "precision (bf16/fp16), shard optimizer state (ZeroRedundancyOptimizer, or move "
        "to FSDP2), and drop references to tensors kept across steps."
    ),
    "fsdp2": (
        "Memory is nearly exhausted: reshard parameters after forward "
        "(reshard_after_forward=True), enable activation checkpointing, train in mixed "
        "precision (MixedPrecisionPolicy), offload parameters and optimizer state "
        "(CPUOffloadPolicy), or reduce the per-rank batch size with gradient accumulation."
    ),
    "collectives": (
        "Memory is nearly exhausted: reduce the per-rank batch size (keep the global batch "
        "with gradient accumulation), enable activation checkpointing, train in mixed "
        "precision, and drop references to tensors kept across steps."
    ),
}
_MEMORY_ADVICE[None] = _MEMORY_ADVICE["ddp"]
_INPUT_ADVICE: Final = (
    "The ranks wait for their next batch {value:.0%} of the time: raise DataLoader "
    "num_workers, set pin_memory=True with non_blocking copies, persistent_workers=True "
    "and a larger prefetch_factor, and move decoding or augmentation to the GPU or "
    "offline."
)
_GPU_ADVICE: Final = (
    "The GPU is idle part of the time, usually waiting for input: raise DataLoader "
    "num_workers, set pin_memory=True with non_blocking copies, use persistent_workers "
    "and prefetch_factor, move preprocessing to the GPU, or increase the batch size."
)
_IO_ADVICE: Final = (
    "Training waits on storage: move the data set to faster local storage (NVMe, "
    "RAM disk), cache or prefetch it, raise DataLoader num_workers and prefetch_factor, "
    "and read large sequential shards (WebDataset-style tar shards) rather than many "
    "small files."
)
_EFFICIENCY_ADVICE: Final = (
    "Less than {threshold:.0%} of the step is compute ({value:.0%}): fix the other "
    "findings of this report, highest priority first."
)
_EFFICIENCY_ALONE_ADVICE: Final = (
    "Less than {threshold:.0%} of the step is compute ({value:.0%}) with no single "
    "cause above its threshold: profile a few steps (torch.profiler) for host-side "
    "overhead, synchronisation points (.item(), .cpu()) and many small kernels."
)


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """A job's recent means, each a ratio in 0..1 or None when unknown.

    Shares are of the step period (step time plus the input wait before it):
    ``communication_time_ratio`` (communication wait), ``input_wait_ratio`` (None
    where the probe measured no input wait), ``training_efficiency_ratio`` (compute).
    ``memory_utilization_ratio`` is the fullest of the job's nodes,
    ``gpu_memory_utilization_ratio`` its fullest GPU, ``gpu_utilization_ratio`` its GPUs'
    mean (both None without GPUs); ``io_wait_ratio`` the nodes' CPU I/O wait.
    ``job_kind``: what the probe was attached to (None while unknown); ``step_s``: the
    mean step period, seconds. Raises ValueError for a ratio outside 0..1.
    """

    communication_time_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    gpu_utilization_ratio: float | None = None
    io_wait_ratio: float | None = None
    training_efficiency_ratio: float | None = None
    input_wait_ratio: float | None = None
    gpu_memory_utilization_ratio: float | None = None
    job_kind: JobKind | None = None
    step_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_ratio"):
                _check_ratio(f.name, getattr(self, f.name))
        if self.job_kind is not None and self.job_kind not in JOB_KINDS:
            raise ValueError(f"job_kind must be one of {JOB_KINDS} or None, got {self.job_kind}")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Where the report starts to complain (ratios in 0..1); the defaults are the
    documented ones (docs/bottlenecks.md), data loading > 40% of the step among them.

    Raises ValueError for a value outside 0..1, or a critical communication threshold
    below the high one.
    """

    communication_high_ratio: float = 0.3
    communication_critical_ratio: float = 0.5
    memory_critical_ratio: float = 0.95
    gpu_utilization_medium_ratio: float = 0.8
    io_wait_high_ratio: float = 0.1
    efficiency_critical_ratio: float = 0.7
    input_wait_high_ratio: float = 0.4

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_ratio(f.name, getattr(self, f.name))
        if self.communication_critical_ratio < self.communication_high_ratio:
            raise ValueError(
                "communication_critical_ratio must be >= communication_high_ratio "
                f"({self.communication_high_ratio}), got {self.communication_critical_ratio}"
            )


def bottleneck_report(
    job: str,
    snapshot: JobSnapshot,
    now_unix_s: float,
    *,
    thresholds: Thresholds | None = None,
) -> list[Finding]:
    """The job's bottlenecks at ``now_unix_s`` (Unix seconds), most severe first.

    Each finding has kind "bottleneck", labels ``job`` and ``category``, the metric it
    judged (its name without the ``torshmon_`` prefix) as ``details["metric"]``, the
    observed ratio as ``value``, its margin past the threshold as ``score``, and its
    category, expected gain and difficulty; ``rank_findings`` numbers them.
    """
    t = thresholds if thresholds is not None else Thresholds()
    s = snapshot
    found: list[Finding] = []

    def add(
        category: str,
        metric: str,
        value: float,
        threshold: float,
        severity: str,
        summary: str,
        advice: tuple[str, str],
        gain: tuple[float, str] | None,
    ) -> None:
        difficulty, recommendation = advice
        details: dict[str, object] = {
            "metric": metric,
            "threshold": threshold,
            "job_kind": s.job_kind,
        }
        if gain is not None:
            details["gain_basis"] = gain[1]
        found.append(
            Finding(
                kind="bottleneck",
                labels={"job": job, "category": category},
                value=value,
                score=abs(value - threshold),
                summary=summary,
                since_unix_s=now_unix_s,
                recommendation=recommendation,
                severity=severity,
                details=details,
                category=category,
                expected_gain_ratio=None if gain is None else _clip(gain[0]),
                difficulty=difficulty,
            )
        )

    memory = s.memory_utilization_ratio
    if memory is not None and memory > t.memory_critical_ratio:
        add(
            "memory",
            "memory_utilization_ratio",
            memory,
            t.memory_critical_ratio,
            "critical",
            f"job {job} uses {memory:.0%} of a node's memory "
            f"(threshold {t.memory_critical_ratio:.0%})",
            ("medium", _MEMORY_ADVICE[s.job_kind]),
            None,
        )
    gpu_memory = s.gpu_memory_utilization_ratio
    if gpu_memory is not None and gpu_memory > t.memory_critical_ratio:
        add(
            "gpu_memory",
            "gpu_memory_utilization_ratio",
            gpu_memory,
            t.memory_critical_ratio,
            "critical",
            f"job {job} fills {gpu_memory:.0%} of a GPU's memory "
            f"(threshold {t.memory_critical_ratio:.0%})",
            ("medium", _MEMORY_ADVICE[s.job_kind]),
            None,
        )
    comm = s.communication_time_ratio
    if comm is not None and comm > t.communication_high_ratio:
        critical = comm > t.communication_critical_ratio
        threshold = t.communication_critical_ratio if critical else t.communication_high_ratio
        add(
            "communication",
            "communication_time_ratio",
            comm,
            threshold,
            "critical" if critical else "high",
            f"job {job} spends {comm:.0%} of its step time waiting for communication "
            f"(threshold {threshold:.0%})",
            _COMMUNICATION_ADVICE[s.job_kind],
            (
                comm - t.communication_high_ratio,
                f"communication wait back to {t.communication_high_ratio:.0%} of the step "
                f"from {comm:.0%}",
            ),
        )
    input_wait = s.input_wait_ratio
    if input_wait is not None and input_wait > t.input_wait_high_ratio:
        add(
            "input",
            "input_wait_time_ratio",
            input_wait,
            t.input_wait_high_ratio,
            "high",
            f"job {job} waits for input data {input_wait:.0%} of its step time "
            f"(threshold {t.input_wait_high_ratio:.0%})",
            ("easy", _INPUT_ADVICE.format(value=input_wait)),
            (input_wait, "all of the input wait, with a batch ready at every step"),
        )
    io_wait = s.io_wait_ratio
    if input_wait is None and io_wait is not None and io_wait > t.io_wait_high_ratio:
        # Node CPU iowait is a different quantity from input wait: used only where the
        # probe measured none, and with no gain estimate (how much of it stalls the
        # step is unknown).
        add(
            "input",
            "node_cpu_iowait_ratio",
            io_wait,
            t.io_wait_high_ratio,
            "high",
            f"job {job}'s nodes spend {io_wait:.0%} of CPU time waiting for I/O "
            f"(threshold {t.io_wait_high_ratio:.0%})",
            ("medium", _IO_ADVICE),
            None,
        )
    gpu = s.gpu_utilization_ratio
    if gpu is not None and gpu < t.gpu_utilization_medium_ratio:
        add(
            "gpu",
            "gpu_utilization_ratio",
            gpu,
            t.gpu_utilization_medium_ratio,
            "medium",
            f"job {job} keeps its GPUs busy only {gpu:.0%} of the time "
            f"(threshold {t.gpu_utilization_medium_ratio:.0%})",
            ("medium", _GPU_ADVICE),
            (
                t.gpu_utilization_medium_ratio - gpu,
                f"GPU busy time up to {t.gpu_utilization_medium_ratio:.0%} from {gpu:.0%}",
            ),
        )
    efficiency = s.training_efficiency_ratio
    if efficiency is not None and efficiency < t.efficiency_critical_ratio:
        shortfall = t.efficiency_critical_ratio - efficiency
        causes = [f for f in found if f.category in ("communication", "input")]
        if causes:
            # A roll-up of the findings that explain it: its gain is what they leave.
            explained = sum(f.expected_gain_ratio or 0.0 for f in causes)
            gain = (
                shortfall - explained,
                "the part of the shortfall from "
                f"{t.efficiency_critical_ratio:.0%} compute the other findings leave",
            )
            template = _EFFICIENCY_ADVICE
        else:
            gain = (
                shortfall,
                f"compute back to {t.efficiency_critical_ratio:.0%} of the step "
                f"from {efficiency:.0%}",
            )
            template = _EFFICIENCY_ALONE_ADVICE
        add(
            "efficiency",
            "training_efficiency_ratio",
            efficiency,
            t.efficiency_critical_ratio,
            "critical",
            f"job {job} computes only {efficiency:.0%} of its step time "
            f"(threshold {t.efficiency_critical_ratio:.0%})",
            (
                "medium" if causes else "hard",
                template.format(threshold=t.efficiency_critical_ratio, value=efficiency),
            ),
            gain,
        )
        if causes:
            found[-1] = dataclasses.replace(
                found[-1], details={**found[-1].details, "rollup": True}
            )
    # Stable sort: equal severities keep the fixed order above.
    found.sort(key=lambda f: -SEVERITIES.index(f.severity))
    return found


#: What a cause costs the job, as a share of its throughput, to be critical (a quarter)
#: or high (a twentieth); below, a warning. Severity follows what the job loses.
LOSS_CRITICAL_RATIO: Final = 0.25
LOSS_HIGH_RATIO: Final = 0.05
#: The bottleneck categories a cause (straggler, hang, slow link) can explain.
_SYMPTOMS: Final = ("communication", "efficiency")
_PHASE_WORDS: Final = {
    "compute": ("computes", "slower than its peers"),
    "input": ("is", "as late as its peers at each step, waiting for its input"),
    "host": ("is", "as late as its peers at each step, waiting for a CPU"),
}


def loss_severity(loss_ratio: float) -> str:
    """The severity of a cause that costs the job ``loss_ratio`` of its throughput."""
    if loss_ratio >= LOSS_CRITICAL_RATIO:
        return "critical"
    if loss_ratio >= LOSS_HIGH_RATIO:
        return "high"
    return "warning"


def what_if_step_s(step_s: float, excess_s: float) -> float:
    """The job's step period (seconds) without ``excess_s`` that every rank waits for at
    each synchronisation (a straggler's phase above its peers' median): the same
    formula for the live report (recent means) and the history's report (each step)."""
    return max(0.0, step_s - max(0.0, excess_s))


def straggler_excess_s(finding: Finding) -> float | None:
    """A straggler's phase time above its peers' median a step (seconds), what they
    wait for: ``details["excess_s"]`` where the detector measures it in wall-clock
    time, else THE ratio (``details["slowdown_ratio"]``, else ``score``) less one, times
    its peers' median; None where the finding carries neither."""
    measured = finding.details.get("excess_s")
    if isinstance(measured, (int, float)) and math.isfinite(measured):
        return max(0.0, float(measured))
    median = finding.details.get("peer_median_s")
    ratio = finding.details.get("slowdown_ratio", finding.score)
    if not isinstance(median, (int, float)) or not isinstance(ratio, (int, float)):
        return None
    excess = (float(ratio) - 1.0) * float(median)
    return max(0.0, excess) if math.isfinite(excess) else None


def phase_words(phase: str) -> tuple[str, str]:
    """How a straggler's phase reads around its ratio: ``computes 2.40x slower than its
    peers``, ``is 2.40x as late as its peers at each step, waiting for its input`` (or
    ``for a CPU``)."""
    return _PHASE_WORDS.get(phase, _PHASE_WORDS["compute"])


def straggler_summary(
    job: str,
    rank: str,
    ratio: float,
    peer_median_s: float | None,
    phase: str = "compute",
    loss_ratio: float | None = None,
) -> str:
    """The one sentence every surface shows of a straggler (the finding, its alert,
    Slack, the report): ``rank 1 of job j computes 2.40x slower than its peers (median
    0.100 s a step): the job loses ~58% of its throughput``; the ratio written by
    ``slowdown_text``, the loss by ``loss_text``."""
    verb, comparative = phase_words(phase)
    median = f" (median {peer_median_s:.3f} s a step)" if peer_median_s is not None else ""
    loss = (
        f": the job loses {loss_text(loss_ratio)} of its throughput"
        if loss_ratio is not None
        else ""
    )
    return f"rank {rank} of job {job} {verb} {slowdown_text(ratio)} {comparative}{median}{loss}"


def symptom_advice(category: str, cause: str) -> str:
    """What to do about a ``category`` symptom (communication, efficiency) that
    ``cause`` (``the straggler on rank 1``) explains: fix the cause."""
    if category == "communication":
        return (
            f"The ranks wait for {cause}, not for the network: fix it first (above); this "
            "wait goes with it, and tuning buckets or compression would not help."
        )
    return (
        f"The compute share is low because of {cause} (above): fix it first; profile "
        "(torch.profiler) only if the share stays low once it is gone."
    )


def rank_findings(
    bottlenecks: Sequence[Finding],
    others: Sequence[Finding],
    snapshot: JobSnapshot,
    *,
    thresholds: Thresholds | None = None,
) -> list[Finding]:
    """One job's report: ``bottlenecks`` and the job's straggler and slow-link findings
    among ``others`` (the rest are left out), with category, expected gain and
    difficulty filled in, linked and numbered.

    Causes (stragglers, slow links; a hang among ``others`` too, though it is not
    listed) explain symptoms: the peers' communication wait (where what is left of it
    without the cause is under the high threshold) and the efficiency roll-up. A
    symptom names its cause (``details[EXPLAINED_BY_KEY]``), never outranks it (its
    severity is at most the cause's) and follows it in the list; a cause's severity is
    what the job loses to it (``loss_severity``), stated in its summary. A low
    efficiency that other bottlenecks explain (``details["rollup"]``) follows the
    largest of them the same way. ``priority`` 1..n in the list's order: causes and
    independent findings most severe first, then largest expected gain (unknown last),
    each followed by what it explains."""
    t = thresholds if thresholds is not None else Thresholds()
    causes: list[Finding] = []
    for finding in others:
        if finding.kind == "straggler":
            causes.append(_straggler(finding, snapshot))
        elif finding.kind == "slow_link":
            causes.append(_slow_link(finding, snapshot))
    hangs = [f for f in others if f.kind == "hang"]
    linkable = hangs + sorted(causes, key=lambda f: -_loss(f))
    symptoms = [_explained(f, linkable, snapshot, t) for f in bottlenecks]
    rollup_causes = [
        f
        for f in symptoms
        if f.category in ("communication", "input") and EXPLAINED_BY_KEY not in f.details
    ]
    symptoms = [
        _under(f, max(rollup_causes, key=_gain))
        if f.details.get("rollup") is True and EXPLAINED_BY_KEY not in f.details and rollup_causes
        else f
        for f in symptoms
    ]
    return _numbered([*causes, *symptoms])


def _numbered(report: Sequence[Finding]) -> list[Finding]:
    """``report`` in reading order (see ``rank_findings``), priorities 1..n."""
    ids = {cause_id(f.kind, f.labels) for f in report}
    top = [
        f
        for f in report
        if EXPLAINED_BY_KEY not in f.details or f.details[EXPLAINED_BY_KEY] not in ids
    ]
    children: dict[object, list[Finding]] = {}
    for f in report:
        if f not in top:
            children.setdefault(f.details[EXPLAINED_BY_KEY], []).append(f)
    ordered: list[Finding] = []
    for f in sorted(top, key=_rank_key):
        ordered.append(f)
        below = children.get(cause_id(f.kind, f.labels), [])
        # The efficiency roll-up sums the others up: it comes last.
        ordered.extend(sorted(below, key=lambda c: (c.category == "efficiency", *_rank_key(c))))
    return [dataclasses.replace(f, priority=i) for i, f in enumerate(ordered, start=1)]


def _rank_key(f: Finding) -> tuple[int, float]:
    severity = SEVERITIES.index(f.severity) if f.severity in SEVERITIES else 0
    return -severity, -_gain(f)


def _gain(f: Finding) -> float:
    return f.expected_gain_ratio if f.expected_gain_ratio is not None else -1.0


def _loss(f: Finding) -> float:
    loss = f.details.get(LOSS_KEY)
    return float(loss) if isinstance(loss, (int, float)) else -1.0


def _explained(
    finding: Finding, causes: Sequence[Finding], snapshot: JobSnapshot, t: Thresholds
) -> Finding:
    """``finding`` under the first of ``causes`` that explains it, else as it is."""
    if finding.category not in _SYMPTOMS:
        return finding
    for cause in causes:
        if finding.category == "efficiency" or _explains_wait(cause, snapshot, t):
            return _under(finding, cause)
    return finding


def _explains_wait(cause: Finding, snapshot: JobSnapshot, t: Thresholds) -> bool:
    """Whether the job's communication wait without ``cause`` is under the high
    threshold: a hang makes every peer wait; a straggler's excess is waited for by its
    peers (the majority, so taken as every rank's); a slow link's lost bandwidth
    stretches the wait by what its gain says."""
    if cause.kind == "hang":
        return True
    comm, step = snapshot.communication_time_ratio, snapshot.step_s
    what_if = cause.details.get(WHAT_IF_KEY)
    if comm is None or not step or not isinstance(what_if, (int, float)) or what_if <= 0:
        return False
    saved_s = step - float(what_if)
    left = max(0.0, comm * step - saved_s) / float(what_if)
    return left <= t.communication_high_ratio


def _under(symptom: Finding, cause: Finding) -> Finding:
    """``symptom`` as a consequence of ``cause``: named, no more severe, no gain of its
    own (fixing the cause removes it), advice that points to the cause."""
    name = (
        cause_name(cause.kind, cause.labels)
        if cause.kind != "bottleneck"
        else f"the {cause.category} finding"
    )
    own = SEVERITIES.index(symptom.severity) if symptom.severity in SEVERITIES else 0
    cap = SEVERITIES.index(cause.severity) if cause.severity in SEVERITIES else own
    if cause.kind == "bottleneck":
        advice = symptom.recommendation  # the roll-up's: fix the other findings
    else:
        advice = symptom_advice(symptom.category, name)
    gain = symptom.expected_gain_ratio
    return dataclasses.replace(
        symptom,
        severity=SEVERITIES[min(own, cap)],
        recommendation=advice,
        expected_gain_ratio=gain if cause.kind == "bottleneck" else 0.0,
        details={
            **symptom.details,
            EXPLAINED_BY_KEY: cause_id(cause.kind, cause.labels),
            EXPLAINED_BY_NAME_KEY: name,
            **({} if cause.kind == "bottleneck" else {"gain_basis": f"none of its own: {name}"}),
        },
    )


def _with_loss(
    finding: Finding, snapshot: JobSnapshot, excess_s: float | None
) -> tuple[dict[str, object], float | None]:
    """``finding``'s details with what the job loses to it and its step time without
    it, where the snapshot has a step time; and that loss."""
    step = snapshot.step_s
    if excess_s is None or not step or step <= 0:
        return dict(finding.details), None
    what_if = what_if_step_s(step, excess_s)
    loss = _clip(1.0 - what_if / step)
    return {**finding.details, STEP_KEY: step, WHAT_IF_KEY: what_if, LOSS_KEY: loss}, loss


def _straggler(finding: Finding, snapshot: JobSnapshot) -> Finding:
    """Every peer waits for a straggler's extra phase time at each synchronisation: the
    job's step time without it is its step less that excess."""
    details, loss = _with_loss(finding, snapshot, straggler_excess_s(finding))
    median = details.get("peer_median_s")
    ratio = details.get("slowdown_ratio", finding.score)
    summary = straggler_summary(
        finding.labels.get("job", ""),
        finding.labels.get("rank", "?"),
        float(ratio) if isinstance(ratio, (int, float)) else finding.score,
        float(median) if isinstance(median, (int, float)) else None,
        str(details.get("phase", "compute")),
    )
    if loss is not None:
        details["gain_basis"] = "the straggler's time above its peers' median, which they wait for"
        summary += f": the job loses {loss_text(loss)} of its throughput"
    severity = loss_severity(loss) if loss is not None else finding.severity
    if details.get("page") is False:
        # Shown, not paged: slowness of a few steps so far, which may be a blip.
        summary += f" (for {details.get('steps', 0)} steps so far: it pages if it lasts)"
        severity = SEVERITIES[min(SEVERITIES.index(severity), SEVERITIES.index("warning"))]
    return dataclasses.replace(
        finding,
        summary=summary,
        severity=severity,
        category="straggler",
        expected_gain_ratio=loss,
        difficulty="medium",
        details=details,
    )


def _slow_link(finding: Finding, snapshot: JobSnapshot) -> Finding:
    """A link at ``score`` of its healthy bandwidth stretches communication by 1/score."""
    comm, step = snapshot.communication_time_ratio, snapshot.step_s
    gain = None
    details = dict(finding.details)
    if comm is not None and 0.0 < finding.score <= 1.0:
        gain = _clip(comm * (1.0 - finding.score))
        details["gain_basis"] = "communication wait at the healthy links' bandwidth"
        if step:
            details, _ = _with_loss(finding, snapshot, gain * step)
            details["gain_basis"] = "communication wait at the healthy links' bandwidth"
    return dataclasses.replace(
        finding,
        category="network",
        severity=loss_severity(gain) if gain is not None and step else finding.severity,
        expected_gain_ratio=gain,
        difficulty="hard",
        details=details,
    )


def _clip(value: float) -> float:
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def _check_ratio(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a ratio in 0..1 or None, got {value}")
