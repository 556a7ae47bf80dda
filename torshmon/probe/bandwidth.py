"""Algorithm and bus bandwidth of collectives, by the nccl-tests formulas.

algbw = S / t, where S is the message size nccl-tests uses for the op;
busbw = algbw * factor(op, n), the factor that makes busbw comparable with the
hardware's peak link bandwidth whatever the op and the group size n
(see nccl-tests, doc/PERFORMANCE.md).
"""

from __future__ import annotations


def _ring(n: int) -> float:
    return (n - 1) / n


def _all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


def _one(n: int) -> float:
    return 1.0


def _zero(n: int) -> float:
    return 0.0


_FACTORS = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce,
    "all_gather": _ring,
    "all_gather_coalesced": _ring,
    "all_gather_into_tensor": _ring,
    "all_gather_single": _ring,
    "all_gather_into_tensor_coalesced": _ring,
    "reduce_scatter": _ring,
    "reduce_scatter_tensor": _ring,
    "reduce_scatter_single": _ring,
    "reduce_scatter_tensor_coalesced": _ring,
    "all_to_all": _ring,
    "all_to_all_single": _ring,
    "broadcast": _one,
    "reduce": _one,
    "gather": _one,
    "scatter": _one,
    "send": _one,
    "recv": _one,
    "isend": _one,
    "irecv": _one,
    "barrier": _zero,
}

KNOWN_OPS = frozenset(_FACTORS)


def bus_factor(op: str, group_size: int) -> float:
    """The busbw/algbw factor of ``op`` in a group of ``group_size`` ranks.

    Raises KeyError for an op with no known formula.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return _FACTORS[op](group_size)


def bandwidths(op: str, size_bytes: int, duration_s: float, group_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second; (0, 0) when nothing was timed."""
    if duration_s <= 0.0 or size_bytes <= 0:
        return 0.0, 0.0
    algbw = size_bytes / duration_s
    return algbw, algbw * bus_factor(op, group_size)
