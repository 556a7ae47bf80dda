"""Agents heard from, and dating what they deliver on the aggregator's clock."""

from __future__ import annotations

import math

import pytest

from torshmon.aggregator.core.agents import Agents


def test_live_data_is_current_whatever_the_clock_offset_of_its_node() -> None:
    agents = Agents()
    # The node's clock runs 40 s behind the aggregator's; the data arrives 50 ms late.
    agents.contact("a", 1000.0, [959.95])
    assert agents.dated("a", 959.95, 1000.0) == pytest.approx(1000.0)
    agents.contact("a", 1001.0, [960.95])
    assert agents.dated("a", 960.95, 1001.0) == pytest.approx(1001.0)
    assert agents.horizon("a") == pytest.approx(1001.0)


def test_a_replayed_spool_is_dated_when_it_was_sent_not_when_it_arrived() -> None:
    agents = Agents()
    for t in range(1000, 1010):
        agents.contact("a", t + 0.05, [float(t)])
    # The agent was down for 20 s; its restart replays what it spooled from 1010 on,
    # with the fresh records in the same POST.
    agents.contact("a", 1030.0, [1010.0, 1011.0, 1029.9])
    assert agents.dated("a", 1010.0, 1030.0) == pytest.approx(1010.05, abs=0.3)
    assert agents.dated("a", 1029.9, 1030.0) == pytest.approx(1029.95, abs=0.3)
    assert agents.horizon("a") == pytest.approx(1029.95, abs=0.3)


def test_a_replay_alone_is_still_old_news() -> None:
    agents = Agents()
    agents.contact("a", 1000.0, [1000.0])
    # Only old records in this POST: the floor may rise by 1% of the gap, no more.
    agents.contact("a", 1100.0, [1001.0])
    assert agents.dated("a", 1001.0, 1100.0) == pytest.approx(1002.0)
    assert agents.horizon("a") == pytest.approx(1002.0)


def test_silence_counts_from_the_last_post_and_idle_agents_are_forgotten() -> None:
    agents = Agents()
    agents.contact("a", 1000.0, [])
    agents.contact("b", 1003.0, [1003.0])
    assert agents.silence_s(1004.0) == {"a": 4.0, "b": 1.0}
    assert agents.horizon("a") == -math.inf  # an empty poll vouches for no data
    assert agents.dated("unknown", 5.0, 1004.0) == 1004.0
    assert agents.forget_idle(1001.0) == ["a"]
    assert list(agents.silence_s(1004.0)) == ["b"]
