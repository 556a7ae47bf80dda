"""The autotune benchmark's protocol and scoring helpers (benchmarks/autotune.py), without
running a job: the turn driver against a scripted rank 0, break-even, fractions, alerts."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.benchmark_loader import load_benchmark
from torshmon.aggregator.core.tuner import (
    SearchSpace,
    StepSample,
    TrialConfig,
    TunerSettings,
    TuningSession,
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("autotune.py", "autotune_bench")


def test_break_even_counts_the_steps_that_win_back_the_trials(bench: ModuleType) -> None:
    # 100 steps took 30 s where the default would take 20 s; each tuned step saves 0.04 s.
    assert bench.break_even_steps(100, 30.0, 0.2, 0.16) == 250
    assert bench.break_even_steps(100, 19.0, 0.2, 0.16) == 0  # the trials were faster
    assert bench.break_even_steps(100, 30.0, 0.2, 0.2) is None  # never pays back
    assert bench.break_even_steps(100, 30.0, 0.2, 0.25) is None


class ScriptedRank0:
    """Answers the controller's actions as rank 0's loop does: a version per switch,
    then steps whose duration depends on the config in force."""

    def __init__(self, bench: ModuleType, seconds: dict[str, float]) -> None:
        self.bench = bench
        self.seconds = seconds
        self.version = 0
        self.step = 0
        self.config = "none"
        self.pending: str | None = None
        self.switches: list[str] = []

    def run(self, gen: Any) -> Any:
        action = next(gen)
        try:
            while True:
                action = gen.send(self.answer(action))
        except StopIteration as done:
            return done.value

    def answer(self, action: Any) -> Any:
        if hasattr(action, "config"):
            self.version += 1
            self.pending = action.config.choice.label
            self.switches.append(action.config.describe())
            return self.version
        version = self.version - (self.pending is not None)
        self.step += 1
        stepped = self.bench.Stepped(self.step, version, self.seconds[self.config], 1.0)
        if self.pending is not None:  # applied at the end of this step
            self.config, self.pending = self.pending, None
        return stepped


def test_turns_measure_one_config_each_and_rollbacks_cost_no_steps(bench: ModuleType) -> None:
    settings = TunerSettings(
        max_trials=3, warmup_steps=1, window_steps=2, windows=2, min_windows=2, prior=False
    )
    seconds = {c.label: 0.4 for c in SearchSpace().codecs} | {"none": 0.2}
    rank0 = ScriptedRank0(bench, seconds)
    runs = [
        bench.SessionRun(name, TuningSession(settings=settings, seed=seed))
        for name, seed in (("a", 1), ("b", 2))
    ]
    for run in runs:
        run.pending = run.session.start(0.0, TrialConfig(25.0, 1.0), link_bytes_per_s=1e8)

    def interleaved() -> Any:
        order = []
        while any(not r.session.done for r in runs):
            for run in runs:
                if not run.session.done:
                    before = len(rank0.switches)
                    yield from bench.turn(run, 0.1)
                    order.append((run.name, len(rank0.switches) - before))
        return order

    order = rank0.run(interleaved())
    assert [name for name, _ in order[:4]] == ["a", "b", "a", "b"]  # they take turns
    assert all(switches <= 1 for _, switches in order)  # one measured config per turn
    for run in runs:
        assert run.session.done
        # Each measured config: its switch step, 1 warm-up step, 2 windows of 2 steps.
        measured = [t for t in run.session.trials if t.windows]
        assert run.steps == sum(1 + 1 + 2 * len(t.windows) for t in measured)
        # Its own steps' seconds only: each at 0.2 s (none) or 0.4 s (a codec).
        assert 0.2 * run.steps <= run.seconds <= 0.4 * run.steps
        assert run.seconds > 0.2 * run.steps  # a codec was tried, and its steps counted


def test_fractions_come_from_the_final_rounds_only(bench: ModuleType) -> None:
    grid = [TrialConfig(4.0, 4.0, "fp16").to_dict(), TrialConfig(16.0, 16.0, "int8").to_dict()]
    tuned = TrialConfig(8.0, 8.0, "fp16").to_dict()
    job = {
        "grid": grid,
        "finalists": [bench.TORCH_DEFAULT.to_dict(), *grid, tuned],
        "final_s": [0.4, 0.21, 0.2, 0.25],  # the grid pass may have ranked them otherwise
    }
    assert bench.fraction(job, tuned) == pytest.approx(0.2 / 0.25)
    assert bench.fraction(job, grid[1]) == 1.0
    with pytest.raises(KeyError, match="not a finalist"):
        bench.seconds_of(job, TrialConfig(1.0, 1.0).to_dict())


def test_session_alerts_are_those_fired_while_the_session_ran(bench: ModuleType) -> None:
    session = TuningSession(
        settings=TunerSettings(warmup_steps=0, window_steps=1, windows=2, min_windows=2)
    )
    session.start(100.0, TrialConfig(25.0, 1.0))
    session.on_applied(1, 0, 100.0)
    session.on_step(StepSample(0, 1, 10.0), 110.0)
    session.on_step(StepSample(1, 1, 10.0), 120.0)
    session.abort("test", 130.0)
    alerts = [
        {"rule": "Step Time Anomaly", "rank": 1, "fired_at_unix_s": 115.0},
        {"rule": "Straggler", "rank": None, "fired_at_unix_s": 90.0},  # before the session
        {"rule": "Autotune Finished", "rank": None, "fired_at_unix_s": 130.0},  # its own note
        {"rule": "Straggler", "rank": 0, "fired_at_unix_s": None},  # pending, never fired
    ]
    run = bench.RealRun(session, alerts, 30.0)
    assert bench.session_alerts(run) == ["Step Time Anomaly (rank 1)"]
