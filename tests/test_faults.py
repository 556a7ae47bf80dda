"""Fault specs and what the runner does inside a rank's loop (torch tensors, no job)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from torshmon.faults import KINDS, Fault, FaultError, FaultRunner, parse_fault


def test_every_kind_parses_with_its_defaults() -> None:
    assert set(KINDS) == {
        "straggler",
        "slow-input",
        "regression",
        "hang",
        "memory-leak",
        "loss-spike",
        "slow-link",
    }
    assert parse_fault("straggler") == Fault("straggler", 1, 20, None, 0.5)
    assert parse_fault("slow-input:rank=2,slowdown=1") == Fault("slow-input", 2, 20, None, 1.0)
    assert parse_fault("regression:slowdown=1,from=30,to=40") == Fault(
        "regression", None, 30, 40, 1.0
    )
    assert parse_fault("hang:rank=0,from=5") == Fault("hang", 0, 5, 6, 8.0)
    assert parse_fault("memory-leak:mb=2.5") == Fault("memory-leak", 1, 20, None, 2.5)
    spike = parse_fault("loss-spike:rank=0,from=10,nan=1")
    assert (spike.stop_step, spike.nan, spike.amount) == (15, True, 10.0)
    link = parse_fault("slow-link:rank=2,rate=1gbit,from=30,to=90")
    assert (link.rank, link.rate, link.start_step, link.stop_step) == (2, "1gbit", 30, 90)


def test_describe_names_kind_rank_and_steps() -> None:
    assert parse_fault("hang:rank=1,from=50,seconds=3").describe() == (
        "hang: rank 1 stops for 3 s before a collective from step 50"
    )
    assert parse_fault("regression:from=7,to=9").describe() == (
        "regression: every rank computes 1.5x slower from step 7 until step 9"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("meteor", "unknown fault kind 'meteor'"),
        ("hang:slowdown=2", "unknown parameter 'slowdown' for hang; allowed: from, rank, seconds"),
        ("straggler:rank", "expected key=value"),
        ("straggler:rank=one", "rank must be an integer"),
        ("straggler:rank=-1", "rank must be >= 0"),
        ("straggler:from=0", "from must be >= 1"),
        ("straggler:from=10,to=10", "'to' (10) must be after 'from' (10)"),
        ("straggler:slowdown=0", "slowdown must be > 0"),
        ("memory-leak:mb=nan", "mb must be a finite number"),
        ("loss-spike:nan=2", "nan must be 0 or 1"),
        ("slow-link:rate=fast", "rate in 'slow-link:rate=fast'"),
        ("regression:rank=1", "unknown parameter 'rank' for regression"),
    ],
)
def test_bad_specs_name_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(FaultError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_fault(spec)


def _loop(runner: FaultRunner, steps: int, compute_s: float = 0.0) -> None:
    for step in range(1, steps + 1):
        runner.begin_step(step)
        if compute_s:
            time.sleep(compute_s)
        runner.end_compute(step)


def test_a_straggler_sleeps_its_own_compute_times_the_slowdown_only_on_its_rank() -> None:
    fault = parse_fault("straggler:rank=1,slowdown=2,from=6,to=8")
    other = FaultRunner(0, (fault,))
    runner = FaultRunner(1, (fault,))
    _loop(runner, 5, compute_s=0.005)
    started = time.perf_counter()
    runner.begin_step(6)
    runner.end_compute(6)
    assert time.perf_counter() - started >= 2 * 0.005
    _loop(other, 7)
    assert other.events == {}
    assert runner.events["fault0_onset_step"] == 6.0
    runner.begin_step(8)
    runner.end_compute(8)
    assert runner.events["fault0_end_unix_s"] >= runner.events["fault0_onset_unix_s"]


def test_a_regression_stretches_the_step_not_the_pause_between_steps() -> None:
    fault = parse_fault("regression:slowdown=1,from=6")
    runners = [FaultRunner(rank, (fault,)) for rank in range(2)]
    for runner in runners:
        for step in range(1, 6):
            runner.begin_step(step)
            time.sleep(0.004)  # the step's own work
            runner.end_compute(step)
            time.sleep(0.05)  # a harness's pause between steps: not part of the step
        # every rank's normal step is its in-step time, whatever the pause after it
        assert 0.004 <= runner.normal_step_s(0.0) < 0.05
        started = time.perf_counter()
        runner.begin_step(6)
        runner.end_compute(6)
        assert time.perf_counter() - started >= 0.004
        assert runner.events["fault0_onset_step"] == 6.0
        assert runner.normal_step_s(0.0) < 0.05  # a faulty step is not a normal one


def test_a_hang_stops_the_rank_once_before_its_step() -> None:
    runner = FaultRunner(1, (parse_fault("hang:rank=1,from=3,seconds=0.2"),))
    started = time.perf_counter()
    _loop(runner, 5)
    assert time.perf_counter() - started >= 0.2
    assert runner.events["fault0_end_unix_s"] - runner.events["fault0_onset_unix_s"] >= 0.2


def test_a_memory_leak_keeps_written_tensors_until_it_stops() -> None:
    runner = FaultRunner(1, (parse_fault("memory-leak:rank=1,from=2,to=5,mb=1"),))
    _loop(runner, 4)
    assert runner.leaked_bytes == 3 * 1_000_000
    assert all(t[0].item() == 1.0 for t in runner._leaked[0])
    _loop(runner, 5)  # step 5: the leak stops and the tensors go
    assert runner.leaked_bytes == 0


def test_a_second_leak_grows_after_the_first_one_ended() -> None:
    # Two leaks in one job (the detection benchmark's sweep): the first one's end frees
    # only its own tensors, every step, while the second keeps growing.
    leaks = ("memory-leak:rank=1,from=2,to=4,mb=1", "memory-leak:rank=1,from=6,to=10,mb=2")
    runner = FaultRunner(1, tuple(parse_fault(s) for s in leaks))
    held = []
    for step in range(1, 11):
        runner.begin_step(step)
        runner.end_compute(step)
        held.append(runner.leaked_bytes // 1_000_000)
    assert held == [0, 1, 2, 0, 0, 2, 4, 6, 8, 0]


def test_a_loss_spike_corrupts_only_its_rank_and_its_steps() -> None:
    x, y = torch.ones(2, 3), torch.ones(2, 3)
    runner = FaultRunner(1, (parse_fault("loss-spike:rank=1,from=4,to=6,factor=10"),))
    assert runner.batch(3, x, y)[1] is y
    assert torch.equal(runner.batch(4, x, y)[1], y * 10)
    assert runner.batch(6, x, y)[1] is y
    assert torch.equal(FaultRunner(0, runner.faults).batch(4, x, y)[1], y)
    nan = FaultRunner(1, (parse_fault("loss-spike:rank=1,from=4,nan=1"),))
    corrupted, _ = nan.batch(4, x, y)
    assert math.isnan(corrupted[0, 0].item()) and x[0, 0].item() == 1.0


def test_a_slow_link_leaves_signal_files_for_the_launcher(tmp_path: Path) -> None:
    signal_dir = tmp_path
    runner = FaultRunner(
        1, (parse_fault("slow-link:rank=1,from=3,to=5"),), signal_dir=str(signal_dir)
    )
    for step in range(1, 7):
        runner.begin_step(step)
        expected = {"fault0.on"} if 3 <= step < 5 else set()
        if step >= 5:
            expected = {"fault0.on", "fault0.off"}
        assert {p.name for p in signal_dir.iterdir()} == expected, step


def test_the_normal_step_is_the_latest_fault_free_steps_not_the_first() -> None:
    # A job whose steps got slower since it started (start-up, or a sweep's earlier
    # episodes): a straggler later in the job stretches today's step, not the first ones.
    runner = FaultRunner(1, (parse_fault("straggler:rank=1,slowdown=1,from=200"),))
    _loop(runner, 50)  # fast steps
    for step in range(51, 101):
        runner.begin_step(step)
        time.sleep(0.01)
        runner.end_compute(step)
    assert runner.normal_step_s(0.0) >= 0.01


_LEAK_ENDS = """
import os
import sys

