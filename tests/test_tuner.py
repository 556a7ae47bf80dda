"""The autotuner's pure core, driven by a synthetic job (``SimJob``).

The synthetic job is a 2-rank data-parallel model of 29 MB of gradients (8 tensors of
3.6 MB) on a link of a given speed: backward produces the tensors in order, DDP
reduces bucket after bucket as they fill, overlapped with the rest of backward, and
each codec costs encode time (half of it taken from compute on the same cores) and
sends its payload (ring all-reduce for none/fp16/bf16/PowerSGD factors, all-gather for
top-k and int8). Step times get log-normal noise and an occasional 1.5x hiccup from a
seeded RNG. On a 1 Gbit/s link compression wins (PowerSGD ~2.2x the default); on a
40 Gbit/s ("unshaped") link nothing beats the default by more than 1 %.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torshmon.aggregator.core.tuner import (
    CODEC_NAMES,
    DEFAULT_CODECS,
    DEFAULT_MAX_RELATIVE_ERROR,
    Abort,
    ApplyConfig,
    CodecChoice,
    Decision,
    DriftWatch,
    Finish,
    RetuneSettings,
    SearchSpace,
    StepSample,
    TrialConfig,
    TunerError,
    TunerSettings,
    TuningSession,
)
from torshmon.catalogue.codecs import (
    CODEC_SPECS,
    MAX_BUCKET_CAP_MB,
    MIN_BUCKET_CAP_MB,
    validate_codec,
)
from torshmon.wire import AppliedConfig, BucketStat, StepRecord

# -- the synthetic job ---------------------------------------------------------------------

LAYERS_MB = (3.6,) * 8
FORWARD_S, BACKWARD_S, OPTIMIZER_S = 0.04, 0.08, 0.02
LATENCY_S = 0.0015
BATCH = 64
COST_S_PER_MB = {"none": 0.0, "fp16": 0.0004, "bf16": 0.0004, "int8": 0.001, "topk": 0.003}
DEFAULT = TrialConfig(25.0, 1.0)  # torch's own layout: 25 MB buckets, 1 MB first bucket


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    noise: float = 0.03


SHAPED = Link(0.95e9 / 8)  # gloo reaches ~0.95 of a 1 Gbit/s tbf limit
UNSHAPED = Link(40e9 / 8)


def buckets_mb(config: TrialConfig) -> list[float]:
    out: list[float] = []
    filled, cap = 0.0, config.first_bucket_cap_mb
    for size in LAYERS_MB:
        if filled and filled + size > cap:
            out.append(filled)
            filled, cap = 0.0, config.bucket_cap_mb
        filled += size
    return [*out, filled]


def _codec_cost_s_per_mb(config: TrialConfig) -> float:
    if config.codec == "powersgd":
        return 0.0005 + 0.00025 * int(config.codec_params["rank"])
    return COST_S_PER_MB[config.codec]


def step_time_s(config: TrialConfig, link: Link) -> float:
    return FORWARD_S + BACKWARD_S + exposed_comm_s(config, link) + OPTIMIZER_S + cpu_s(config)


def cpu_s(config: TrialConfig) -> float:
    cost = _codec_cost_s_per_mb(config)
    return 0.5 * cost * sum(LAYERS_MB) + 0.0003 * len(buckets_mb(config))


def exposed_comm_s(config: TrialConfig, link: Link) -> float:
    """Communication not hidden behind backward: what the step waits for."""
    total, ready, done = sum(LAYERS_MB), 0.0, 0.0
    cost = _codec_cost_s_per_mb(config)
    for size in buckets_mb(config):
        ready += BACKWARD_S * size / total
        numel = size * 1e6 / 4
        calls = 1
        if config.codec in ("none", "fp16", "bf16"):
            wire = size * 1e6 * (1.0 if config.codec == "none" else 0.5)
        elif config.codec == "powersgd":
            wire, calls = 2 * int(config.codec_params["rank"]) * 2 * math.sqrt(numel) * 4, 2
        elif config.codec == "topk":
            wire = float(config.codec_params["ratio"]) * numel * 8
        else:  # int8
            wire = numel
        done = max(done, ready) + calls * LATENCY_S + cost * size + wire / link.bytes_per_s
    return max(0.0, done - BACKWARD_S)


def throughput(config: TrialConfig, link: Link) -> float:
    return BATCH / step_time_s(config, link)


def relative_error(config: TrialConfig) -> float:
    if config.codec == "powersgd":
        return 0.8 - 0.1 * math.log2(int(config.codec_params["rank"]))
    if config.codec == "topk":
        return 0.9
    return {"none": 0.0, "fp16": 1e-3, "bf16": 4e-3, "int8": 0.01}[config.codec]


@dataclass
class SimJob:
    """Applies a config at the next sync step (every 10 steps) and reports rank 0's steps."""

    link: Link
    seed: int
    config: TrialConfig = DEFAULT
    loss_factor: dict[str, float] = field(default_factory=dict)
    error_override: dict[str, float] = field(default_factory=dict)
    nan_codec: str | None = None
    version: int = 0
    step: int = 0
    now: float = 1000.0
    applied: list[TrialConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def apply(self, config: TrialConfig) -> tuple[int, int]:
        self.version += 1
        self.config = config
        self.applied.append(config)
        return self.version, self.step + 10 - self.step % 10

    def sample(self) -> StepSample:
        self.step += 1
        noise = math.exp(self.rng.gauss(0.0, self.link.noise))
        if self.rng.random() < 0.02:
            noise *= 1.5
        duration = step_time_s(self.config, self.link) * noise
        comm_wait = exposed_comm_s(self.config, self.link) * noise
        self.now += duration
        label = self.config.choice.label
        loss = (2.0 * math.exp(-self.step / 3000) + 0.3) * self.loss_factor.get(label, 1.0)
        loss *= math.exp(self.rng.gauss(0.0, 0.02))
        errors: tuple[float, ...] = ()
        if self.config.codec != "none" and self.step % 5 == 0:
            error = self.error_override.get(label, relative_error(self.config))
            errors = tuple(error * (1 + 0.02 * self.rng.random()) for _ in range(3))
        return StepSample(
            step=self.step,
            config_version=self.version,
            samples_per_s=BATCH / duration,
            duration_s=duration,
            loss=math.nan if label == self.nan_codec else loss,
            relative_errors=errors,
            comm_wait_s=comm_wait,
            bucket_count=len(buckets_mb(self.config)),
        )


def drive(
    session: TuningSession,
    job: SimJob,
    *,
    max_steps: int = 20_000,
    hook: Callable[[TuningSession, int], TuningSession] | None = None,
) -> tuple[TuningSession, list[Decision]]:
    """Run a session against a job to its end; ``hook`` may swap the session per step."""
    decisions: list[Decision] = []
    decision: Decision | None = session.start(
        job.now, job.config, link_bytes_per_s=job.link.bytes_per_s
    )
    for count in range(max_steps):
        while isinstance(decision, ApplyConfig):
            decisions.append(decision)
            version, effective = job.apply(decision.config)
            decision = session.on_applied(version, effective, job.now)
        if decision is not None:
            decisions.append(decision)
            return session, decisions
        if hook is not None:
            session = hook(session, count)
        decision = session.on_step(job.sample(), job.now)
    raise AssertionError("the session did not end")


def finish_of(decisions: list[Decision]) -> Finish:
    last = decisions[-1]
    assert isinstance(last, Finish), last
    return last


def random_search(space: SearchSpace, link: Link, seed: int, budget: int) -> TrialConfig:
    """The default plus budget - 1 random configs, each measured as the tuner measures
    (median of 5 windows of 10 noisy steps); the best measured wins."""
    rng = random.Random(seed)
    low, high = math.log(space.min_bucket_cap_mb), math.log(space.max_bucket_cap_mb)
    candidates = [DEFAULT] + [
        space.make_config(
            space.snap_bucket(math.exp(rng.uniform(low, high))), rng.choice(space.codecs), DEFAULT
        )
        for _ in range(budget - 1)
    ]

    def measured(config: TrialConfig) -> float:
        windows = []
        for _ in range(5):
            rates = [
                throughput(config, link) / math.exp(rng.gauss(0, link.noise)) for _ in range(10)
            ]
            windows.append(len(rates) / sum(1 / r for r in rates))
        return statistics.median(windows)

    return max(candidates, key=measured)


# -- configs and the search space ----------------------------------------------------------


def test_config_args_are_request_config_arguments_and_round_trip() -> None:
    config = TrialConfig(4, 4, "powersgd", {"rank": 2})
    assert config.args() == {
        "bucket_cap_mb": 4.0,
        "first_bucket_cap_mb": 4.0,
        "codec": "powersgd",
        "codec_params": {"rank": 2},
    }
    assert TrialConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert TrialConfig(25, 25, "int8").codec_params == {"bits": 8}  # the probe's defaults
    applied = AppliedConfig(
        version=3,
        bucket_cap_bytes=25 * 1024 * 1024,
        first_bucket_cap_bytes=1024 * 1024,
        codec="topk",
        codec_params={"ratio": 0.01},
        effective_step=40,
    )
    assert TrialConfig.from_applied(applied) == TrialConfig(25.0, 1.0, "topk", {"ratio": 0.01})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_cap_mb": 0.0, "first_bucket_cap_mb": 1.0}, "bucket_cap_mb must be between"),
        ({"bucket_cap_mb": 1, "first_bucket_cap_mb": "x"}, "first_bucket_cap_mb must be a number"),
        ({"bucket_cap_mb": 1, "first_bucket_cap_mb": 1, "codec": "zip"}, "codec must be one of"),
        (
            {
                "bucket_cap_mb": 1,
                "first_bucket_cap_mb": 1,
                "codec": "fp16",
                "codec_params": {"r": 1},
            },
            "unknown param 'r'",
        ),
        (
            {
                "bucket_cap_mb": 1,
                "first_bucket_cap_mb": 1,
                "codec": "topk",
                "codec_params": {"ratio": 2},
            },
            "'ratio' must be a number in",
        ),
        (
            {
                "bucket_cap_mb": 1,
                "first_bucket_cap_mb": 1,
                "codec": "powersgd",
                "codec_params": {"rank": 0},
            },
            "'rank' must be an integer >= 1",
        ),
    ],
)
def test_bad_configs_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TunerError, match=message):
        TrialConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(TunerError, match="invalid config"):
        TrialConfig.from_dict({"codec": "none"})


