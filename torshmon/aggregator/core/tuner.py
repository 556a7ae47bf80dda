"""The autotuner's pure core: one tuning session of one job as an event-driven state machine.

The session searches DDP bucket cap (log scale) x gradient codec for the config with
the highest throughput, and returns decisions that the caller executes (push a config,
finish, abort); it does no I/O and reads no clock: every event carries ``now`` (Unix
seconds) and all randomness comes from ``seed``.

How a session runs:

1. ``start`` re-applies the job's own config. The acknowledgement proves the control
   path works and gives a clean step from which the baseline is measured.
2. Each config is measured the same way: steps of other config versions are ignored,
   the first ``warmup_steps`` after the switch are discarded (buckets rebuild, PowerSGD
   warms up), then ``windows`` windows of ``window_steps`` steps each give one
   throughput per window (total samples over total time); the score is their median.
3. A trial is compared with the incumbent (the baseline, then the best kept trial) by a
   one-sided Mann-Whitney U test on the window throughputs, so that noise does not look
   like progress: it is ``kept`` only if it is better at level ``alpha`` AND its median
   beats the incumbent's by ``min_improvement``; ``worse`` (significantly and by
   ``min_improvement``) is decided as soon as ``min_windows`` windows show it and rolls
   back to the incumbent at once; anything between is ``not_better``.
4. Guardrails: a codec whose median sampled relative error exceeds its bound is
   ``rejected_error``; a loss that rises by more than ``loss_degradation`` (relative,
   and significantly) over the loss just before the switch, or turns non-finite, is
   ``rejected_loss``. Both roll back to the incumbent and ban that codec choice.
5. Proposals: a short screen (PowerSGD at the job's own bucket cap, then the best
   codec so far at 1/8 and 8x that cap, so the optimiser learns early which way the
   bucket size goes), then optuna's TPE sampler over the mixed space (codec family
   categorical, codec param and bucket cap log scale). The session ends after ``max_trials``
   measured configs (the baseline included) or when the optimiser has converged (it
   keeps proposing configs already measured). It then applies the best config and
   measures it again against the baseline; unless it is still better beyond noise,
   the baseline is restored: the tuner leaves a job alone when nothing helps.

Only one config is ever in flight: no ``ApplyConfig`` is returned while the previous
one awaits its acknowledgement (``on_applied``, ``on_rejected``, or ``on_timeout``
after ``apply_timeout_s``).

Why TPE and not a Gaussian process: TPE takes categorical and log-scaled parameters
natively and asks in milliseconds; optuna's GPSampler took 0.1-1.5 s per ask here
(and imports torch into the aggregator) for no better result on the synthetic
shaped-link model of the tests, where the screen + TPE reaches 95 % of the grid's
best in 12 trials in ~98 % of seeds (random search: ~70 %). The optuna study is rebuilt
from the recorded trials before every ask, with a seed derived from ``seed`` and the
number of trials told, so a proposal is a function of the history alone: a session
restored with ``from_state`` proposes exactly what the original would have.

Codec names, params, bounds and bucket caps come from ``torshmon.catalogue``, the
table the probe validates against.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import msgspec
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from scipy import stats  # type: ignore[import-untyped]  # scipy ships no type stubs

from torshmon.catalogue.codecs import (
    CODEC_NAMES,
    MIB,
    ConfigError,
    validate_bucket_cap_mb,
    validate_codec,
)

if TYPE_CHECKING:
    from torshmon.wire import AppliedConfig, StepRecord

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_CODECS",
    "DEFAULT_MAX_RELATIVE_ERROR",
    "KNOBS",
    "Abort",
    "ApplyConfig",
    "CodecChoice",
    "Decision",
    "DriftWatch",
    "Finish",
    "RetuneSettings",
    "SearchSpace",
    "StepSample",
    "Trial",
    "TrialConfig",
    "TunerError",
    "TunerSettings",
    "TuningSession",
]

#: Knobs a user can pin: the bucket caps (both), or the codec with its params.
KNOBS: Final = ("bucket_cap_mb", "codec")
#: Per-step relative error bounds by codec; a codec missing here has no bound. The
#: error-feedback codecs (PowerSGD, top-k) have none by default: their per-step error is
#: that of a projection (below 1 by construction) of the gradient plus the residual
#: carried over, large by design and no sign of harm (what is not sent now is sent
#: later). On the demo's MLP (batch 64, so gradients of rank <= 64) PowerSGD rank 4
#: measured 0.997 while training normally, so a bound such as 0.9 banned PowerSGD
#: outright, and only on the trials whose window happened to hold a sampled step. The
#: loss guard is what protects training from them; a user can still set a bound.
DEFAULT_MAX_RELATIVE_ERROR: Final[Mapping[str, float]] = {
    "fp16": 0.1,
    "bf16": 0.1,
    "int8": 0.1,
}
#: The codec screen: one choice per family, in order of typical benefit on a slow link.
_SCREEN: Final[tuple[tuple[str, Mapping[str, float | int]], ...]] = (
    ("powersgd", {"rank": 4}),
    ("fp16", {}),
    ("int8", {"bits": 8}),
    ("topk", {"ratio": 0.01}),
)
_STATE_VERSION: Final = 1
#: TPE's candidates per ask (optuna's default is 24): with a dozen trials there is no
#: budget for exploration, so the proposal is the best of many candidates.
_TPE_CANDIDATES: Final = 100
_PENALTY_FACTOR: Final = 0.5

TrialKind: TypeAlias = Literal["baseline", "trial", "verify"]
TrialDecision: TypeAlias = Literal[
    "kept", "rolled_back", "rejected_error", "rejected_loss", "worse", "not_better", "failed"
]
Purpose: TypeAlias = Literal["baseline", "trial", "rollback", "verify", "restore"]
Phase: TypeAlias = Literal["created", "applying", "measuring", "finished", "aborted"]


class TunerError(ValueError):
    """A tuner setting, search space or saved state that cannot be used; names the value."""


# -- configs --------------------------------------------------------------------------------


def _normalise_codec(codec: object, params: Mapping[str, object]) -> dict[str, float | int]:
    """The codec's params with defaults filled in; TunerError names a bad name or param."""
    try:
        return validate_codec(codec, params)
    except ConfigError as exc:
        raise TunerError(str(exc)) from None


def _check_cap(value: object, name: str) -> float:
    try:
        return validate_bucket_cap_mb(value, name)
    except ConfigError as exc:
        raise TunerError(str(exc)) from None


def _fmt_mb(value: float) -> str:
    return f"{value:.3g}"


@dataclass(frozen=True, slots=True)
class CodecChoice:
    """One codec with fixed params, a value of the search space's codec dimension.

    Params are normalised on construction (defaults filled in, as the probe reports
    them); TunerError names a bad codec or param.
    """

    codec: str
    params: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _normalise_codec(self.codec, self.params))

    def __hash__(self) -> int:
        return hash(self.label)

    @property
    def label(self) -> str:
        """``fp16``, ``powersgd(rank=4)``: unique within a space."""
        if not self.params or self.codec == "int8":
            return self.codec
        inner = ",".join(f"{k}={v:g}" for k, v in sorted(self.params.items()))
        return f"{self.codec}({inner})"


