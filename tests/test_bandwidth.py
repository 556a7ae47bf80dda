from __future__ import annotations

import pytest

from torshmon.probe.bandwidth import bandwidths, bus_factor


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 8, 0.875),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
        ("send", 2, 1.0),
        ("barrier", 8, 0.0),
    ],
)
def test_bus_factor_follows_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths() -> None:
    algbw, busbw = bandwidths("all_reduce", 4_000_000, 0.002, 4)
    assert algbw == pytest.approx(2e9)
    assert busbw == pytest.approx(3e9)
    assert bandwidths("all_reduce", 10, 0.0, 2) == (0.0, 0.0)


def test_unknown_op_and_bad_group_size() -> None:
    with pytest.raises(KeyError):
        bus_factor("all_reduce_fancy", 2)
    with pytest.raises(ValueError, match="group_size"):
        bus_factor("all_reduce", 0)


def test_every_wrapped_op_has_a_formula() -> None:
    from torshmon.probe.bandwidth import KNOWN_OPS
    from torshmon.probe.collectives import DESCRIBERS

    assert set(DESCRIBERS) <= KNOWN_OPS
