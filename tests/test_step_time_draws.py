"""Step Time Anomaly's rates over many random draws (tests/step_time_draws.py): slowness
of a few steps may be shown, never paged; a lasting regression pages soon.

Each scenario runs the pure ``StepTimeDetector`` (the default ``zscore:`` settings) over
200 seeds (``TEST_SEEDS``, 62000-62199). ``pytest -s`` prints the rates;
``python -m tests.step_time_draws`` prints the table docs/detectors/zscore.md holds,
which the last test checks against the rates measured here.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from tests.step_time_draws import TEST_SEEDS, Rates, measure, rates_table, scenarios
from torshmon.aggregator.core.zscore import ZScoreSettings

DOC = Path(__file__).resolve().parents[1] / "docs" / "detectors" / "zscore.md"
SCENARIOS = {s.name: s for s in scenarios()}
DEFAULTS = ZScoreSettings()


@functools.cache
def _rates(name: str) -> Rates:
    rates = measure(SCENARIOS[name], TEST_SEEDS, None)
    print(f"{name}: {rates}")  # the rates, for the log of the run (pytest -s or -rA)
    return rates


def _names(prefix: str) -> list[str]:
    return [name for name in SCENARIOS if name.startswith(prefix)]


def page_by(period_s: float) -> int:
    """Steps from a regression's onset by which it should have paged: twice the
    persistence (``step_page_steps`` steps, or as many as span ``step_page_min_s``),
    for the steps a host burst's CPU wait accounts for (they are not counted) and those
    back in band: 64 steps at 0.08-0.13 s, 68 at 0.03 s."""
    return 2 * max(DEFAULTS.step_page_steps, math.ceil(DEFAULTS.step_page_min_s / period_s))


def test_the_draws_are_those_the_settings_were_chosen_for() -> None:
    assert (DEFAULTS.step_page_steps, DEFAULTS.step_page_min_s) == (32, 1.0)
    assert len(TEST_SEEDS) >= 200


@pytest.mark.parametrize("name", _names("clean"))
def test_clean_jobs_page_in_at_most_1_percent_of_draws(name: str) -> None:
    """1000-step jobs with per-rank jitter, spells of 2-8 slow steps, pauses and
    host bursts: paged in at most 1 % of them (findings may be shown)."""
    assert _rates(name).paged <= 0.01


@pytest.mark.parametrize("name", _names("burst"))
def test_a_burst_of_8_steps_at_1_5x_on_one_rank_pages_in_at_most_1_percent(name: str) -> None:
    assert _rates(name).paged <= 0.01


@pytest.mark.parametrize("name", _names("steady 1.3x") + _names("steady 1.2x"))
def test_a_steady_job_wide_regression_pages_in_95_percent_soon(name: str) -> None:
    """Every rank 1.3x (1.2x) slower from step 250 for 150 steps: paged within
    ``page_by`` steps in at least 95 % of the draws (the 95th percentile), and paged
    before it in at most 1 %."""
    rates = _rates(name)
    assert rates.page_steps is not None
    assert rates.page_steps[1] <= page_by(SCENARIOS[name].period), rates
    assert rates.paged <= 0.01


def test_the_published_rates_are_the_tests_own() -> None:
    """docs/detectors/zscore.md holds the table these draws make; regenerate it with
    ``python -m tests.step_time_draws`` after a change."""
    table = rates_table({name: _rates(name) for name in SCENARIOS})
    assert table in DOC.read_text()
