"""The tuner's prior: what the job tells (link, communication, buckets, loss) -> first proposals."""

from __future__ import annotations

import msgspec
import pytest

from torshmon.aggregator.core.tuner import (
    ApplyConfig,
    CodecChoice,
    SearchSpace,
    StepSample,
    TrialConfig,
    TunerSettings,
    TuningSession,
)
from torshmon.aggregator.core.tuner.config import TunerError
from torshmon.aggregator.core.tuner.prior import (
    GBIT,
    Evidence,
    bucket_factors,
    first_proposals,
    slowest_link,
    spread,
)

DEFAULT = TrialConfig(25.0, 1.0)
SPACE = SearchSpace()


def labels(evidence: Evidence, space: SearchSpace = SPACE, count: int = 2) -> list[str]:
    configs = first_proposals(
        space, DEFAULT, evidence, count=count, compress_above=0.4, steady_loss_spread=0.1
    )
    return [c.choice.label for c in configs]


@pytest.mark.parametrize(
    ("gbit", "expected"),
    [
        (0.95, ["topk(ratio=0.001)", "powersgd(rank=1)"]),
        (9.9, ["topk(ratio=0.001)", "powersgd(rank=1)"]),
        (10.0, ["topk(ratio=0.01)", "powersgd(rank=4)"]),
        (24.9, ["topk(ratio=0.01)", "powersgd(rank=4)"]),
        (25.0, ["int8", "fp16"]),
        (100.0, ["int8", "fp16"]),
    ],
)
def test_the_link_bandwidth_picks_the_compression_strength(
    gbit: float, expected: list[str]
) -> None:
    assert labels(Evidence(link_bytes_per_s=gbit * GBIT, communication_ratio=0.7)) == expected


def test_no_compression_unless_communication_dominates() -> None:
    slow = 1 * GBIT
    assert labels(Evidence(link_bytes_per_s=slow, communication_ratio=0.39)) == []
    assert labels(Evidence(link_bytes_per_s=slow)) == []  # communication not reported
    assert labels(Evidence(link_bytes_per_s=slow, communication_ratio=0.4)) != []


def test_an_unmeasured_link_takes_the_middle_class_and_an_unsteady_loss_a_lighter_one() -> None:
    assert labels(Evidence(communication_ratio=0.8)) == ["topk(ratio=0.01)", "powersgd(rank=4)"]
    unsteady = Evidence(link_bytes_per_s=1 * GBIT, communication_ratio=0.8, loss_spread=0.3)
    assert labels(unsteady) == ["topk(ratio=0.01)", "powersgd(rank=4)"]
    fast = Evidence(link_bytes_per_s=40 * GBIT, communication_ratio=0.8, loss_spread=0.3)
    assert labels(fast) == ["int8", "fp16"]  # already the lightest


def test_proposals_are_at_the_jobs_own_cap_within_the_space_and_the_count() -> None:
    evidence = Evidence(link_bytes_per_s=1 * GBIT, communication_ratio=0.8)
    configs = first_proposals(
        SPACE, DEFAULT, evidence, count=1, compress_above=0.4, steady_loss_spread=0.1
    )
    assert configs == [TrialConfig(22.6, 22.6, "topk", {"ratio": 0.001})]
    only = SearchSpace(codecs=(CodecChoice("none"), CodecChoice("powersgd", {"rank": 1})))
    assert labels(evidence, only) == ["powersgd(rank=1)"]
    pinned = SearchSpace(pinned=frozenset({"codec"}))
    assert labels(evidence, pinned) == []


def test_the_bucket_count_orders_the_bucket_screen() -> None:
    assert bucket_factors((0.125, 8.0), Evidence(bucket_count=2)) == [0.125, 8.0]
    assert bucket_factors((0.125, 8.0), Evidence(bucket_count=12)) == [8.0, 0.125]
    assert bucket_factors((0.125, 8.0), Evidence()) == [8.0, 0.125]


def test_reading_helpers() -> None:
    assert spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert spread([1.0]) is None and spread([0.0, 0.0]) is None
    reading = {"bandwidth_by_rank": {"0": 1e9, "1": 2.5e8, "2": 1e9}}
    assert slowest_link(reading) == 2.5e8
    nodes = {**reading, "nodes": {"bandwidth_by_node": {"a": 5e8, "b": 4e8}}}
    assert slowest_link(nodes) == 4e8
    assert slowest_link(None) is None and slowest_link({"bandwidth_by_rank": {}}) is None
    assert "link 0.95 Gbit/s" in Evidence(link_bytes_per_s=0.95 * GBIT).describe()
    assert Evidence().describe() == "nothing measured"


