"""Ranks forked from the suite's forkserver see the launching process's environment of
the moment, as spawned ones do, not the server's from when it started."""

from __future__ import annotations

import os

import pytest

from torshmon.launch import run_ranks

pytestmark = pytest.mark.integration


def _environment(rank: int, world_size: int) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("TORSHMON_T_NEW", "TORSHMON_T_GONE", "RANK")}


def test_forked_ranks_see_the_environment_of_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORSHMON_T_GONE", "1")
    run_ranks(_environment, 1, timeout_s=120)  # the server has started, with _GONE set
    monkeypatch.delenv("TORSHMON_T_GONE")
    monkeypatch.setenv("TORSHMON_T_NEW", "new")
    results = run_ranks(_environment, 2, timeout_s=120)
    assert results == [
        {"TORSHMON_T_NEW": "new", "TORSHMON_T_GONE": None, "RANK": str(r)} for r in range(2)
    ]