#: The default codec dimension: PowerSGD ranks and top-k ratios as separate choices.
DEFAULT_CODECS: Final[tuple[CodecChoice, ...]] = (
    CodecChoice("none"),
    CodecChoice("fp16"),
    CodecChoice("bf16"),
    CodecChoice("powersgd", {"rank": 1}),
    CodecChoice("powersgd", {"rank": 2}),
    CodecChoice("powersgd", {"rank": 4}),
    CodecChoice("powersgd", {"rank": 8}),
    CodecChoice("topk", {"ratio": 0.001}),
    CodecChoice("topk", {"ratio": 0.01}),
    CodecChoice("int8"),
)


@dataclass(frozen=True, slots=True)
class TrialConfig:
    """A complete communication config: both DDP bucket caps (MiB) and the codec.

    Validated on construction (TunerError names the bad field). ``args()`` gives the
    probe's ``request_config`` keyword arguments, every field set, so applying it does
    not depend on what the job ran before.
    """

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    codec: str = "none"
    codec_params: Mapping[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_cap_mb", _check_cap(self.bucket_cap_mb, "bucket_cap_mb"))
        first = _check_cap(self.first_bucket_cap_mb, "first_bucket_cap_mb")
        object.__setattr__(self, "first_bucket_cap_mb", first)
        object.__setattr__(self, "codec_params", _normalise_codec(self.codec, self.codec_params))

    @classmethod
    def from_applied(cls, applied: AppliedConfig) -> TrialConfig:
        """The config a job reported applying (``wire.AppliedConfig``; caps in bytes)."""
        return cls(
            bucket_cap_mb=applied.bucket_cap_bytes / MIB,
            first_bucket_cap_mb=applied.first_bucket_cap_bytes / MIB,
            codec=applied.codec,
            codec_params=dict(applied.codec_params),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialConfig:
        """Inverse of ``to_dict``; TunerError names a missing or bad field."""
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as exc:
            raise TunerError(f"invalid config {dict(data)!r}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the SQL ``config`` columns)."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "codec": self.codec,
            "codec_params": dict(self.codec_params),
        }

    def args(self) -> dict[str, object]:
        """``request_config`` keyword arguments (a config command's ``args``)."""
        return self.to_dict()

    @property
    def choice(self) -> CodecChoice:
        return CodecChoice(self.codec, self.codec_params)

    def key(self) -> tuple[float, float, str, tuple[tuple[str, float], ...]]:
        """Identity for "already measured": equal keys are the same config."""
        params = tuple(sorted((k, float(v)) for k, v in self.codec_params.items()))
        return (self.bucket_cap_mb, self.first_bucket_cap_mb, self.codec, params)

    def __hash__(self) -> int:
        return hash(self.key())

    @property
    def bucket_label(self) -> str:
        """``4 MB``, or ``25 MB (first 1)`` when the first bucket's cap differs."""
        text = f"{_fmt_mb(self.bucket_cap_mb)} MB"
        if self.first_bucket_cap_mb != self.bucket_cap_mb:
            text += f" (first {_fmt_mb(self.first_bucket_cap_mb)})"
        return text

    def describe(self) -> str:
        """``fp16, bucket 4 MB``."""
        return f"{self.choice.label}, bucket {self.bucket_label}"


# -- the search space -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Bucket cap (MiB, log scale, snapped to ``steps_per_octave`` points per doubling)
    x codec choices, with the ``pinned`` knobs (see ``KNOBS``) removed: a pinned knob
    keeps the baseline's value in every trial.

    TunerError on an empty or inverted cap range, caps outside the probe's bounds, no
    or duplicate codec choices, an unknown pinned knob, or every knob pinned.
    """

    min_bucket_cap_mb: float = 1.0
    max_bucket_cap_mb: float = 256.0
    steps_per_octave: int = 2
    codecs: tuple[CodecChoice, ...] = DEFAULT_CODECS
    pinned: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        low = _check_cap(self.min_bucket_cap_mb, "min_bucket_cap_mb")
        high = _check_cap(self.max_bucket_cap_mb, "max_bucket_cap_mb")
        if not low < high:
            raise TunerError(
                f"min_bucket_cap_mb ({low:g}) must be below max_bucket_cap_mb ({high:g})"
            )
        if isinstance(self.steps_per_octave, bool) or not (
            isinstance(self.steps_per_octave, int) and 1 <= self.steps_per_octave <= 16
        ):
            raise TunerError(
                f"steps_per_octave must be an integer in [1, 16], got {self.steps_per_octave!r}"
            )
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "pinned", frozenset(self.pinned))
        if not self.codecs:
            raise TunerError("codecs must hold at least one codec choice")
        labels = [choice.label for choice in self.codecs]
        if len(set(labels)) != len(labels):
            raise TunerError(f"codec choices must be distinct, got {', '.join(labels)}")
        unknown = sorted(self.pinned - set(KNOBS))
        if unknown:
            raise TunerError(f"unknown pinned knob {unknown[0]!r}; allowed: {', '.join(KNOBS)}")
        if self.pinned == set(KNOBS):
            raise TunerError("every knob is pinned (bucket_cap_mb and codec): nothing to tune")

    @property
    def tunes_bucket(self) -> bool:
        return "bucket_cap_mb" not in self.pinned

    @property
    def tunes_codec(self) -> bool:
        return "codec" not in self.pinned

    def bucket_values(self, steps_per_octave: int | None = None) -> tuple[float, ...]:
        """The discretised caps, MiB: ``min * 2 ** (k / steps)`` up to ``max`` (included),
        rounded to 3 significant digits."""
        steps = self.steps_per_octave if steps_per_octave is None else steps_per_octave
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise TunerError(f"steps_per_octave must be an integer >= 1, got {steps!r}")
        low, high = self.min_bucket_cap_mb, self.max_bucket_cap_mb
        count = math.floor(math.log2(high / low) * steps + 1e-9)
        values = [float(f"{low * 2 ** (k / steps):.3g}") for k in range(count + 1)]
        if values[-1] < high * (1 - 1e-3):
            values.append(high)
        return tuple(sorted(set(values)))

    def snap_bucket(self, cap_mb: float) -> float:
        """The grid cap nearest to ``cap_mb`` on the log scale."""
        target = math.log(max(cap_mb, 1e-9))
        return min(self.bucket_values(), key=lambda v: (abs(math.log(v) - target), v))

    def choice(self, label: str) -> CodecChoice:
        """The codec choice with this label; TunerError lists the labels allowed."""
        for option in self.codecs:
            if option.label == label:
                return option
        allowed = ", ".join(c.label for c in self.codecs)
        raise TunerError(f"codec choice must be one of {allowed}; got {label!r}")

    def grid(
        self, baseline: TrialConfig | None = None, *, steps_per_octave: int = 1
    ) -> list[TrialConfig]:
        """Every config of the space on a grid of ``steps_per_octave`` caps per doubling
        (for exhaustive benchmarks). ``baseline`` supplies pinned knobs; TunerError if
        a knob is pinned and no baseline is given."""
        if self.pinned and baseline is None:
            raise TunerError(f"a baseline is needed to fill the pinned {sorted(self.pinned)}")
        caps = self.bucket_values(steps_per_octave) if self.tunes_bucket else (None,)
        choices = self.codecs if self.tunes_codec else (None,)
        out: list[TrialConfig] = []
        for cap in caps:
            for option in choices:
                out.append(self.make_config(cap, option, baseline))
        return out

    def dimensions(self) -> dict[str, BaseDistribution]:
        """The optimiser's dimensions (optuna distributions) of the unpinned knobs.

        ``codec`` is the codec family (categorical). A family offered with several
        values of its one param (PowerSGD ranks, top-k ratios) adds an ordinal log-scale
        dimension ``<codec>_<param>``: ranks 2 and 4 are neighbours, which one flat
        categorical of all choices would not say. Every point has every dimension (one
        of another family is inert) because optuna's TPE models conditional dimensions
        apart from the rest, losing e.g. the rank x bucket interaction. ``bucket_cap_mb``
        is log scale.
        """
        dims: dict[str, BaseDistribution] = {}
        if self.tunes_codec:
            dims["codec"] = CategoricalDistribution(list(self._families()))
            for family in self._families():
                ordinal = self._ordinal(family)
                if ordinal is not None:
                    name, values = ordinal
                    dims[name] = FloatDistribution(min(values), max(values), log=True)
        if self.tunes_bucket:
            dims["bucket_cap_mb"] = FloatDistribution(
                self.min_bucket_cap_mb, self.max_bucket_cap_mb, log=True
            )
        return dims

    def config_for(self, params: Mapping[str, Any], baseline: TrialConfig) -> TrialConfig:
        """The config of one optimiser point, snapped to the bucket grid and to the
        nearest codec param offered."""
        cap = self.snap_bucket(float(params["bucket_cap_mb"])) if self.tunes_bucket else None
        option = None
        if self.tunes_codec:
            family = str(params["codec"])
            options = self._families().get(family)
            if options is None:
                allowed = ", ".join(self._families())
                raise TunerError(f"codec must be one of {allowed}; got {family!r}")
            option = options[0]
            ordinal = self._ordinal(family)
            if ordinal is not None:
                name, _ = ordinal
                param = name.removeprefix(f"{family}_")
                target = math.log(float(params[name]))
                option = min(
                    options, key=lambda c: (abs(math.log(float(c.params[param])) - target), c.label)
                )
        return self.make_config(cap, option, baseline)

    def params_for(self, config: TrialConfig) -> dict[str, Any] | None:
        """The optimiser point of a config; None if the config lies outside the space."""
        params: dict[str, Any] = {}
        if self.tunes_codec:
            label = config.choice.label
            if label not in {c.label for c in self.codecs}:
                return None
            params["codec"] = config.codec
            for family in self._families():
                ordinal = self._ordinal(family)
                if ordinal is None:
                    continue
                name, values = ordinal
                if family == config.codec:
                    params[name] = float(config.codec_params[name.removeprefix(f"{family}_")])
                else:  # inert for this point: the middle of the range, always the same
                    params[name] = math.exp(statistics.fmean(math.log(v) for v in values))
        if self.tunes_bucket:
            cap = config.bucket_cap_mb
            if not self.min_bucket_cap_mb <= cap <= self.max_bucket_cap_mb:
                return None
            params["bucket_cap_mb"] = cap
        return params

    def _families(self) -> dict[str, list[CodecChoice]]:
        families: dict[str, list[CodecChoice]] = {}
        for option in self.codecs:
            families.setdefault(option.codec, []).append(option)
        return families

    def _ordinal(self, family: str) -> tuple[str, list[float]] | None:
        """(dimension name, values) of the one param telling a family's choices apart."""
        options = self._families().get(family, [])
        if len(options) < 2:
            return None
        varying = {k for c in options for k in c.params if c.params[k] != options[0].params[k]}
        if len(varying) != 1:  # pragma: no cover - every probe codec has at most one param
            raise TunerError(f"codec {family!r}: choices must differ in exactly one param")
        param = varying.pop()
        return f"{family}_{param}", sorted(float(c.params[param]) for c in options)

    def make_config(
        self, cap: float | None, option: CodecChoice | None, baseline: TrialConfig | None
    ) -> TrialConfig:
        """The config with cap ``cap`` (MiB, both caps) and codec ``option``; None takes
        the baseline's (TunerError if there is none)."""
        if cap is not None and option is not None:
            return TrialConfig(cap, cap, option.codec, option.params)
        if baseline is None:
            raise TunerError("a baseline is needed to fill the pinned knobs")
        caps = (
            (cap, cap)
            if cap is not None
            else (
                baseline.bucket_cap_mb,
                baseline.first_bucket_cap_mb,
            )
        )
        option = option if option is not None else baseline.choice
        return TrialConfig(caps[0], caps[1], option.codec, option.params)


# -- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TunerSettings:
    """How a session measures, decides and stops.

    ``max_trials`` counts measured configs, the baseline included (the final
    verification is extra). Steps: ``warmup_steps`` discarded after each switch, then
    ``windows`` windows of ``window_steps``; ``min_windows`` is when a regression or a
    guardrail can end a trial early. ``alpha`` is the significance level of the
    one-sided Mann-Whitney U tests; ``min_improvement`` the relative change of median
    throughput (0.02 = 2 %) a trial must show, beyond significance, to be ``kept`` or
    ``worse``. ``max_relative_error`` bounds each codec's median sampled relative error
    (see DEFAULT_MAX_RELATIVE_ERROR); ``loss_degradation`` the relative loss rise after a
    switch. Before the optimiser: ``codec_screen`` trials of the strongest codecs at the
    job's own cap, then the incumbent's codec at the caps ``bucket_screen`` times the
    incumbent's. ``n_startup_trials`` is TPE's random start (counted over all points
    told, the screen included); ``max_repeats`` the consecutive proposals of configs
    already measured that count as convergence; ``max_failures`` consecutive refused
    configs end the search. Timeouts (seconds): an acknowledgement, and steps while
    measuring. TunerError names a bad value.
    """

    max_trials: int = 12
    warmup_steps: int = 5
    window_steps: int = 10
    windows: int = 5
    min_windows: int = 3
    alpha: float = 0.05
    min_improvement: float = 0.02
    max_relative_error: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_MAX_RELATIVE_ERROR)
    )
    min_error_samples: int = 1
    loss_degradation: float = 0.1
    codec_screen: int = 1
    bucket_screen: tuple[float, ...] = (0.125, 8.0)
    n_startup_trials: int = 3
    max_repeats: int = 5
    max_failures: int = 3
    apply_timeout_s: float = 300.0
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_relative_error", dict(self.max_relative_error))
        _at_least("max_trials", self.max_trials, 2)
        _at_least("warmup_steps", self.warmup_steps, 0)
        _at_least("window_steps", self.window_steps, 1)
        _at_least("windows", self.windows, 2)
        _at_least("min_windows", self.min_windows, 2)
        if self.min_windows > self.windows:
            raise TunerError(
                f"min_windows ({self.min_windows}) must not exceed windows ({self.windows})"
            )
        _at_least("min_error_samples", self.min_error_samples, 1)
        _at_least("codec_screen", self.codec_screen, 0)
        object.__setattr__(self, "bucket_screen", tuple(self.bucket_screen))
        for factor in self.bucket_screen:
            _in_open_interval("bucket_screen factor", factor, 0.0, math.inf)
        _at_least("n_startup_trials", self.n_startup_trials, 0)
        _at_least("max_repeats", self.max_repeats, 1)
        _at_least("max_failures", self.max_failures, 1)
        _in_open_interval("alpha", self.alpha, 0.0, 1.0)
        _in_open_interval("min_improvement", self.min_improvement, 0.0, 1.0, closed_low=True)
        _in_open_interval("loss_degradation", self.loss_degradation, 0.0, math.inf)
        _in_open_interval("apply_timeout_s", self.apply_timeout_s, 0.0, math.inf)
        _in_open_interval("step_timeout_s", self.step_timeout_s, 0.0, math.inf)
        for codec, bound in self.max_relative_error.items():
            if codec not in CODEC_NAMES:
                raise TunerError(
                    f"max_relative_error: codec must be one of {', '.join(CODEC_NAMES)}; "
                    f"got {codec!r}"
                )
            _in_open_interval(f"max_relative_error[{codec!r}]", bound, 0.0, math.inf)