def _baseline(session: TuningSession, comm_wait_s: float, losses: list[float]) -> ApplyConfig:
    """Measure the baseline (2 windows of 2 steps at 0.5 s), return the first proposal."""
    assert isinstance(session.start(0.0, DEFAULT, link_bytes_per_s=0.12e9), ApplyConfig)
    session.on_applied(1, 0, 0.0)
    decision = None
    for step, loss in enumerate(losses):
        sample = StepSample(step, 1, 128.0, 0.5, loss=loss, comm_wait_s=comm_wait_s, bucket_count=3)
        decision = session.on_step(sample, 1.0)
    assert isinstance(decision, ApplyConfig) and decision.purpose == "trial"
    return decision


def test_a_session_reads_its_evidence_from_the_baseline_and_the_link_check() -> None:
    settings = TunerSettings(warmup_steps=0, window_steps=2, windows=2, min_windows=2)
    session = TuningSession(settings=settings)
    first = _baseline(session, 0.35, [1.0, 1.0, 1.0, 1.0])
    assert session.evidence() == Evidence(0.12e9, 0.7, 3, 0.0)
    assert first.reason.endswith(
        "(the job told: link 0.96 Gbit/s, communication 0.70 of the step, 3 buckets, loss spread 0)"
    )
    assert first.config == TrialConfig(22.6, 22.6, "topk", {"ratio": 0.001})
    # Communication a small share of the step: no codec, the bucket screen starts.
    quiet = TuningSession(settings=settings)
    assert _baseline(quiet, 0.05, [1.0] * 4).config.codec == "none"
    # An unsteady loss: one class lighter.
    noisy = TuningSession(settings=settings)
    assert _baseline(noisy, 0.35, [1.0, 1.0, 1.5, 1.5]).config.choice.label == "topk(ratio=0.01)"
    # Without the prior, the same evidence proposes no codec first.
    blind = TuningSession(settings=msgspec.structs.replace(settings, prior=False))
    assert _baseline(blind, 0.35, [1.0] * 4).config.codec == "none"


def test_a_link_reading_that_comes_during_the_baseline_reaches_the_prior() -> None:
    """A session begun before the job's first link check (it ends the warm-up) takes the
    reading that comes while the baseline is measured; after the baseline the prior has
    read its evidence and a later reading changes nothing."""
    settings = TunerSettings(warmup_steps=0, window_steps=2, windows=2, min_windows=2)
    session = TuningSession(settings=settings)
    assert isinstance(session.start(0.0, DEFAULT), ApplyConfig)
    assert session.wants_link
    session.observe_link(None)  # no reading yet
    session.observe_link(-1.0)  # not a bandwidth
    assert session.evidence().link_bytes_per_s is None
    session.on_applied(1, 0, 0.0)
    decision = None
    for step in range(4):
        if step == 2:
            session.observe_link(3e9)  # 24 Gbit/s: the middle class
        sample = StepSample(step, 1, 128.0, 0.5, loss=1.0, comm_wait_s=0.35, bucket_count=3)
        decision = session.on_step(sample, 1.0)
    assert isinstance(decision, ApplyConfig)
    assert decision.config.choice.label == "topk(ratio=0.01)"
    assert "link 24 Gbit/s" in decision.reason
    assert not session.wants_link
    session.observe_link(0.12e9)
    assert session.evidence().link_bytes_per_s == 3e9


def test_random_search_proposes_distinct_grid_configs_without_screens() -> None:
    settings = TunerSettings(
        warmup_steps=0, window_steps=2, windows=2, min_windows=2, proposer="random"
    )
    first = _baseline(TuningSession(settings=settings, seed=3), 0.35, [1.0] * 4)
    again = _baseline(TuningSession(settings=settings, seed=3), 0.35, [1.0] * 4)
    assert first.config == again.config  # a function of the seed and the history
    assert first.config in SPACE.grid(DEFAULT, steps_per_octave=SPACE.steps_per_octave)
    with pytest.raises(TunerError, match="proposer"):
        TunerSettings(proposer="grid")  # type: ignore[arg-type]
    with pytest.raises(TunerError, match="link_bytes_per_s"):
        TuningSession().start(0.0, DEFAULT, link_bytes_per_s=0.0)
