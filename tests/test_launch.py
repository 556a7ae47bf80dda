"""Which start method ``run_ranks`` picks once ``use_forkserver`` is on: a forked rank
could not see a change to a variable read only as an interpreter or torch starts."""

from __future__ import annotations

import os

import pytest

from torshmon import launch


@pytest.fixture
def forkserver_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/a")
    monkeypatch.setenv("X", "1")
    for name in ("OMP_NUM_THREADS", "TORSHMON_AUTO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch._launcher, "method", "forkserver")
    monkeypatch.setattr(launch._launcher, "server_environ", dict(os.environ))


@pytest.mark.usefixtures("forkserver_default")
def test_ranks_fork_while_only_ordinary_variables_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("X", "2")
    # env= PYTHON* values apply after start-up under spawn too: no reason to spawn.
    ranks = [{"X": "2", "PYTHONPATH": "/b", "TORSHMON_FOO": "y"}]
    assert launch._start_method(None, ranks) == "forkserver"
    assert launch._start_method("spawn", ranks) == "spawn"


@pytest.mark.usefixtures("forkserver_default")
def test_ranks_spawn_where_a_start_up_variable_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert launch._start_method(None, [{"OMP_NUM_THREADS": "1"}]) == "spawn"
    monkeypatch.setenv("PYTHONPATH", "/b")
    assert launch._start_method(None, [{}]) == "spawn"
    monkeypatch.setenv("PYTHONPATH", "/a")
    monkeypatch.setenv("TORSHMON_AUTO", "1")
    assert launch._start_method(None, [{}]) == "spawn"


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match="'fork'"):
        launch._start_method("fork", [{}])