def _at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TunerError(f"{name} must be an integer >= {low}, got {value!r}")


def _in_open_interval(
    name: str, value: object, low: float, high: float, *, closed_low: bool = False
) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (low <= value if closed_low else low < value)
        and value < high
    )
    if not ok:
        bracket = "[" if closed_low else "("
        raise TunerError(
            f"{name} must be a finite number in {bracket}{low:g}, {high:g}), got {value!r}"
        )


# -- events and decisions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepSample:
    """What the tuner reads from one of rank 0's steps.

    Throughput is ``samples_per_s`` when the job reports batch sizes, else steps per
    second from ``duration_s``. ``relative_errors`` are the sampled per-bucket codec
    errors of the step (empty on unsampled steps).
    """

    step: int
    config_version: int
    samples_per_s: float | None = None
    duration_s: float | None = None
    loss: float | None = None
    loss_nonfinite: bool = False
    relative_errors: tuple[float, ...] = ()

    @classmethod
    def from_record(cls, record: StepRecord) -> StepSample:
        """The sample of a ``wire.StepRecord``."""
        return cls(
            step=record.step,
            config_version=record.config_version,
            samples_per_s=record.samples_per_s,
            duration_s=record.duration_s,
            loss=record.loss,
            loss_nonfinite=record.loss_nonfinite,
            relative_errors=tuple(
                b.relative_error for b in record.buckets if b.relative_error is not None
            ),
        )

    def rate(self) -> tuple[float, str] | None:
        """(throughput, unit), or None when the step carries no usable timing."""
        speed = self.samples_per_s
        if speed is not None and math.isfinite(speed) and speed > 0:
            return speed, "samples/s"
        if self.duration_s is not None and math.isfinite(self.duration_s) and self.duration_s > 0:
            return 1.0 / self.duration_s, "steps/s"
        return None