import torch

from torshmon import faults
from torshmon.faults import FaultRunner, parse_fault

if sys.argv[1] == "without-trim":
    faults._return_freed_memory = lambda: None
page = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page


# 60 KB tensors come from glibc's heap (under its mmap threshold), each followed by
# memory the job keeps, so freeing them leaves holes that stay resident.
runner = FaultRunner(0, (parse_fault("memory-leak:rank=0,from=1,to=1001,mb=0.06"),))
keep = []
for step in range(1, 1001):
    runner.begin_step(step)
    runner.end_compute(step)
    keep.append(torch.ones(1000))
held = runner.leaked_bytes
before = rss()
runner.begin_step(1001)
runner.end_compute(1001)
print(held, before - rss())
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_leak_that_ends_hands_its_pages_back_so_the_next_one_shows_in_rss() -> None:
    # Seed 57's sweep: after earlier leaks had ended, a 4 MB-a-step leak left RSS flat for
    # its first 5 s, glibc handing it the earlier leaks' freed, still resident pages.
    import subprocess
    import sys

    def released(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _LEAK_ENDS, mode],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        held, freed = (int(x) for x in out.stdout.split())
        assert held == 60_000_000
        return freed / held

    assert released("with-trim") > 0.8
    assert released("without-trim") < 0.2  # what a later leak would have reused unseen


def test_a_slow_input_waits_before_the_step_not_inside_it() -> None:
    """A slow data loader: the rank waits ``slowdown`` x its normal step time before the
    step (where the loop fetches its batch), and its steps themselves are not slower."""
    runner = FaultRunner(1, (parse_fault("slow-input:rank=1,slowdown=1,from=6"),))
    waits = []
    for step in range(1, 9):
        started = time.perf_counter()
        runner.before_step(step)
        waits.append(time.perf_counter() - started)
        runner.begin_step(step)
        time.sleep(0.02)
        runner.end_compute(step)
    assert max(waits[:5]) < 0.005
    assert all(0.018 < w < 0.06 for w in waits[5:])
    assert runner.events["fault0_onset_step"] == 6.0
    other = FaultRunner(0, runner.faults)
    started = time.perf_counter()
    other.before_step(7)
    assert time.perf_counter() - started < 0.005
