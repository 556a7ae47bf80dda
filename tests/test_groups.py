"""When a rank's batches carry its process groups (``torshmon.probe.groups``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from torshmon.probe import _torch_compat
from torshmon.probe.groups import GroupRegistry
from torshmon.wire import InflightOp


@dataclass(eq=False)
class _Group:
    group_name: str
    group_desc: str = "undefined"


WORLD, PAIR = _Group("0", "default_pg"), _Group("1")


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _stuck(age_s: float) -> InflightOp:
    return InflightOp(pg="1", seq=3, op="all_reduce", size_bytes=8, start_unix_ns=0, age_s=age_s)


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, list[int]]]:
    groups: list[tuple[Any, list[int]]] = [(WORLD, [0, 1, 2, 3]), (PAIR, [2, 3])]
    monkeypatch.setattr(_torch_compat, "process_groups", lambda: list(groups))
    monkeypatch.setattr(_torch_compat, "process_group_count", lambda: len(groups))
    return groups


def test_groups_go_first_then_on_change_resend_stale_ops_and_every_resend_s(
    table: list[tuple[Any, list[int]]],
) -> None:
    clock = _Clock()
    registry = GroupRegistry(WORLD, 4, resend_s=30.0, clock=clock)
    first = registry.take([])
    assert [(g.pg, g.ranks, g.desc) for g in first] == [
        ("1", [2, 3], "undefined"),
        ("default", [0, 1, 2, 3], "default_pg"),
    ]
    assert registry.take([]) == []  # unchanged
    assert registry.take([_stuck(0.2)]) == []  # an op in flight briefly: no need
    assert registry.take([_stuck(1.5)]) == first  # a possible hang: the aggregator needs them
    table.append((_Group("2"), [0, 1]))
    assert [g.pg for g in registry.take([])] == ["1", "2", "default"]
    registry.resend()  # a new connection
    assert len(registry.take([])) == 3
    assert registry.take([]) == []
    clock.now_s += 30.0
    assert len(registry.take([])) == 3
    # A group destroyed and another made in its place: the registry's size is the same,
    # so it is read again only a second after the last look; then the change goes.
    table[-1] = (_Group("3"), [0, 1])
    assert registry.take([]) == []
    clock.now_s += 1.0
    assert [g.pg for g in registry.take([])] == ["1", "3", "default"]


def test_an_unreadable_registry_reports_the_world_group_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_torch_compat, "process_groups", lambda: None)
    (world,) = GroupRegistry(WORLD, 3).take([])
    assert (world.pg, world.ranks) == ("default", [0, 1, 2])


def test_a_failing_registry_never_breaks_the_shipper(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> list[tuple[Any, list[int]]]:
        raise RuntimeError("torch changed")

    monkeypatch.setattr(_torch_compat, "process_groups", broken)
    assert GroupRegistry(WORLD, 3).take([]) == []
