"""The search space: bucket cap (log scale) x codec choices, minus the knobs a user pinned."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution

from torshmon.aggregator.core.tuner.config import (
    DEFAULT_CODECS,
    KNOBS,
    CodecChoice,
    TrialConfig,
    TunerError,
    check_cap,
)

if TYPE_CHECKING:
    pass


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
        low = check_cap(self.min_bucket_cap_mb, "min_bucket_cap_mb")
        high = check_cap(self.max_bucket_cap_mb, "max_bucket_cap_mb")
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
