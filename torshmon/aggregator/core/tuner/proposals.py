"""Where a session's proposals come from: the prior's codec screen and the bucket screen,
then optuna's TPE (or, as a benchmark's baseline, random draws).

Functions of their inputs alone (the session's seed and what it told the optimiser), so
a restored session proposes exactly what the original would have.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import optuna

from torshmon.aggregator.core.tuner.config import TrialConfig
from torshmon.aggregator.core.tuner.prior import Evidence, bucket_factors, first_proposals
from torshmon.aggregator.core.tuner.settings import TunerSettings
from torshmon.aggregator.core.tuner.space import SearchSpace
from torshmon.aggregator.core.tuner.state import Told

#: TPE's candidates per ask (optuna's default is 24): with a dozen trials there is no
#: budget for exploration, so the proposal is the best of many candidates.
TPE_CANDIDATES: Final = 100
#: A rejected or failed config is told to the optimiser as this fraction of the worst score.
PENALTY_FACTOR: Final = 0.5


def codec_screen(
    space: SearchSpace, settings: TunerSettings, baseline: TrialConfig, evidence: Evidence
) -> list[TrialConfig]:
    """The first proposals: the codecs the job's evidence points to, at its own cap
    (none without ``settings.prior``)."""
    if not settings.prior:
        return []
    return first_proposals(
        space,
        baseline,
        evidence,
        count=settings.codec_screen,
        compress_above=settings.compress_above,
        steady_loss_spread=settings.loss_degradation,
    )


def bucket_screen(
    space: SearchSpace,
    settings: TunerSettings,
    best: TrialConfig,
    baseline: TrialConfig | None,
    evidence: Evidence,
) -> list[TrialConfig]:
    """After the codec screen: the incumbent's codec (``best``) at caps a factor either
    way, so that the optimiser learns early which way the bucket size goes."""
    if not space.tunes_bucket:
        return []
    option = best.choice if space.tunes_codec else None
    return [
        space.make_config(space.snap_bucket(best.bucket_cap_mb * f), option, baseline)
        for f in bucket_factors(settings.bucket_screen, evidence)
    ]


def random_proposal(
    space: SearchSpace,
    baseline: TrialConfig,
    seed: int,
    told: int,
    known: Callable[[TrialConfig], bool],
) -> TrialConfig | None:
    """A config of the space's grid not ``known`` yet, drawn at random: a function of
    ``seed`` and the number of points told, like ``ask``. None when none is left."""
    pool = [c for c in space.grid(baseline, steps_per_octave=space.steps_per_octave)]
    pool = [c for c in pool if not known(c)]
    if not pool:
        return None
    return random.Random(seed * 1_000_003 + told).choice(pool)


def ask(
    space: SearchSpace, settings: TunerSettings, seed: int, told: Sequence[Told]
) -> dict[str, Any]:
    """The optimiser's next point, a function of ``seed`` and ``told`` alone."""
    dims = space.dimensions()
    scores = [t.value for t in told if t.value is not None]
    penalty = PENALTY_FACTOR * min(scores) if scores else 0.0
    # A fresh sampler per ask, seeded by the history's length: the proposal depends
    # on (seed, history) only, so a restored session asks exactly the same.
    with _quiet_optuna():
        sampler = optuna.samplers.TPESampler(
            seed=(seed * 1_000_003 + len(told)) % 2**32,
            n_startup_trials=settings.n_startup_trials,
            n_ei_candidates=TPE_CANDIDATES,
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
                for t in told
            ]
        )
        return dict(study.ask(dims).params)


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