def test_codec_choices_and_bounds_are_the_catalogues() -> None:
    # The tuner proposes only what the probe accepts: both read torshmon.catalogue.
    assert (
        set(CODEC_NAMES) == set(CODEC_SPECS) == {"none", "fp16", "bf16", "powersgd", "topk", "int8"}
    )
    for choice in DEFAULT_CODECS:
        assert validate_codec(choice.codec, choice.params) == dict(choice.params)
    for name in CODEC_NAMES:
        assert CodecChoice(name).params == validate_codec(name, {})
    TrialConfig(MIN_BUCKET_CAP_MB, MAX_BUCKET_CAP_MB)
    with pytest.raises(TunerError):
        TrialConfig(MAX_BUCKET_CAP_MB * 1.01, 1)


def test_space_grid_and_dimensions() -> None:
    space = SearchSpace()
    assert space.bucket_values(1) == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
    assert space.bucket_values()[:4] == (1.0, 1.41, 2.0, 2.83)
    grid = space.grid()
    assert len(grid) == 9 * len(DEFAULT_CODECS)
    assert len(set(grid)) == len(grid)
    assert all(c.first_bucket_cap_mb == c.bucket_cap_mb for c in grid)
    assert space.snap_bucket(25.0) == 22.6
    assert set(space.dimensions()) == {"codec", "powersgd_rank", "topk_ratio", "bucket_cap_mb"}
    # A point maps to a config and back; another family's dimension is inert.
    config = space.config_for(
        {"codec": "powersgd", "powersgd_rank": 2.6, "topk_ratio": 0.003, "bucket_cap_mb": 5.0},
        DEFAULT,
    )
    assert config == TrialConfig(5.66, 5.66, "powersgd", {"rank": 2})
    params = space.params_for(config)
    assert params is not None and params["powersgd_rank"] == 2.0
    assert space.config_for(params, DEFAULT) == config
    assert space.params_for(TrialConfig(512, 512)) is None  # outside the cap range


