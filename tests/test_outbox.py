from __future__ import annotations

import pytest

from torshmon.probe.shipper import Outbox


def test_overflow_drops_the_oldest_and_counts() -> None:
    box: Outbox[int] = Outbox(3)
    for i in range(5):
        box.put(i)
    assert box.drain() == [2, 3, 4]
    assert box.dropped == 2
    assert box.drain() == []


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        Outbox(0)