@dataclass(frozen=True, slots=True)
class Trial:
    """One measured config of a session (the SQL ``tuning_trials`` row).

    ``kind``: ``baseline`` (index 0, the job's own config), ``trial``, or ``verify``
    (the best config measured again at the end). ``windows`` are throughputs per
    window, in the session's ``unit``; ``score`` their median. ``p_value`` is the
    one-sided test's against the incumbent (the baseline for ``verify``);
    ``relative_error`` the median sampled codec error; ``loss_windows`` the median
    loss per window. ``decision`` is None while the trial runs.
    """

    index: int
    kind: TrialKind
    config: TrialConfig
    started_unix_s: float
    version: int | None = None
    windows: tuple[float, ...] = ()
    loss_windows: tuple[float, ...] = ()
    score: float | None = None
    p_value: float | None = None
    relative_error: float | None = None
    decision: TrialDecision | None = None
    reason: str = ""
    ended_unix_s: float | None = None

    @property
    def state(self) -> str:
        """``applying`` (no acknowledgement yet), ``measuring`` or ``done``."""
        if self.decision is not None:
            return "done"
        return "applying" if self.version is None else "measuring"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        return data


@dataclass(frozen=True, slots=True)
class ApplyConfig:
    """Push ``config`` to the job (a ``config`` command with ``args``) and report its
    acknowledgement with ``on_applied`` / ``on_rejected``.

    ``purpose``: ``baseline``, ``trial``, ``verify`` (each starts trial ``trial_index``),
    ``rollback`` (back to the incumbent) or ``restore`` (back to the baseline).
    """

    config: TrialConfig
    reason: str
    purpose: Purpose
    trial_index: int | None = None

    @property
    def args(self) -> dict[str, object]:
        return self.config.args()


@dataclass(frozen=True, slots=True)
class Finish:
    """The session is over; the job runs ``best_config`` (already applied and verified).

    Scores are in the session's unit; ``best_score`` is the verification's when the
    config changed, else the baseline's. ``changed`` is False when the tuner left the
    job alone.
    """

    best_config: TrialConfig
    summary: str
    reason: str
    baseline_score: float | None
    best_score: float | None
    changed: bool


@dataclass(frozen=True, slots=True)
class Abort:
    """The session stopped without a result. ``restore_config``, when set, is the config
    the job should run (the incumbent) but may not: push it, best effort."""

    reason: str
    restore_config: TrialConfig | None = None


Decision: TypeAlias = ApplyConfig | Finish | Abort


# -- the session ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Segment:
    """Steps being measured for one applied config version."""

    version: int
    first_step: int  # the first step measured, after the warm-up
    last_step: int = -1
    rates: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Pending:
    config: TrialConfig
    purpose: Purpose
    trial_index: int | None


@dataclass(slots=True)
class _Told:
    """One point told to the optimiser; ``value`` None means "rejected" (penalised)."""

    params: dict[str, Any]
    value: float | None


@dataclass(slots=True)
class _State:
    space: SearchSpace
    settings: TunerSettings
    seed: int
    v: int = _STATE_VERSION
    phase: Phase = "created"
    baseline: TrialConfig | None = None
    current: TrialConfig | None = None  # what the job runs, as far as we know
    pending: _Pending | None = None
    segment: _Segment | None = None
    trials: list[Trial] = field(default_factory=list)
    told: list[_Told] = field(default_factory=list)
    screen: list[TrialConfig] = field(default_factory=list)
    bucket_screened: bool = False
    incumbent: int = 0
    banned: list[str] = field(default_factory=list)
    measured: list[TrialConfig] = field(default_factory=list)
    repeats: int = 0
    failures: int = 0
    loss_reference: list[float] = field(default_factory=list)
    unit: str = ""
    deadline_unix_s: float | None = None
    started_unix_s: float | None = None
    ended_unix_s: float | None = None
    reason: str = ""
    final_config: TrialConfig | None = None
    summary: str = ""


