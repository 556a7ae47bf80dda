"""How a tuning session measures, decides and stops (``TunerSettings``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torshmon.aggregator.core.tuner.config import (
    DEFAULT_MAX_RELATIVE_ERROR,
    TunerError,
)
from torshmon.catalogue.codecs import (
    CODEC_NAMES,
)

if TYPE_CHECKING:
    pass


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
    prior: bool = True
    compress_above: float = 0.4
    codec_screen: int = 2
    bucket_screen: tuple[float, ...] = (0.125, 8.0)
    n_startup_trials: int = 3
    max_repeats: int = 5
    max_failures: int = 3
    proposer: Literal["tpe", "random"] = "tpe"
    apply_timeout_s: float = 300.0
    step_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_relative_error", dict(self.max_relative_error))
        at_least("max_trials", self.max_trials, 2)
        at_least("warmup_steps", self.warmup_steps, 0)
        at_least("window_steps", self.window_steps, 1)
        at_least("windows", self.windows, 2)
        at_least("min_windows", self.min_windows, 2)
        if self.min_windows > self.windows:
            raise TunerError(
                f"min_windows ({self.min_windows}) must not exceed windows ({self.windows})"
            )
        at_least("min_error_samples", self.min_error_samples, 1)
        at_least("codec_screen", self.codec_screen, 0)
        object.__setattr__(self, "bucket_screen", tuple(self.bucket_screen))
        for factor in self.bucket_screen:
            in_open_interval("bucket_screen factor", factor, 0.0, math.inf)
        at_least("n_startup_trials", self.n_startup_trials, 0)
        at_least("max_repeats", self.max_repeats, 1)
        at_least("max_failures", self.max_failures, 1)
        in_open_interval("alpha", self.alpha, 0.0, 1.0)
        in_open_interval("min_improvement", self.min_improvement, 0.0, 1.0, closed_low=True)
        in_open_interval("compress_above", self.compress_above, 0.0, 1.0, closed_low=True)
        if self.proposer not in ("tpe", "random"):
            raise TunerError(f"proposer must be 'tpe' or 'random', got {self.proposer!r}")
        in_open_interval("loss_degradation", self.loss_degradation, 0.0, math.inf)
        in_open_interval("apply_timeout_s", self.apply_timeout_s, 0.0, math.inf)
        in_open_interval("step_timeout_s", self.step_timeout_s, 0.0, math.inf)
        for codec, bound in self.max_relative_error.items():
            if codec not in CODEC_NAMES:
                raise TunerError(
                    f"max_relative_error: codec must be one of {', '.join(CODEC_NAMES)}; "
                    f"got {codec!r}"
                )
            in_open_interval(f"max_relative_error[{codec!r}]", bound, 0.0, math.inf)


def at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TunerError(f"{name} must be an integer >= {low}, got {value!r}")


def in_open_interval(
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
