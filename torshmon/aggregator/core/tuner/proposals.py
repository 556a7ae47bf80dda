"""Where a session's proposals come from: the codec and bucket screens, then optuna's TPE.

Functions of their inputs alone (the session's seed and what it told the optimiser), so
a restored session proposes exactly what the original would have.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import optuna

from torshmon.aggregator.core.tuner.config import CodecChoice, TrialConfig
from torshmon.aggregator.core.tuner.settings import TunerSettings
from torshmon.aggregator.core.tuner.space import SearchSpace
from torshmon.aggregator.core.tuner.state import Told

#: The codec screen: one choice per family, in order of typical benefit on a slow link.
SCREEN: Final[tuple[tuple[str, Mapping[str, float | int]], ...]] = (
    ("powersgd", {"rank": 4}),
    ("fp16", {}),
    ("int8", {"bits": 8}),
    ("topk", {"ratio": 0.01}),
)
#: TPE's candidates per ask (optuna's default is 24): with a dozen trials there is no
#: budget for exploration, so the proposal is the best of many candidates.
TPE_CANDIDATES: Final = 100
#: A rejected or failed config is told to the optimiser as this fraction of the worst score.
PENALTY_FACTOR: Final = 0.5


def codec_screen(
    space: SearchSpace, settings: TunerSettings, baseline: TrialConfig
) -> list[TrialConfig]:
    """The first proposals: the strongest codecs at the job's own cap."""
    if not space.tunes_codec:
        return []
    labels = {c.label for c in space.codecs}
    cap = space.snap_bucket(baseline.bucket_cap_mb) if space.tunes_bucket else None
    options = [CodecChoice(c, p) for c, p in SCREEN if CodecChoice(c, p).label in labels]
    return [space.make_config(cap, o, baseline) for o in options][: settings.codec_screen]


def bucket_screen(
    space: SearchSpace, settings: TunerSettings, best: TrialConfig, baseline: TrialConfig | None
) -> list[TrialConfig]:
    """After the codec screen: the incumbent's codec (``best``) at caps a factor either
    way, so that the optimiser learns early which way the bucket size goes."""
    if not space.tunes_bucket:
        return []
    option = best.choice if space.tunes_codec else None
    return [
        space.make_config(space.snap_bucket(best.bucket_cap_mb * f), option, baseline)
        for f in settings.bucket_screen
    ]


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
