"""Faults injected for real inside a training job: ``torshmon demo --inject KIND[:k=v,...]``.

A fault changes what the job does (a rank really computes slower), never the
metrics it reports, so detection is tested end to end.

Kinds:

- ``straggler:rank=R,slowdown=F,from=S,to=E``: from step S (inclusive) to step E
  (exclusive; default: the end) rank R's compute takes F times longer
  (``slowdown=0.5`` adds half of its own normal compute time, measured over the
  steps before the fault starts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

KINDS: Final = ("straggler",)
_PARAMS: Final = {"straggler": {"rank", "slowdown", "from", "to"}}


class FaultError(ValueError):
    """A fault spec that cannot be injected; the text names what is wrong."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: its kind, the rank it hits (None: every rank) and its step range."""

    kind: str
    rank: int | None
    start_step: int
    stop_step: int | None = None
    slowdown: float = 0.0

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.stop_step is None or step < self.stop_step)

    def describe(self) -> str:
        until = f" until step {self.stop_step}" if self.stop_step is not None else ""
        who = f"rank {self.rank}" if self.rank is not None else "every rank"
        return (
            f"{self.kind} on {who} from step {self.start_step}{until} (slowdown {self.slowdown:g})"
        )


def parse_fault(spec: str) -> Fault:
    """``KIND[:key=value,...]`` to a Fault; FaultError names the bad part."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultError(f"unknown fault kind {kind!r} in {spec!r}; known: {', '.join(KINDS)}")
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise FaultError(f"expected key=value in {spec!r}, got {part!r}")
        if key not in _PARAMS[kind]:
            raise FaultError(
                f"unknown parameter {key!r} for {kind}; allowed: {', '.join(sorted(_PARAMS[kind]))}"
            )
        params[key] = value
    rank = _int(params, "rank", 1, spec)
    start = _int(params, "from", 20, spec)
    stop = _int(params, "to", None, spec) if "to" in params else None
    slowdown = _float(params, "slowdown", 0.5, spec)
    if slowdown <= 0:
        raise FaultError(f"slowdown must be > 0 in {spec!r}, got {slowdown}")
    if stop is not None and stop <= start:
        raise FaultError(f"'to' ({stop}) must be after 'from' ({start}) in {spec!r}")
    return Fault(kind=kind, rank=rank, start_step=start, stop_step=stop, slowdown=slowdown)


def _int(params: dict[str, str], key: str, default: int | None, spec: str) -> int:
    if key not in params:
        if default is None:
            raise FaultError(f"{key} is required in {spec!r}")
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
        return float(params[key])
    except ValueError:
        raise FaultError(f"{key} must be a number in {spec!r}, got {params[key]!r}") from None


@dataclass(slots=True)
class FaultRunner:
    """Applies the faults that hit ``rank``, from inside its training loop."""

    rank: int
    faults: tuple[Fault, ...]
    _compute_s: list[float] = field(default_factory=list)
    _step_started: float = 0.0

    def begin_step(self) -> None:
        self._step_started = time.perf_counter()

    def end_compute(self, step: int) -> None:
        """Call after this rank's forward/backward/optimizer of ``step``."""
        elapsed = time.perf_counter() - self._step_started
        mine = [f for f in self.faults if f.rank in (None, self.rank)]
        hit = [f for f in mine if f.kind == "straggler" and f.active(step)]
        if not hit:
            if len(self._compute_s) < 50:
                self._compute_s.append(elapsed)
            return
        baseline = (
            sorted(self._compute_s)[len(self._compute_s) // 2] if self._compute_s else elapsed
        )
        time.sleep(sum(f.slowdown for f in hit) * baseline)
