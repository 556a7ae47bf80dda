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
5. Proposals: first the prior's (``prior``): what the job told while its baseline was
   measured (communication's share of step time, bucket count, loss spread) and the
   link check's slowest link pick the codecs to try at the job's own cap (compress
   only when communication dominates; below 10 Gbit/s top-k 0.001 and PowerSGD rank 1,
   below 25 top-k 0.01 and PowerSGD rank 4, else int8 and fp16; an unsteady loss one
   class lighter); then the best codec so far at 1/8 and 8x that cap, so the optimiser
   learns early which way the bucket size goes; then optuna's TPE sampler over the
   mixed space (codec family categorical, codec param and bucket cap log scale). The
   session ends after ``max_trials`` measured configs (the baseline included) or when
   the optimiser has converged (it keeps proposing configs already measured). It then
   applies the best config and measures it again against the baseline; unless it is
   still better beyond noise, the baseline is restored: the tuner leaves a job alone
   when nothing helps. ``proposer="random"`` replaces all of it with random draws from
   the space's grid, measured the same way: the baseline benchmarks compare with.

Only one config is ever in flight: no ``ApplyConfig`` is returned while the previous
one awaits its acknowledgement (``on_applied``, ``on_rejected``, or ``on_timeout``
after ``apply_timeout_s``).

Why TPE and not a Gaussian process: TPE takes categorical and log-scaled parameters
natively and asks in milliseconds; optuna's GPSampler took 0.1-1.5 s per ask here
(and imports torch into the aggregator) for no better result on the synthetic
shaped-link model of the tests, where the prior + TPE reaches 0.99 of the grid's best
in 8 trials on every seed tested (random search, as a session with the same budget:
0.91 on average; the tuner without its prior 0.57). The optuna study is rebuilt
from the recorded trials before every ask, with a seed derived from ``seed`` and the
number of trials told, so a proposal is a function of the history alone: a session
restored with ``from_state`` proposes exactly what the original would have.

Codec names, params, bounds and bucket caps come from ``torshmon.catalogue``, the
table the probe validates against.
"""

from __future__ import annotations

from torshmon.aggregator.core.tuner.config import (
    DEFAULT_CODECS,
    DEFAULT_MAX_RELATIVE_ERROR,
    KNOBS,
    CodecChoice,
    TrialConfig,
    TunerError,
)
from torshmon.aggregator.core.tuner.drift import DriftWatch
from torshmon.aggregator.core.tuner.events import (
    Abort,
    ApplyConfig,
    Decision,
    Finish,
    StepSample,
    Trial,
)
from torshmon.aggregator.core.tuner.session import TuningSession
from torshmon.aggregator.core.tuner.settings import RetuneSettings, TunerSettings
from torshmon.aggregator.core.tuner.space import SearchSpace
from torshmon.catalogue.codecs import CODEC_NAMES

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