def test_pinned_knobs_leave_the_space() -> None:
    base = TrialConfig(25.0, 1.0, "fp16")
    codec_pinned = SearchSpace(pinned=frozenset({"codec"}))
    assert set(codec_pinned.dimensions()) == {"bucket_cap_mb"}
    assert {c.codec for c in codec_pinned.grid(base)} == {"fp16"}
    bucket_pinned = SearchSpace(pinned=frozenset({"bucket_cap_mb"}))
    grid = bucket_pinned.grid(base)
    assert len(grid) == len(DEFAULT_CODECS)
    assert {(c.bucket_cap_mb, c.first_bucket_cap_mb) for c in grid} == {(25.0, 1.0)}
    with pytest.raises(TunerError, match="baseline is needed"):
        bucket_pinned.grid()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_bucket_cap_mb": 8, "max_bucket_cap_mb": 4}, "must be below"),
        ({"max_bucket_cap_mb": 10_000}, "max_bucket_cap_mb must be between"),
        ({"codecs": ()}, "at least one codec"),
        ({"codecs": (CodecChoice("fp16"), CodecChoice("fp16"))}, "must be distinct"),
        ({"pinned": frozenset({"lr"})}, "unknown pinned knob 'lr'"),
        ({"pinned": frozenset({"codec", "bucket_cap_mb"})}, "nothing to tune"),
        ({"steps_per_octave": 0}, "steps_per_octave"),
    ],
)
def test_bad_spaces_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TunerError, match=message):
        SearchSpace(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_trials": 1}, "max_trials must be >= 2, got 1"),
        ({"windows": 3, "min_windows": 4}, "must not exceed windows"),
        ({"alpha": 1.5}, "alpha must be > 0 and < 1, got 1.5"),
        ({"min_improvement": -0.1}, "min_improvement"),
        ({"max_relative_error": {"zip": 0.1}}, "codec must be one of"),
        ({"bucket_screen": (0.0,)}, "bucket_screen factor"),
        ({"apply_timeout_s": math.inf}, "apply_timeout_s"),
        ({"warmup_steps": True}, "warmup_steps"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TunerError, match=message):
        TunerSettings(**kwargs)  # type: ignore[arg-type]


def test_step_sample_from_a_wire_record() -> None:
    record = StepRecord(
        step=7,
        end_unix_ns=0,
        duration_s=0.5,
        comm_wait_s=0.1,
        compute_s=0.4,
        communication_time_ratio=0.2,
        comm_busy_s=0.1,
        samples_per_s=128.0,
        loss=1.5,
        config_version=3,
        buckets=[
            BucketStat(index=0, size_bytes=4, parameters=1, duration_s=0.1, relative_error=0.2),
            BucketStat(index=1, size_bytes=4, parameters=1, duration_s=0.1),
        ],
    )
    sample = StepSample.from_record(record)
    assert sample == StepSample(7, 3, 128.0, 0.5, 1.5, False, (0.2,), comm_wait_s=0.1)
    assert sample.communication_ratio() == pytest.approx(0.2)
    assert sample.rate() == (128.0, "samples/s per rank")
    assert StepSample(1, 0, duration_s=0.25).rate() == (4.0, "steps/s")
    assert StepSample(1, 0, samples_per_s=math.inf).rate() is None


# -- one session, event by event -----------------------------------------------------------


def _settings(**kwargs: object) -> TunerSettings:
    return TunerSettings(**kwargs)  # type: ignore[arg-type]


def test_warmup_and_other_versions_are_ignored() -> None:
    session = TuningSession(
        settings=_settings(warmup_steps=3, window_steps=2, windows=2, min_windows=2)
    )
    first = session.start(0.0, DEFAULT)
    assert isinstance(first, ApplyConfig) and first.purpose == "baseline"
    assert session.on_step(StepSample(1, 0, samples_per_s=1.0), 1.0) is None  # not applied yet
    assert session.on_applied(4, 10, 1.0) is None
    for step in (10, 11, 12):  # the warm-up: effective step + 3
        session.on_step(StepSample(step, 4, samples_per_s=1.0), 2.0)
    session.on_step(StepSample(13, 3, samples_per_s=1.0), 2.0)  # an older version
    session.on_step(StepSample(13, 4, samples_per_s=100.0), 2.0)
    session.on_step(StepSample(13, 4, samples_per_s=1.0), 2.0)  # a repeated step
    session.on_step(StepSample(14, 4, samples_per_s=100.0), 2.0)
    assert list(session.trials[0].windows) == [100.0]
    assert session.trials[0].decision is None
    session.on_step(StepSample(15, 4, duration_s=0.5, samples_per_s=50.0), 2.0)
    decision = session.on_step(StepSample(16, 4, samples_per_s=200.0), 2.0)
    # Window throughput is total samples over total time: 2 / (1/50 + 1/200) = 80.
    assert session.trials[0].windows[1:] == (80.0,)
    assert session.trials[0].decision == "kept" and session.trials[0].score == 90.0
    assert isinstance(decision, ApplyConfig) and decision.purpose == "trial"
    # Nothing told about communication: no codec, the bucket screen (8x first) starts.
    assert decision.config == TrialConfig(181.0, 181.0, "none")


def test_a_regression_is_rolled_back_at_once() -> None:
    # Told to compress whatever communication costs, on the fast link the prior's light
    # codec (int8) only costs compute: the first trial is clearly worse.
    settings = TunerSettings(compress_above=0.0)
    session, decisions = drive(TuningSession(settings=settings, seed=1), SimJob(UNSHAPED, seed=1))
    trial = session.trials[1]
    assert trial.config.codec == "int8"
    assert trial.decision == "worse"
    assert len(trial.windows) == session._s.settings.min_windows  # decided early
    assert trial.p_value is not None and trial.p_value < 0.05
    rollback = decisions[2]
    assert isinstance(rollback, ApplyConfig) and rollback.purpose == "rollback"
    assert rollback.config == DEFAULT
    assert rollback.reason.startswith("roll back: trial 1 was worse")


def test_a_codec_breaking_the_error_bound_is_rejected_and_banned() -> None:
    job = SimJob(SHAPED, seed=2, error_override={"topk(ratio=0.001)": 0.95})
    # Error-feedback codecs have no bound by default; a user may set one.
    bounds = {**DEFAULT_MAX_RELATIVE_ERROR, "topk": 0.93}
    settings = TunerSettings(max_relative_error=bounds)
    session, decisions = drive(TuningSession(settings=settings, seed=2), job)
    trial = session.trials[1]
    assert trial.config.choice.label == "topk(ratio=0.001)"
    assert trial.decision == "rejected_error"
    assert "exceeds the topk bound 0.93" in trial.reason
    assert not trial.windows  # rejected at the first sampled error, mid-window
    assert isinstance(decisions[2], ApplyConfig) and decisions[2].purpose == "rollback"
    later = [t.config.choice.label for t in session.trials[2:]]
    assert "topk(ratio=0.001)" not in later
    assert job.config.choice.label != "topk(ratio=0.001)"
    assert finish_of(decisions).changed  # the rest of the space still helps


def test_a_loss_that_degrades_after_the_switch_is_rejected() -> None:
    job = SimJob(SHAPED, seed=3, loss_factor={"topk(ratio=0.001)": 1.3})
    session, decisions = drive(TuningSession(seed=3), job)
    trial = session.trials[1]
    assert trial.decision == "rejected_loss"
    assert "loss rose from" in trial.reason
    assert len(trial.windows) == session._s.settings.min_windows
    assert isinstance(decisions[2], ApplyConfig) and decisions[2].purpose == "rollback"


def test_a_non_finite_loss_is_rejected_at_once() -> None:
    job = SimJob(SHAPED, seed=4, nan_codec="topk(ratio=0.001)")
    session, _ = drive(TuningSession(seed=4), job)
    assert session.trials[1].decision == "rejected_loss"
    assert session.trials[1].reason == "the loss became non-finite"
    assert not session.trials[1].windows


def test_the_summary_says_what_changed_and_what_it_gained() -> None:
    job = SimJob(SHAPED, seed=5, config=TrialConfig(25, 25))
    session, decisions = drive(TuningSession(seed=5), job)
    finish = finish_of(decisions)
    assert finish.changed and finish.best_score and finish.baseline_score
    gain = finish.best_score / finish.baseline_score - 1
    new = finish.best_config
    expected = (
        f"bucket 25 -> {new.bucket_cap_mb:.3g} MB, codec none -> {new.choice.label}: "
        f"{gain:+.0%} samples/s"
    )
    assert finish.summary.startswith(expected), finish.summary
    assert "loss unaffected" in finish.summary
    assert session.summary() == finish.summary
    assert job.config == new  # the job runs what the session says it runs
    verify = session.trials[-1]
    assert verify.kind == "verify" and verify.decision == "kept"


def test_refused_configs_are_failed_trials_and_end_the_search_after_three() -> None:
    session = TuningSession(settings=_settings(window_steps=2, windows=2, min_windows=2))
    session.start(0.0, DEFAULT)
    session.on_applied(1, 0, 0.0)
    decision: Decision | None = None
    for step in range(5, 9):
        decision = session.on_step(StepSample(step, 1, 10.0), 1.0)
    for _ in range(3):
        assert isinstance(decision, ApplyConfig) and decision.purpose == "trial"
        decision = session.on_rejected("bucket changes need torch 2.13", 2.0)
    # Three refusals in a row end the search; the job still runs the baseline.
    assert isinstance(decision, Finish) and not decision.changed
    assert decision.best_config == DEFAULT
    assert [t.decision for t in session.trials] == ["kept", "failed", "failed", "failed"]
    assert "3 configs in a row were refused" in decision.reason


def test_a_refused_baseline_aborts_and_a_silent_job_times_out() -> None:
    session = TuningSession()
    session.start(0.0, DEFAULT)
    abort = session.on_rejected("no live reconfiguration", 1.0)
    assert isinstance(abort, Abort) and "refused its own config" in abort.reason
    assert abort.restore_config is None and session.phase == "aborted"

    session = TuningSession(settings=_settings(apply_timeout_s=60, step_timeout_s=30))
    session.start(0.0, DEFAULT)
    assert session.deadline_unix_s == 60.0
    assert session.on_timeout(59.0) is None
    session.on_applied(1, 0, 10.0)
    assert session.deadline_unix_s == 40.0
    timeout = session.on_timeout(41.0)
    assert isinstance(timeout, Abort) and "no step for 30 s" in timeout.reason
    assert session.trials[0].decision == "failed"


def test_converges_early_in_a_small_space() -> None:
    space = SearchSpace(
        min_bucket_cap_mb=16,
        max_bucket_cap_mb=32,
        steps_per_octave=1,
        codecs=(CodecChoice("none"), CodecChoice("fp16")),
    )
    session, decisions = drive(TuningSession(space, seed=6), SimJob(SHAPED, seed=6))
    # Four configs exist; the baseline (25/1) is a fifth: then only repeats are proposed.
    assert sum(1 for t in session.trials if t.kind != "verify") <= 5
    assert "converged" in finish_of(decisions).reason


def test_pinned_codec_is_never_changed() -> None:
    space = SearchSpace(pinned=frozenset({"codec"}))
    job = SimJob(SHAPED, seed=7, config=TrialConfig(25, 1, "fp16"))
    _, decisions = drive(TuningSession(space, seed=7), job)
    assert {c.codec for c in job.applied} == {"fp16"}
    assert len({c.bucket_cap_mb for c in job.applied}) > 2
    assert finish_of(decisions).best_config.codec == "fp16"


# -- the protocol: never two configs in flight ---------------------------------------------

_EVENTS = st.lists(
    st.sampled_from(["step"] * 8 + ["old_step", "applied", "applied", "rejected", "timeout"]),
    min_size=50,
    max_size=400,
)


@settings(max_examples=40, deadline=None)
@given(events=_EVENTS, seed=st.integers(0, 2**16))
def test_never_two_configs_in_flight(events: list[str], seed: int) -> None:
    session = TuningSession(
        settings=_settings(
            max_trials=5,
            warmup_steps=0,
            window_steps=1,
            windows=2,
            min_windows=2,
            apply_timeout_s=5,
        ),
        seed=seed,
    )
    rng = random.Random(seed)
    version, measuring = 0, 0
    first = session.start(0.0, DEFAULT)
    awaiting = isinstance(first, ApplyConfig)  # an ApplyConfig awaits its acknowledgement
    for step, event in enumerate(events, start=1):
        if session.done:
            break
        now = float(step)
        consumed = False  # did this call acknowledge the config in flight?
        if event == "applied":
            version += 1
            decision = session.on_applied(version, step, now)
            consumed, measuring = awaiting, version if awaiting else measuring
        elif event == "rejected":
            decision = session.on_rejected("refused", now)
            consumed = awaiting
        elif event == "timeout":
            deadline = session.deadline_unix_s
            at = now + rng.choice([0.0, 10.0])
            decision = session.on_timeout(at)
            consumed = awaiting and deadline is not None and at >= deadline
        else:
            v = measuring if event == "step" else max(0, measuring - 1)
            sample = StepSample(step, v, samples_per_s=rng.uniform(90, 110), loss=1.0)
            decision = session.on_step(sample, now)
        if awaiting and not consumed:
            assert decision is None, (event, decision)
        if event in ("applied", "rejected") and not awaiting:
            assert decision is None, (event, decision)
        if consumed or isinstance(decision, ApplyConfig):
            awaiting = isinstance(decision, ApplyConfig)
        assert (session.phase == "applying") == awaiting, (event, session.phase)


# -- persistence ---------------------------------------------------------------------------


def _round_trip(session: TuningSession) -> TuningSession:
    blob = json.dumps(session.to_state(), allow_nan=False)  # what SQL JSON columns store
    return TuningSession.from_state(json.loads(blob))


def test_state_round_trip_mid_session_gives_the_same_decisions() -> None:
    reference, expected = drive(TuningSession(seed=8), SimJob(SHAPED, seed=8))

    def restart(session: TuningSession, count: int) -> TuningSession:
        return _round_trip(session) if count % 37 == 0 else session

    restored, decisions = drive(TuningSession(seed=8), SimJob(SHAPED, seed=8), hook=restart)
    assert decisions == expected
    assert restored.trials == reference.trials
    assert restored.to_state() == reference.to_state()


def test_a_restored_session_resumes_or_ends_cleanly() -> None:
    session = TuningSession(settings=_settings(apply_timeout_s=60))
    pending = session.start(0.0, DEFAULT)
    # The aggregator restarts while the baseline awaits its acknowledgement.
    restored = _round_trip(session)
    assert restored.pending == ApplyConfig(DEFAULT, "awaiting acknowledgement", "baseline", 0)
    assert isinstance(pending, ApplyConfig)
    restored.resume(500.0)
    assert restored.deadline_unix_s == 560.0
    assert restored.on_timeout(100.0) is None  # the old deadline no longer counts
    assert restored.on_applied(1, 10, 501.0) is None
    assert restored.phase == "measuring"
    # A later restart after the job went away ends it cleanly through the timeout.
    again = _round_trip(restored)
    again.resume(600.0)
    abort = again.on_timeout(600.0 + again._s.settings.step_timeout_s)
    assert isinstance(abort, Abort) and again.done
    with pytest.raises(TunerError, match="version"):
        TuningSession.from_state({**again.to_state(), "v": 99})
    with pytest.raises(TunerError, match="invalid tuner state"):
        TuningSession.from_state({**again.to_state(), "phase": "dancing"})


# -- the targets ---------------------------------------------------------------------------

SEEDS = range(8)


def test_shaped_link_reaches_95_percent_of_the_grid_in_8_trials_and_beats_random_search() -> None:
    # Random search is a session too (proposer="random"): the same baseline, windows,
    # tests, verification and trial budget; only where its proposals come from differs.
    space = SearchSpace()
    best = max(throughput(c, SHAPED) for c in space.grid(DEFAULT))
    tuned: list[float] = []
    blind: list[float] = []
    randomised: list[float] = []
    for seed in SEEDS:
        for tuner, out in (
            (TunerSettings(max_trials=8), tuned),
            (TunerSettings(max_trials=8, prior=False), blind),
            (TunerSettings(max_trials=8, proposer="random"), randomised),
        ):
            session, decisions = drive(
                TuningSession(space, tuner, seed=seed), SimJob(SHAPED, seed=seed)
            )
            assert sum(1 for t in session.trials if t.kind != "verify") <= 8
            out.append(throughput(finish_of(decisions).best_config, SHAPED) / best)
    assert min(tuned) >= 0.95, tuned
    assert statistics.mean(tuned) > statistics.mean(randomised), (tuned, randomised)
    assert statistics.mean(tuned) >= statistics.mean(blind), (tuned, blind)
    assert throughput(DEFAULT, SHAPED) / best < 0.5  # the model gives the tuner work to do


def test_unshaped_link_is_left_alone() -> None:
    space = SearchSpace()
    default = throughput(DEFAULT, UNSHAPED)
    assert max(throughput(c, UNSHAPED) for c in space.grid(DEFAULT)) < default * 1.01
    for seed in SEEDS:
        job = SimJob(UNSHAPED, seed=seed)
        session, decisions = drive(TuningSession(space, seed=seed), job)
        finish = finish_of(decisions)
        assert throughput(finish.best_config, UNSHAPED) >= 0.98 * default
        assert job.config == finish.best_config
        assert not finish.changed and finish.best_config == DEFAULT
        assert "left unchanged" in finish.summary
        # One count of trials, the one max_trials limits (issue 18: "all 3 trials; 2 trials").
        measured = [t for t in session.trials if t.kind != "verify" and t.decision != "failed"]
        assert finish.summary.endswith(f"; {len(measured)} trials done, the baseline included")
        if "trial limit" in finish.summary:
            limit = session._s.settings.max_trials
            assert f"the trial limit ({limit}) reached" in finish.summary
            assert len(measured) == limit


# -- re-tuning on drift ---------------------------------------------------------------------

DRIFT = RetuneSettings(window_steps=4, windows=5, threshold=0.15, alpha=0.01, for_s=60.0,
                       min_interval_s=600.0)  # fmt: skip
REFERENCE = (1000.0, 1010.0, 990.0, 1005.0, 995.0)


def _feed(
    watch: DriftWatch, speeds: list[float], start_s: float, step_s: float = 1.0, version: int = 3
) -> list[tuple[float, str]]:
    """One step per ``step_s`` of the fake clock; (now, reason) of every re-tune verdict."""
    verdicts = []
    for i, speed in enumerate(speeds):
        now = start_s + i * step_s
        why = watch.observe(StepSample(i, version, samples_per_s=speed), now)
        if why is not None:
            verdicts.append((now, why))
    return verdicts


def test_drift_watch_fires_only_after_sustained_significant_drift() -> None:
    rng = random.Random(3)
    watch = DriftWatch(REFERENCE, "samples/s per rank", ended_unix_s=0.0, settings=DRIFT)
    # At speed (noise only): never, however long.
    assert _feed(watch, [1000 * rng.uniform(0.97, 1.03) for _ in range(400)], 700.0) == []
    assert watch.drifting_since is None
    # 30 % slower: drifting from the first full set of slow windows, re-tune after for_s.
    slow = [700 * rng.uniform(0.97, 1.03) for _ in range(200)]
    verdicts = _feed(watch, slow, 1100.0)
    assert verdicts, "a sustained 30 % drop must trigger"
    first_at, why = verdicts[0]
    assert watch.drifting_since is not None
    assert first_at - watch.drifting_since >= DRIFT.for_s
    assert first_at < 1100.0 + 20 + DRIFT.for_s + 2 * DRIFT.window_steps
    assert "drifted -30%" in why and "samples/s" in why


def test_drift_watch_ignores_small_or_brief_drops_and_respects_the_rate_limit() -> None:
    rng = random.Random(4)
    # 10 % slower is below the 15 % threshold: never.
    small = DriftWatch(REFERENCE, "samples/s per rank", ended_unix_s=0.0, settings=DRIFT)
    assert _feed(small, [900 * rng.uniform(0.99, 1.01) for _ in range(400)], 700.0) == []
    # A 40 s dip (shorter than for_s) then back to speed: the clock restarts, no verdict.
    brief = DriftWatch(REFERENCE, "samples/s per rank", ended_unix_s=0.0, settings=DRIFT)
    dip = [600.0] * 40 + [1000.0] * 40 + [600.0] * 40 + [1000.0] * 40
    assert _feed(brief, dip, 700.0) == []
    # Sustained drift right after the session ended: held back until min_interval_s.
    early = DriftWatch(REFERENCE, "samples/s per rank", ended_unix_s=100.0, settings=DRIFT)
    verdicts = _feed(early, [600.0] * 800, 110.0)
    assert verdicts and verdicts[0][0] >= 100.0 + DRIFT.min_interval_s


def test_drift_watch_stops_when_the_config_changes() -> None:
    watch = DriftWatch(REFERENCE, "samples/s per rank", ended_unix_s=0.0, settings=DRIFT)
    assert _feed(watch, [600.0] * 10, 1000.0, version=3) == []
    assert _feed(watch, [600.0] * 500, 1010.0, version=4) == []
    assert watch.stopped


def test_retune_settings_name_bad_values() -> None:
    with pytest.raises(TunerError, match=r"^threshold must be > 0 and < 1, got 1\.5$"):
        RetuneSettings(threshold=1.5)
    with pytest.raises(TunerError, match=r"^windows must be >= 2, got 1$"):
        RetuneSettings(windows=1)
    with pytest.raises(TunerError, match=r"^for_s must be a finite number, got inf$"):
        RetuneSettings(for_s=math.inf)
    with pytest.raises(TunerError, match="reference windows"):
        DriftWatch([1.0], "samples/s per rank", 0.0)
