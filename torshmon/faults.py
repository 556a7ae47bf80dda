"""Faults injected for real inside a training job: ``torshmon demo --inject KIND[:k=v,...]``.

A fault changes what the job does (a rank really computes slower, really stops,
really leaks memory, really trains on a corrupted batch, its link really slows),
never the metrics it reports, so detection is tested end to end. Steps are
numbered from 1, as the probe numbers them; ``from`` is inclusive and ``to``
exclusive (default: the end of the job).

Kinds (defaults in brackets):

- ``straggler:rank=R[1],slowdown=F[0.5],from=S[20],to=E``: rank R's compute takes
  ``1 + F`` times longer: it sleeps F times its own normal in-step time inside each
  step (the median over the latest fault-free steps of the time from ``begin_step``
  to ``end_compute``). That time includes waiting in the gradient all-reduce, so where
  communication is much of a step, the rank's compute as the probe measures it (step
  minus communication wait) grows by more than F; the detection benchmark reports the
  ratio the job's ``steps`` table shows.
- ``regression:slowdown=F[0.5],from=S[20],to=E``: the whole job's steps take ``1 + F``
  times longer (a bad library upgrade, a slower kernel): every rank sleeps F times the
  job's normal step time inside the step (the median over the latest fault-free steps
  of the time from ``begin_step`` to ``end_compute``: the same on every rank of a synchronous job,
  so no rank looks slower than another). Time the job spends between steps (a
  harness's pause) is not a step's and is not stretched.
- ``hang:rank=R[1],from=S[20],seconds=T[8]``: at the start of step S rank R stops for
  T seconds before its forward pass, so its peers enter the step's gradient
  all-reduce and wait for it. The job resumes afterwards.
- ``memory-leak:rank=R[1],from=S[20],to=E,mb=M[8]``: rank R keeps M MB of tensors
  alive per step (written, so the pages are resident); at step E it lets them go and
  hands the freed pages back to the OS (glibc's ``malloc_trim``), so a later leak
  cannot reuse them unseen: its RSS rises from its first step.
- ``loss-spike:rank=R[1],from=S[20],to=E[S+5],factor=K[10],nan=0|1[0]``: rank R trains
  on a corrupted batch: targets scaled by K (the loss jumps by about K squared), or
  with ``nan=1`` inputs full of NaN (the loss is NaN and, after the all-reduce, every
  rank's gradients: the demo skips such a step as a loss scaler would).
- ``slow-link:rank=R[1],rate=X[100mbit],from=S[20],to=E``: rank R's network link drops
  to rate X (``tc tbf``, both directions, see ``torshmon.linkshape``). The demo runs
  the ranks in network namespaces for it; needs root and iproute2.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Final

#: Every kind, and the parameters each takes.
PARAMS: Final[dict[str, frozenset[str]]] = {
    "straggler": frozenset({"rank", "slowdown", "from", "to"}),
    "slow-input": frozenset({"rank", "slowdown", "from", "to"}),
    "regression": frozenset({"slowdown", "from", "to"}),
    "hang": frozenset({"rank", "from", "seconds"}),
    "memory-leak": frozenset({"rank", "from", "to", "mb"}),
    "loss-spike": frozenset({"rank", "from", "to", "factor", "nan"}),
    "slow-link": frozenset({"rank", "rate", "from", "to"}),
}
KINDS: Final = tuple(PARAMS)
#: A straggler's or regression's normal step time is the median of this many latest
#: fault-free steps.
NORMAL_STEPS: Final = 50
#: A loss spike without ``to`` lasts this many steps.
LOSS_SPIKE_STEPS: Final = 5


class FaultError(ValueError):
    """A fault spec that cannot be injected; the text names what is wrong."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: its kind, the rank it hits (None: every rank), its step range, and
    the kind's own parameters (``amount``: slowdown, seconds, MB per step or factor)."""

    kind: str
    rank: int | None
    start_step: int
    stop_step: int | None = None
    amount: float = 0.0
    nan: bool = False
    rate: str | None = None

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.stop_step is None or step < self.stop_step)

    def hits(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def describe(self) -> str:
        once = self.kind == "hang"
        until = f" until step {self.stop_step}" if self.stop_step is not None and not once else ""
        who = f"rank {self.rank}" if self.rank is not None else "every rank"
        what = {
            "straggler": f"computes {1 + self.amount:g}x slower",
            "slow-input": f"waits {self.amount:g}x its step time for each batch",
            "regression": f"computes {1 + self.amount:g}x slower",
            "hang": f"stops for {self.amount:g} s before a collective",
            "memory-leak": f"leaks {self.amount:g} MB per step",
            "loss-spike": "trains on NaN inputs"
            if self.nan
            else f"trains on targets scaled by {self.amount:g}",
            "slow-link": f"link drops to {self.rate}",
        }[self.kind]
        return f"{self.kind}: {who} {what} from step {self.start_step}{until}"


def parse_fault(spec: str) -> Fault:
    """``KIND[:key=value,...]`` to a Fault; FaultError names the bad part."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in PARAMS:
        raise FaultError(f"unknown fault kind {kind!r} in {spec!r}; known: {', '.join(KINDS)}")
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq:
            raise FaultError(f"expected key=value in {spec!r}, got {part!r}")
        if key not in PARAMS[kind]:
            allowed = ", ".join(sorted(PARAMS[kind]))
            raise FaultError(f"unknown parameter {key!r} for {kind}; allowed: {allowed}")
        params[key] = value.strip()
    start = _int(params, "from", 20, spec)
    if start < 1:
        raise FaultError(f"from must be >= 1 (steps count from 1) in {spec!r}, got {start}")
    stop: int | None = _int(params, "to", 0, spec) if "to" in params else None
    if kind == "loss-spike" and stop is None:
        stop = start + LOSS_SPIKE_STEPS
    if kind == "hang":
        stop = start + 1  # it stops once, before that step
    if stop is not None and stop <= start:
        raise FaultError(f"'to' ({stop}) must be after 'from' ({start}) in {spec!r}")
    rank = None if kind == "regression" else _int(params, "rank", 1, spec)
    fault = Fault(kind=kind, rank=rank, start_step=start, stop_step=stop)
    if kind in ("straggler", "slow-input", "regression"):
        return _with_amount(fault, params, "slowdown", 0.5, spec)
    if kind == "hang":
        return _with_amount(fault, params, "seconds", 8.0, spec)
    if kind == "memory-leak":
        return _with_amount(fault, params, "mb", 8.0, spec)
    if kind == "loss-spike":
        nan = _int(params, "nan", 0, spec)
        if nan not in (0, 1):
            raise FaultError(f"nan must be 0 or 1 in {spec!r}, got {nan}")
        fault = _with_amount(fault, params, "factor", 10.0, spec)
        return replace(fault, nan=bool(nan))
    rate = params.get("rate", "100mbit")
    from torshmon.linkshape import parse_rate

    try:
        parse_rate(rate)
    except ValueError as exc:
        raise FaultError(f"rate in {spec!r}: {exc}") from None
    return replace(fault, rate=rate)


def _with_amount(
    fault: Fault, params: dict[str, str], key: str, default: float, spec: str
) -> Fault:
    amount = _float(params, key, default, spec)
    if not amount > 0:
        raise FaultError(f"{key} must be > 0 in {spec!r}, got {amount:g}")
    return replace(fault, amount=amount)


def _int(params: dict[str, str], key: str, default: int, spec: str) -> int:
    if key not in params:
        return default
    try:
        value = int(params[key])
    except ValueError:
        raise FaultError(f"{key} must be an integer in {spec!r}, got {params[key]!r}") from None
    if value < 0:
        raise FaultError(f"{key} must be >= 0 in {spec!r}, got {value}")
    return value


def _float(params: dict[str, str], key: str, default: float, spec: str) -> float:
    if key not in params:
        return default
    try:
        value = float(params[key])
    except ValueError:
        raise FaultError(f"{key} must be a number in {spec!r}, got {params[key]!r}") from None
    if not math.isfinite(value):
        raise FaultError(f"{key} must be a finite number in {spec!r}, got {params[key]!r}")
    return value


@dataclass(slots=True)
class FaultRunner:
    """Applies the faults that hit ``rank``, from inside its training loop.

    The loop calls ``before_step(step)`` where it fetches the step's batch,
    ``begin_step(step)`` first thing in the step, passes its batch
    through ``batch(step, x, y)``, and calls ``end_compute(step)`` after the
    optimizer. ``events`` records when each fault started and stopped on this
    rank (``fault<i>_onset_step``, ``fault<i>_onset_unix_s``, ``fault<i>_end_unix_s``,
    ``i`` the fault's index in the job's list), for benchmarks to measure detection
    latency from. Slow links are applied outside the ranks (see ``demo.run_system``).
    """

    rank: int
    faults: tuple[Fault, ...]
    #: Where to leave ``fault<i>.on`` / ``fault<i>.off`` files for faults applied outside
    #: the ranks (slow links): the launcher watches for them.
    signal_dir: str | None = None
    events: dict[str, float] = field(default_factory=dict)
    #: In-step times of the latest fault-free steps (no fault of any rank active: in a
    #: synchronous job a peer's fault slows this rank too); not the first steps of the
    #: job, which start-up slows, and not stale ones when faults come one after another.
    _normal_s: deque[float] = field(default_factory=lambda: deque(maxlen=NORMAL_STEPS))
    _step_started: float = 0.0
    #: Each leak's tensors, by the fault's index: one leak ending frees only its own.
    _leaked: dict[int, list[Any]] = field(default_factory=dict)

    def _mine(self, kinds: tuple[str, ...]) -> list[tuple[int, Fault]]:
        return [(i, f) for i, f in enumerate(self.faults) if f.kind in kinds and f.hits(self.rank)]

    def _track(self, index: int, fault: Fault, step: int) -> bool:
        """Record the fault's start and end on this rank; whether it is active."""
        active = fault.active(step)
        onset = f"fault{index}_onset_unix_s"
        if active and onset not in self.events:
            self.events[onset] = time.time()
            self.events[f"fault{index}_onset_step"] = float(step)
        elif not active and onset in self.events and f"fault{index}_end_unix_s" not in self.events:
            self.events[f"fault{index}_end_unix_s"] = time.time()
        return active

    def before_step(self, step: int) -> None:
        """Call before ``step`` begins, where the loop fetches its batch: a slow data
        loader waits ``slowdown`` x this rank's normal step time here."""
        slow = [f for i, f in self._mine(("slow-input",)) if self._track(i, f, step)]
        if slow:
            time.sleep(sum(f.amount for f in slow) * self.normal_step_s(0.0))

    def begin_step(self, step: int) -> None:
        for index, fault in self._mine(("slow-link",)):
            self._signal(index, fault, step)
        for index, fault in self._mine(("hang",)):
            if step == fault.start_step and f"fault{index}_onset_unix_s" not in self.events:
                self._track(index, fault, step)
                time.sleep(fault.amount)
                self.events[f"fault{index}_end_unix_s"] = time.time()
        self._step_started = time.perf_counter()

    def _signal(self, index: int, fault: Fault, step: int) -> None:
        if self.signal_dir is None:
            return
        what = "on" if fault.active(step) else "off" if step >= fault.start_step else None
        path = os.path.join(self.signal_dir, f"fault{index}.{what}")
        if what is not None and not os.path.exists(path):
            with open(path, "w"):
                pass

    def batch(self, step: int, x: Any, y: Any) -> tuple[Any, Any]:
        """The batch rank ``rank`` trains on at ``step`` (corrupted during a loss spike)."""
        for index, fault in self._mine(("loss-spike",)):
            if not self._track(index, fault, step):
                continue
            if fault.nan:
                x = x.clone().fill_(math.nan)
            else:
                y = y * fault.amount
        return x, y

    def end_compute(self, step: int) -> None:
        """Call after this rank's forward/backward/optimizer of ``step``."""
        elapsed = time.perf_counter() - self._step_started
        for index, fault in self._mine(("memory-leak",)):
            if self._track(index, fault, step):
                self._leak(index, fault.amount)
            elif step >= (fault.stop_step or step + 1) and index in self._leaked:
                del self._leaked[index]
                _return_freed_memory()
        normal = self.normal_step_s(elapsed)
        if not any(f.active(step) for f in self.faults):
            self._normal_s.append(elapsed)
        slow = [f for i, f in self._mine(("straggler",)) if self._track(i, f, step)]
        if slow:
            time.sleep(sum(f.amount for f in slow) * normal)
        job_wide = [f for i, f in self._mine(("regression",)) if self._track(i, f, step)]
        if job_wide:
            time.sleep(sum(f.amount for f in job_wide) * normal)

    @property
    def leaked_bytes(self) -> int:
        """Bytes the memory leaks hold now."""
        return sum(t.numel() * t.element_size() for ts in self._leaked.values() for t in ts)

    def normal_step_s(self, default: float) -> float:
        """The median time from ``begin_step`` to ``end_compute`` over the latest
        ``NORMAL_STEPS`` fault-free steps (``default`` before any): what a straggler and a
        regression stretch."""
        return _median(list(self._normal_s), default)

    def _leak(self, index: int, mb: float) -> None:
        import torch

        # ones, not empty: untouched pages would not be resident, so RSS would not grow.
        tensor = torch.ones(int(mb * 1e6) // 4, dtype=torch.float32)
        self._leaked.setdefault(index, []).append(tensor)


def _return_freed_memory() -> None:
    """Hand the allocator's free pages back to the OS (glibc's ``malloc_trim``).

    A leak's tensors freed at its end stay resident in glibc's heap; a later leak's
    allocations would take those pages first, and RSS would not rise for seconds (seen:
    a 4 MB-a-step leak flat for its first 5 s after three others ended). Not glibc: nothing.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _median(values: list[float], default: float) -> float:
    return sorted(values)[len(values) // 2] if values else default