class TuningSession:
    """One job's tuning session; see the module docstring for the protocol.

    Not thread-safe: one caller drives a session. Every ``on_*`` method returns the
    decision to execute now, or None when there is nothing to do.
    """

    def __init__(
        self,
        space: SearchSpace | None = None,
        settings: TunerSettings | None = None,
        *,
        seed: int = 0,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise TunerError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self._s = _State(
            space=space if space is not None else SearchSpace(),
            settings=settings if settings is not None else TunerSettings(),
            seed=seed,
        )

    # -- persistence ---------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The whole session as a JSON-safe dict (``tuning_sessions.state_blob``)."""
        state: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self._s))
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TuningSession:
        """A session restored from ``to_state``; it decides exactly as the original would.

        After a restart call ``resume(now)`` so that timeouts count from then. Raises
        TunerError for a blob of another version or shape.
        """
        if state.get("v") != _STATE_VERSION:
            raise TunerError(
                f"tuner state version {state.get('v')!r} is not supported; "
                f"this tuner reads version {_STATE_VERSION}"
            )
        try:
            restored = msgspec.convert(dict(state), _State)
        except (msgspec.ValidationError, ValueError) as exc:
            raise TunerError(f"invalid tuner state: {exc}") from exc
        session = cls.__new__(cls)
        session._s = restored
        return session

    def resume(self, now: float) -> None:
        """Restart the running timeout from ``now`` (after a restore in a new process:
        acknowledgements and steps may have been queued while nobody listened)."""
        s = self._s
        if s.phase == "applying":
            s.deadline_unix_s = now + s.settings.apply_timeout_s
        elif s.phase == "measuring":
            s.deadline_unix_s = now + s.settings.step_timeout_s

    # -- read-only views -----------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """``created``, ``applying``, ``measuring``, ``finished`` or ``aborted``."""
        return self._s.phase

    @property
    def done(self) -> bool:
        return self._s.phase in ("finished", "aborted")

    @property
    def trials(self) -> tuple[Trial, ...]:
        return tuple(self._s.trials)

    @property
    def baseline(self) -> TrialConfig | None:
        return self._s.baseline

    @property
    def best(self) -> Trial | None:
        """The incumbent: the best kept trial so far (the baseline at first)."""
        return self._s.trials[self._s.incumbent] if self._s.trials else None

    @property
    def best_score(self) -> float | None:
        """The score the session stands by: once finished, the verified score if the
        best config was kept, else the baseline's; before that, the incumbent's."""
        trials = self._s.trials
        if self._s.phase == "finished":
            verify = trials[-1] if trials and trials[-1].kind == "verify" else None
            if verify is not None and verify.decision == "kept":
                return verify.score
            return trials[0].score if trials else None
        best = self.best
        return best.score if best is not None else None

    @property
    def unit(self) -> str:
        """``samples/s`` or ``steps/s``; empty before the first measured step."""
        return self._s.unit

    @property
    def deadline_unix_s(self) -> float | None:
        """When ``on_timeout`` should be called next (None: no timer needed)."""
        return self._s.deadline_unix_s

    @property
    def reason(self) -> str:
        """Why the session ended as it did (empty while it runs)."""
        return self._s.reason

    @property
    def final_config(self) -> TrialConfig | None:
        return self._s.final_config

    @property
    def pending(self) -> ApplyConfig | None:
        """The ApplyConfig awaiting its acknowledgement, if any (e.g. after a restore)."""
        p = self._s.pending
        if p is None or self._s.phase != "applying":
            return None
        return ApplyConfig(p.config, "awaiting acknowledgement", p.purpose, p.trial_index)

    def summary(self) -> str:
        """One line for people (Slack): what changed and what it gained."""
        s = self._s
        if s.summary:
            return s.summary
        if s.phase == "aborted":
            return f"tuning aborted: {s.reason}"
        done = sum(1 for t in s.trials if t.kind != "verify" and t.decision is not None)
        return f"tuning in progress: {done} of {s.settings.max_trials} trials measured"

    # -- events --------------------------------------------------------------------------

    def start(self, now: float, baseline_config: TrialConfig) -> Decision:
        """Begin: re-apply the job's own config and measure it as the baseline.

        TunerError if the session was already started.
        """
        s = self._s
        if s.phase != "created":
            raise TunerError(f"the session has already started (phase {s.phase!r})")
        s.started_unix_s = now
        s.baseline = s.current = baseline_config
        s.screen = self._codec_screen(baseline_config)
        s.trials.append(Trial(0, "baseline", baseline_config, now))
        return self._apply(now, baseline_config, "baseline", 0, "measure the job's own config")

    def on_applied(self, version: int, effective_step: int, now: float) -> Decision | None:
        """The awaited config was applied by all ranks from ``effective_step`` on, as
        config ``version``. Ignored when nothing is awaited."""
        s = self._s
        if s.phase != "applying" or s.pending is None:
            return None
        pending, s.pending = s.pending, None
        s.current = pending.config
        s.failures = 0
        if pending.purpose == "rollback":
            return self._next(now)
        if pending.purpose == "restore":
            return self._finish(now)
        index = pending.trial_index
        if index is None:  # pragma: no cover - every measuring purpose carries one
            raise TunerError("internal: a measured config without a trial index")
        s.trials[index] = replace(s.trials[index], version=version, started_unix_s=now)
        self._measure(now, version, effective_step + s.settings.warmup_steps)
        return None

    def on_rejected(self, reason: str, now: float) -> Decision | None:
        """The awaited config was refused (or its command expired); ``reason`` says why.
        Ignored when nothing is awaited."""
        s = self._s
        if s.phase != "applying" or s.pending is None:
            return None
        pending, s.pending = s.pending, None
        s.failures += 1
        target = pending.config.describe()
        if pending.purpose == "baseline":
            self._close_trial(now, 0, "failed", f"refused: {reason}")
            return self._abort(now, f"the job refused its own config ({reason})", None)
        if pending.purpose in ("rollback", "restore"):
            return self._abort(
                now, f"could not go back to {target}: {reason}", restore=pending.config
            )
        index = pending.trial_index
        if index is None:  # pragma: no cover - every measuring purpose carries one
            raise TunerError("internal: a measured config without a trial index")
        if pending.purpose == "verify":
            self._close_trial(now, index, "failed", f"refused: {reason}")
            return self._restore_baseline(now, f"the best config was refused ({reason})")
        self._close_trial(now, index, "failed", f"refused: {reason}")
        self._tell(pending.config, None)
        if s.failures >= s.settings.max_failures:
            return self._conclude(now, f"{s.failures} configs in a row were refused")
        return self._next(now)

    def on_timeout(self, now: float) -> Decision | None:
        """The caller's timer: acts only when ``deadline_unix_s`` has passed.

        No acknowledgement in time counts as a refusal; no steps in time while
        measuring aborts the session (the job stopped or stalled)."""
        s = self._s
        if s.deadline_unix_s is None or now < s.deadline_unix_s:
            return None
        if s.phase == "applying":
            return self.on_rejected(
                f"no acknowledgement within {s.settings.apply_timeout_s:g} s", now
            )
        if s.phase == "measuring":
            return self._abort(
                now,
                f"the job sent no step for {s.settings.step_timeout_s:g} s",
                restore=self._incumbent_config(),
            )
        return None

    def abort(self, reason: str, now: float) -> Abort:
        """Stop now (job ended, user cancelled); ``restore_config`` says what to push."""
        if self.done:
            return Abort(reason=self._s.reason)
        return self._abort(now, reason, restore=self._incumbent_config())

    def on_step(self, sample: StepSample, now: float) -> Decision | None:
        """One of rank 0's steps. Steps of other config versions, repeated or older
        steps, and warm-up steps are ignored."""
        s = self._s
        seg = s.segment
        if s.phase != "measuring" or seg is None or sample.config_version != seg.version:
            return None
        if sample.step <= seg.last_step:
            return None
        seg.last_step = sample.step
        s.deadline_unix_s = now + s.settings.step_timeout_s
        if sample.step < seg.first_step:
            return None
        if sample.loss_nonfinite or (sample.loss is not None and not math.isfinite(sample.loss)):
            return self._guard_failed(now, "rejected_loss", "the loss became non-finite")
        rate = sample.rate()
        if rate is None:
            return None
        if not s.unit:
            s.unit = rate[1]
        seg.rates.append(rate[0])
        if sample.loss is not None:
            seg.losses.append(sample.loss)
        if sample.relative_errors:
            seg.errors.append(max(sample.relative_errors))
            verdict = self._error_verdict()
            if verdict is not None:
                return self._guard_failed(now, "rejected_error", verdict)
        if len(seg.rates) < s.settings.window_steps:
            return None
        return self._close_window(now)

    # -- measuring -----------------------------------------------------------------------

    def _measure(self, now: float, version: int, first_step: int) -> None:
        s = self._s
        s.phase = "measuring"
        s.segment = _Segment(version=version, first_step=first_step)
        s.deadline_unix_s = now + s.settings.step_timeout_s

    def _active(self) -> Trial:
        return self._s.trials[-1]

    def _close_window(self, now: float) -> Decision | None:
        s = self._s
        seg = s.segment
        if seg is None:  # pragma: no cover - only called while measuring
            raise TunerError("internal: no segment")
        # Total samples over total time: the harmonic mean of per-step throughputs.
        throughput = len(seg.rates) / sum(1.0 / r for r in seg.rates)
        trial = self._active()
        loss_windows = trial.loss_windows
        if seg.losses:
            loss_windows = (*loss_windows, statistics.median(seg.losses))
        trial = replace(trial, windows=(*trial.windows, throughput), loss_windows=loss_windows)
        trial = replace(trial, score=statistics.median(trial.windows))
        s.trials[trial.index] = trial
        seg.rates.clear()
        seg.losses.clear()
        count = len(trial.windows)
        if trial.kind == "baseline":
            return self._end_baseline(now) if count >= s.settings.windows else None
        if count < s.settings.min_windows:
            return None
        loss_verdict = self._loss_verdict(trial)
        if loss_verdict is not None:
            return self._guard_failed(now, "rejected_loss", loss_verdict)
        reference = s.trials[0] if trial.kind == "verify" else s.trials[s.incumbent]
        p_more, p_less, ratio = self._compare(trial.windows, reference.windows)
        if p_less < s.settings.alpha and ratio <= 1 - s.settings.min_improvement:
            change = f"{ratio - 1:+.1%} vs {self._name(reference)} (p={p_less:.3g})"
            return self._regressed(now, trial, p_less, change)
        if count < s.settings.windows:
            return None
        change = f"{ratio - 1:+.1%} vs {self._name(reference)} (p={p_more:.3g})"
        if p_more < s.settings.alpha and ratio >= 1 + s.settings.min_improvement:
            return self._improved(now, trial, p_more, change)
        return self._unchanged(now, trial, p_more, change)

    def _compare(
        self, windows: Sequence[float], reference: Sequence[float]
    ) -> tuple[float, float, float]:
        """(p greater, p less, median ratio) of ``windows`` against ``reference``."""
        greater = float(stats.mannwhitneyu(windows, reference, alternative="greater").pvalue)
        less = float(stats.mannwhitneyu(windows, reference, alternative="less").pvalue)
        ratio = statistics.median(windows) / statistics.median(reference)
        return greater, less, ratio

    def _error_verdict(self) -> str | None:
        s, seg = self._s, self._s.segment
        trial = self._active()
        if seg is None or trial.kind == "baseline":
            return None  # the job's own codec is the user's choice, not ours to reject
        error = statistics.median(seg.errors)
        s.trials[trial.index] = replace(trial, relative_error=error)
        bound = s.settings.max_relative_error.get(trial.config.codec)
        if bound is None or len(seg.errors) < s.settings.min_error_samples or error <= bound:
            return None
        return f"relative error {error:.3g} exceeds the {trial.config.codec} bound {bound:g}"

    def _loss_verdict(self, trial: Trial) -> str | None:
        """Why the loss after the switch is worse than just before it, if it is."""
        s = self._s
        reference = s.loss_reference
        if len(trial.loss_windows) < s.settings.min_windows or len(reference) < 2:
            return None
        before, after = statistics.median(reference), statistics.median(trial.loss_windows)
        rise = after - before
        if rise <= s.settings.loss_degradation * abs(before):
            return None
        p = float(stats.mannwhitneyu(trial.loss_windows, reference, alternative="greater").pvalue)
        if p >= s.settings.alpha:
            return None
        return (
            f"loss rose from {before:.4g} to {after:.4g} after the switch "
            f"({rise / abs(before) if before else math.inf:+.0%}, p={p:.3g})"
        )

    # -- decisions on a trial ------------------------------------------------------------

    def _end_baseline(self, now: float) -> Decision | None:
        s = self._s
        trial = self._active()
        self._close_trial(now, 0, "kept", "baseline")
        s.incumbent = 0
        s.loss_reference = list(trial.loss_windows)
        s.measured.append(trial.config)
        self._tell(trial.config, trial.score)
        return self._next(now)

    def _improved(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        s = self._s
        self._close_trial(now, trial.index, "kept", change, p)
        s.loss_reference = list(trial.loss_windows)
        if trial.kind == "verify":
            return self._finish(now)
        s.incumbent = trial.index
        self._tell(trial.config, trial.score)
        return self._next(now)

    def _unchanged(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        s = self._s
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", f"not better: {change}", p)
            return self._restore_baseline(now, "the best config was not better on verification")
        self._close_trial(now, trial.index, "not_better", change, p)
        s.loss_reference = list(trial.loss_windows)
        self._tell(trial.config, trial.score)
        return self._next(now)

    def _regressed(self, now: float, trial: Trial, p: float, change: str) -> Decision | None:
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", f"worse: {change}", p)
            return self._restore_baseline(now, "the best config was worse on verification")
        self._close_trial(now, trial.index, "worse", change, p)
        self._s.loss_reference = list(trial.loss_windows)
        self._tell(trial.config, trial.score)
        return self._rollback(now, f"trial {trial.index} was worse: {change}")

    def _guard_failed(self, now: float, decision: TrialDecision, why: str) -> Decision | None:
        s = self._s
        trial = self._active()
        if trial.kind == "baseline":
            return self._abort(now, f"the baseline itself fails a guardrail: {why}", None)
        if trial.kind == "verify":
            self._close_trial(now, trial.index, "rolled_back", why)
            return self._restore_baseline(now, f"the best config failed verification: {why}")
        self._close_trial(now, trial.index, decision, why)
        if decision == "rejected_loss":
            # The harm may outlast the rollback: judge the next switch on its own loss.
            s.loss_reference = []
        s.banned.append(trial.config.choice.label)
        self._tell(trial.config, None)
        return self._rollback(now, f"trial {trial.index} {decision.replace('_', ' ')}: {why}")

    def _close_trial(
        self, now: float, index: int, decision: TrialDecision, reason: str, p: float | None = None
    ) -> None:
        s = self._s
        trial = s.trials[index]
        s.trials[index] = replace(
            trial, decision=decision, reason=reason, p_value=p, ended_unix_s=now
        )
        s.segment = None
        if trial.kind != "verify" and trial.windows and decision != "failed":
            s.measured.append(trial.config)

    # -- what comes next -----------------------------------------------------------------

    def _next(self, now: float) -> Decision | None:
        s = self._s
        measured = sum(1 for t in s.trials if t.kind != "verify")
        if measured >= s.settings.max_trials:
            return self._conclude(now, f"all {s.settings.max_trials} trials done")
        config = self._propose()
        if config is None:
            return self._conclude(now, "the optimiser converged")
        index = len(s.trials)
        s.trials.append(Trial(index, "trial", config, now))
        return self._apply(now, config, "trial", index, f"trial {index}: {config.describe()}")

    def _rollback(self, now: float, why: str) -> Decision | None:
        incumbent = self._s.trials[self._s.incumbent].config
        return self._apply(now, incumbent, "rollback", None, f"roll back: {why}")

    def _conclude(self, now: float, why: str) -> Decision | None:
        """End the search: verify the best config, or make sure the baseline runs."""
        s = self._s
        s.reason = why
        best = s.trials[s.incumbent]
        if s.incumbent == 0:
            return self._restore_baseline(now, f"{why}; no config beat the baseline")
        index = len(s.trials)
        s.trials.append(Trial(index, "verify", best.config, now))
        reason = f"{why}; verify the best config, {best.config.describe()}"
        # Applied again even when the job runs it already: the acknowledgement gives a
        # clean step to measure from, and the probe keeps its buckets when caps are equal.
        return self._apply(now, best.config, "verify", index, reason)

    def _restore_baseline(self, now: float, why: str) -> Decision | None:
        s = self._s
        s.reason = why
        s.incumbent = 0
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        if s.current is not None and s.current.key() == s.baseline.key():
            return self._finish(now)
        return self._apply(now, s.baseline, "restore", None, f"restore the baseline: {why}")

    def _apply(
        self, now: float, config: TrialConfig, purpose: Purpose, index: int | None, reason: str
    ) -> ApplyConfig:
        s = self._s
        s.phase = "applying"
        s.segment = None
        s.pending = _Pending(config, purpose, index)
        s.deadline_unix_s = now + s.settings.apply_timeout_s
        return ApplyConfig(config, reason, purpose, index)

    def _finish(self, now: float) -> Finish:
        s = self._s
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        verify = s.trials[-1] if s.trials[-1].kind == "verify" else None
        changed = verify is not None and verify.decision == "kept"
        final = verify.config if changed and verify is not None else s.baseline
        s.phase = "finished"
        s.final_config = final
        s.deadline_unix_s = None
        s.ended_unix_s = now
        s.summary = self._summarise(changed, verify)
        baseline_score = s.trials[0].score
        best_score = verify.score if changed and verify is not None else baseline_score
        return Finish(final, s.summary, s.reason, baseline_score, best_score, changed)

    def _abort(self, now: float, reason: str, restore: TrialConfig | None) -> Abort:
        s = self._s
        if restore is not None and s.current is not None and s.current.key() == restore.key():
            restore = None
        s.phase = "aborted"
        s.reason = reason
        s.pending = None
        s.segment = None
        s.deadline_unix_s = None
        s.ended_unix_s = now
        for trial in s.trials:
            if trial.decision is None:
                self._close_trial(now, trial.index, "failed", f"session aborted: {reason}")
        return Abort(reason, restore)

    def _incumbent_config(self) -> TrialConfig | None:
        s = self._s
        return s.trials[s.incumbent].config if s.trials else s.baseline

    # -- the optimiser -------------------------------------------------------------------

    def _codec_screen(self, baseline: TrialConfig) -> list[TrialConfig]:
        """The first proposals: the strongest codecs at the job's own cap."""
        s = self._s
        space = s.space
        if not space.tunes_codec:
            return []
        labels = {c.label for c in space.codecs}
        cap = space.snap_bucket(baseline.bucket_cap_mb) if space.tunes_bucket else None
        options = [CodecChoice(c, p) for c, p in _SCREEN if CodecChoice(c, p).label in labels]
        return [space.make_config(cap, o, baseline) for o in options][: s.settings.codec_screen]

    def _bucket_screen(self) -> list[TrialConfig]:
        """After the codec screen: the incumbent's codec at caps a factor either way, so
        that the optimiser learns early which way the bucket size goes."""
        s = self._s
        if not s.space.tunes_bucket:
            return []
        best = s.trials[s.incumbent].config
        option = best.choice if s.space.tunes_codec else None
        return [
            s.space.make_config(s.space.snap_bucket(best.bucket_cap_mb * f), option, s.baseline)
            for f in s.settings.bucket_screen
        ]

    def _propose(self) -> TrialConfig | None:
        """The next config to measure; None once the optimiser only repeats itself."""
        s = self._s
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        while s.screen or not s.bucket_screened:
            if not s.screen:
                s.bucket_screened = True
                s.screen = self._bucket_screen()
                continue
            config = s.screen.pop(0)
            if not self._known(config):
                return config
        while s.repeats < s.settings.max_repeats:
            config = s.space.config_for(self._ask(), s.baseline)
            if not self._known(config):
                s.repeats = 0
                return config
            # Tell the optimiser what it already knows, so it moves on.
            s.repeats += 1
            self._tell(config, self._known_value(config))
        return None

    def _known(self, config: TrialConfig) -> bool:
        s = self._s
        key = config.key()
        return (
            config.choice.label in s.banned
            or any(m.key() == key for m in s.measured)
            or any(t.config.key() == key and t.decision == "failed" for t in s.trials)
        )

    def _known_value(self, config: TrialConfig) -> float | None:
        key = config.key()
        if config.choice.label in self._s.banned:
            return None
        for trial in reversed(self._s.trials):
            if trial.config.key() == key and trial.kind != "verify":
                return trial.score if trial.decision not in ("failed",) else None
        return None

    def _tell(self, config: TrialConfig, value: float | None) -> None:
        params = self._s.space.params_for(config)
        if params is not None:
            self._s.told.append(_Told(params, value))

    def _ask(self) -> dict[str, Any]:
        s = self._s
        dims = s.space.dimensions()
        scores = [t.value for t in s.told if t.value is not None]
        penalty = _PENALTY_FACTOR * min(scores) if scores else 0.0
        # A fresh sampler per ask, seeded by the history's length: the proposal depends
        # on (seed, history) only, so a restored session asks exactly the same.
        with _quiet_optuna():
            sampler = optuna.samplers.TPESampler(
                seed=(s.seed * 1_000_003 + len(s.told)) % 2**32,
                n_startup_trials=s.settings.n_startup_trials,
                n_ei_candidates=_TPE_CANDIDATES,
                multivariate=True,
            )
            study = optuna.create_study(direction="maximize", sampler=sampler)
            study.add_trials(
                [
                    optuna.trial.create_trial(
                        params=t.params,
                        distributions={k: dims[k] for k in t.params},
                        value=penalty if t.value is None else t.value,
                    )
                    for t in s.told
                ]
            )
            return dict(study.ask(dims).params)

    # -- words ---------------------------------------------------------------------------

    def _name(self, trial: Trial) -> str:
        return "the baseline" if trial.index == 0 else f"trial {trial.index}"

    def _summarise(self, changed: bool, verify: Trial | None) -> str:
        s = self._s
        base = s.trials[0]
        if s.baseline is None:  # pragma: no cover - set by start()
            raise TunerError("internal: no baseline")
        trials = sum(1 for t in s.trials if t.kind == "trial" and t.decision != "failed")
        losses = any(t.loss_windows for t in s.trials)
        if changed and verify is not None and verify.score and base.score:
            parts = []
            old, new = s.baseline, verify.config
            if old.bucket_label != new.bucket_label:
                parts.append(
                    f"bucket {old.bucket_label.removesuffix(' MB')} -> {new.bucket_label}"
                    if old.first_bucket_cap_mb == old.bucket_cap_mb
                    else f"bucket {old.bucket_label} -> {new.bucket_label}"
                )
            if old.choice.label != new.choice.label:
                parts.append(f"codec {old.choice.label} -> {new.choice.label}")
            gain = verify.score / base.score - 1
            loss = "loss unaffected" if losses else "loss not reported"
            return (
                f"{', '.join(parts)}: {gain:+.0%} {s.unit} "
                f"({base.score:.4g} -> {verify.score:.4g}), {loss}; {trials} trials"
            )
        best = max(
            (t for t in s.trials if t.kind == "trial" and t.score is not None),
            key=lambda t: t.score or 0.0,
            default=None,
        )
        tried = ""
        if best is not None and best.score and base.score:
            tried = f"; best tried {best.config.describe()} at {best.score / base.score - 1:+.0%}"
        return f"left unchanged ({s.baseline.describe()}): {s.reason}{tried}; {trials} trials"


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Silence optuna's per-study INFO line and its experimental-feature warning."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(previous)


# -- re-tuning on drift ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetuneSettings:
    """When a finished session's job is tuned again because its throughput drifted.

    After a session ends, the job's throughput (windows of ``window_steps`` steps, as a
    session scores them) is compared with the session's verified windows by a one-sided
    Mann-Whitney U test over the last ``windows`` windows. The job drifts while that
    test says lower at level ``alpha`` AND the median is below the reference by more
    than ``threshold`` (0.15 = 15 %); drifting without a break for ``for_s`` seconds
    starts a new session, at most one per ``min_interval_s`` per job (counted from the
    end of the last session). ``enabled=False`` turns it off. TunerError names a bad value.
    """

    enabled: bool = True
    threshold: float = 0.15
    alpha: float = 0.01
    window_steps: int = 10
    windows: int = 5
    for_s: float = 300.0
    min_interval_s: float = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TunerError(f"enabled must be true or false, got {self.enabled!r}")
        _in_open_interval("threshold", self.threshold, 0.0, 1.0)
        _in_open_interval("alpha", self.alpha, 0.0, 1.0)
        _at_least("window_steps", self.window_steps, 1)
        _at_least("windows", self.windows, 2)
        _in_open_interval("for_s", self.for_s, 0.0, math.inf, closed_low=True)
        _in_open_interval("min_interval_s", self.min_interval_s, 0.0, math.inf, closed_low=True)


class DriftWatch:
    """Watches one job after its session ended; says when its throughput drifted away.

    ``reference`` are the windows the session stood by (the verification's, or the
    baseline's when it left the job alone), ``unit`` their unit, ``ended_unix_s`` when
    the session ended. Only steps of the first config version seen are used: a later
    version (someone changed the config) ends the watch, since the reference no longer
    describes the job. Pure: ``observe`` takes ``now``; not thread-safe.
    """

    def __init__(
        self,
        reference: Sequence[float],
        unit: str,
        ended_unix_s: float,
        settings: RetuneSettings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else RetuneSettings()
        if len(reference) < 2:
            raise TunerError(f"a drift watch needs >= 2 reference windows, got {len(reference)}")
        self.reference = tuple(reference)
        self.unit = unit
        self.ended_unix_s = ended_unix_s
        self.version: int | None = None
        self.stopped = False
        self.drifting_since: float | None = None
        self.ratio: float | None = None  # median of the recent windows over the reference's
        self._rates: list[float] = []
        self._windows: list[float] = []

    def observe(self, sample: StepSample, now: float) -> str | None:
        """Feed one of rank 0's steps; returns why to re-tune once drift has lasted, else None."""
        if self.stopped:
            return None
        if self.version is None:
            self.version = sample.config_version
        elif sample.config_version != self.version:
            self.stopped = True  # the config changed under us: the reference is void
            return None
        rate = sample.rate()
        if rate is None or rate[1] != self.unit:
            return None
        self._rates.append(rate[0])
        if len(self._rates) < self.settings.window_steps:
            return None
        self._windows.append(len(self._rates) / sum(1.0 / r for r in self._rates))
        self._rates.clear()
        del self._windows[: -self.settings.windows]
        return self._judge(now)

    def _judge(self, now: float) -> str | None:
        s = self.settings
        if len(self._windows) < s.windows:
            return None
        self.ratio = statistics.median(self._windows) / statistics.median(self.reference)
        p = float(stats.mannwhitneyu(self._windows, self.reference, alternative="less").pvalue)
        if not (p < s.alpha and self.ratio < 1 - s.threshold):
            self.drifting_since = None
            return None
        if self.drifting_since is None:
            self.drifting_since = now
        if now - self.drifting_since < s.for_s:
            return None
        if now - self.ended_unix_s < s.min_interval_s:
            return None
        return (
            f"throughput drifted {self.ratio - 1:+.0%} from the tuned {self.unit} "
            f"(p={p:.2g}) for {now - self.drifting_since:.0f} s"
        )
