"""How a tuning session measures, decides and stops (``TunerSettings``, section
``tuner``), and when a finished job is tuned again (``RetuneSettings``, ``tuner.retune``)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from torshmon.aggregator.core.tuner.config import (
    DEFAULT_MAX_RELATIVE_ERROR,
    TunerError,
)
from torshmon.catalogue.codecs import (
    CODEC_NAMES,
)
from torshmon.settings import Section, SettingsError, setting


class RetuneSettings(Section, frozen=True):
    """When a finished session's job is tuned again because its throughput drifted.

    After a session ends, the job's throughput (windows of ``window_steps`` steps, as a
    session scores them) is compared with the session's verified windows by a one-sided
    Mann-Whitney U test over the last ``windows`` windows. The job drifts while that
    test says lower at level ``alpha`` AND the median is below the reference by more
    than ``threshold`` (0.15 = 15 %); drifting without a break for ``for_s`` seconds
    starts a new session, at most one per ``min_interval_s`` per job (counted from the
    end of the last session). ``enabled=False`` turns it off. Checked once when built:
    TunerError names a bad value.
    """

    enabled: Annotated[
        bool, setting("tune a finished job again when its throughput drifts down")
    ] = True
    threshold: Annotated[
        float,
        setting(
            "relative drop of median throughput (0.15 = 15 %) below the session's verified "
            "windows that counts as drift",
            gt=0,
            lt=1,
        ),
    ] = 0.15
    alpha: Annotated[
        float, setting("significance level of the one-sided Mann-Whitney U test", gt=0, lt=1)
    ] = 0.01
    window_steps: Annotated[int, setting("steps of one throughput window", ge=1)] = 10
    windows: Annotated[int, setting("recent windows compared with the reference", ge=2)] = 5
    for_s: Annotated[
        float, setting("seconds drift must last without a break to start a session", ge=0)
    ] = 300.0
    min_interval_s: Annotated[
        float,
        setting("seconds at least from the end of a job's last session to a re-tune", ge=0),
    ] = 3600.0

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except SettingsError as exc:
            raise TunerError(str(exc)) from None
        for name in ("threshold", "alpha", "for_s", "min_interval_s"):
            finite(name, getattr(self, name))


class TunerSettings(Section, frozen=True):
    """How the autotuner measures, decides and stops; every session's defaults.

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
    configs end the search. ``retune`` says when a finished job is tuned again.
    Checked once when built: TunerError names a bad value.
    """

    max_trials: Annotated[
        int, setting("configs a session measures at most, the baseline included", ge=2)
    ] = 12
    warmup_steps: Annotated[int, setting("steps discarded after each config switch", ge=0)] = 5
    window_steps: Annotated[int, setting("steps of one measurement window", ge=1)] = 10
    windows: Annotated[int, setting("windows a trial measures", ge=2)] = 5
    min_windows: Annotated[
        int,
        setting(
            "windows after which a regression or a guardrail may end a trial (<= windows)", ge=2
        ),
    ] = 3
    alpha: Annotated[
        float, setting("significance level of the one-sided Mann-Whitney U tests", gt=0, lt=1)
    ] = 0.05
    min_improvement: Annotated[
        float,
        setting(
            "relative change of median throughput (0.02 = 2 %) a trial must show to be kept "
            "or worse",
            ge=0,
            lt=1,
        ),
    ] = 0.02
    max_relative_error: Annotated[
        dict[str, float],
        setting(
            "per codec, the largest median sampled relative error it may bring",
            default_text=", ".join(f"{c}: {b}" for c, b in DEFAULT_MAX_RELATIVE_ERROR.items()),
        ),
    ] = msgspec.field(default_factory=lambda: dict(DEFAULT_MAX_RELATIVE_ERROR))
    min_error_samples: Annotated[
        int, setting("error samples a trial needs before its error bound is applied", ge=1)
    ] = 1
    loss_degradation: Annotated[
        float, setting("relative loss rise after a switch that ends a trial", gt=0)
    ] = 0.1
    prior: Annotated[
        bool, setting("screen codecs and bucket caps the job's own figures suggest first")
    ] = True
    compress_above: Annotated[
        float,
        setting(
            "communication share of a step above which compressing codecs are screened", ge=0, lt=1
        ),
    ] = 0.4
    codec_screen: Annotated[
        int, setting("trials of the strongest codecs before the optimiser", ge=0)
    ] = 2
    bucket_screen: Annotated[
        tuple[float, ...],
        setting(
            "factors of the incumbent's bucket cap screened before the optimiser (each > 0)",
            default_text="0.125, 8.0",
        ),
    ] = (0.125, 8.0)
    n_startup_trials: Annotated[
        int, setting("TPE's random start, counted over all points told", ge=0)
    ] = 3
    max_repeats: Annotated[
        int, setting("proposals in a row of configs already measured that end the search", ge=1)
    ] = 5
    max_failures: Annotated[
        int, setting("configs in a row the job refused that end the search", ge=1)
    ] = 3
    proposer: Annotated[
        Literal["tpe", "random"], setting("how configs are proposed: tpe or random")
    ] = "tpe"
    apply_timeout_s: Annotated[
        float, setting("seconds a config switch may take to be acknowledged", gt=0)
    ] = 300.0
    step_timeout_s: Annotated[
        float, setting("seconds a job may send no step while measured", gt=0)
    ] = 300.0
    retune: RetuneSettings = msgspec.field(default_factory=RetuneSettings)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except SettingsError as exc:
            raise TunerError(str(exc)) from None
        for name in ("alpha", "min_improvement", "loss_degradation", "compress_above"):
            finite(name, getattr(self, name))
        finite("apply_timeout_s", self.apply_timeout_s)
        finite("step_timeout_s", self.step_timeout_s)
        if self.min_windows > self.windows:
            raise TunerError(
                f"min_windows ({self.min_windows}) must not exceed windows ({self.windows})"
            )
        for factor in self.bucket_screen:
            in_open_interval("bucket_screen factor", factor, 0.0, math.inf)
        for codec, bound in self.max_relative_error.items():
            if codec not in CODEC_NAMES:
                raise TunerError(
                    f"max_relative_error: codec must be one of {', '.join(CODEC_NAMES)}; "
                    f"got {codec!r}"
                )
            in_open_interval(f"max_relative_error[{codec!r}]", bound, 0.0, math.inf)


def finite(name: str, value: float) -> None:
    """TunerError unless ``value`` is a finite number."""
    if not math.isfinite(value):
        raise TunerError(f"{name} must be a finite number, got {value!r}")


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
