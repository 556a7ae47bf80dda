"""Codec validation, and codec arithmetic on in-process stand-ins for a process group.

The stand-ins are one-rank groups (a sum over one rank is the identity), so the
codecs' encode/decode, error feedback and collective ordering are checked here
without processes; tests/integration/test_codecs.py runs them on real gloo jobs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from torshmon.catalogue.codecs import CODEC_SPECS
from torshmon.probe.codecs import CODECS, Codec, CodecStats, make_codec, validate_codec
from torshmon.probe.config import ConfigError

# -- validation ---------------------------------------------------------------------------


def test_every_codec_is_registered_under_its_name() -> None:
    assert set(CODECS) == {"none", "fp16", "bf16", "powersgd", "topk", "int8"}
    assert all(codec.name == name for name, codec in CODECS.items())


def test_the_probe_implements_exactly_the_catalogues_codecs() -> None:
    assert tuple(CODECS) == tuple(CODEC_SPECS)
    assert all(codec.param_specs == CODEC_SPECS[name].params for name, codec in CODECS.items())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("none", {}),
        ("fp16", {}),
        ("bf16", {}),
        ("int8", {"bits": 8}),
        ("topk", {"ratio": 0.01}),
        ("powersgd", {"rank": 4}),
    ],
)
def test_defaults_are_filled_in(name: str, expected: dict[str, object]) -> None:
    assert validate_codec(name, {}) == expected


def test_valid_params_are_normalised() -> None:
    assert validate_codec("topk", {"ratio": 1}) == {"ratio": 1.0}
    assert isinstance(validate_codec("topk", {"ratio": 1})["ratio"], float)
    assert validate_codec("topk", {"ratio": 1e-6}) == {"ratio": 1e-6}
    assert validate_codec("powersgd", {"rank": 1}) == {"rank": 1}


@pytest.mark.parametrize("bits", [3, 4, 16, 8.0])
def test_int8_supports_only_8_bits(bits: object) -> None:
    with pytest.raises(ConfigError, match=r"'bits' must be an integer in \[8, 8\]"):
        validate_codec("int8", {"bits": bits})


@pytest.mark.parametrize("name", ["zstd", "", "NONE", None, 3])
def test_unknown_codec_lists_the_allowed_names(name: Any) -> None:
    with pytest.raises(ConfigError, match="codec must be one of") as info:
        validate_codec(name, {})
    assert "bf16, fp16, int8, none, powersgd, topk" in str(info.value)


@pytest.mark.parametrize(
    ("name", "params", "field", "allowed"),
    [
        ("topk", {"k": 5}, "'k'", "allowed params: ratio"),
        ("powersgd", {"ratio": 0.1}, "'ratio'", "allowed params: rank"),
        ("fp16", {"rank": 1}, "'rank'", "allowed params: none"),
        ("int8", {"scale": 8}, "'scale'", "allowed params: bits"),
    ],
)
def test_unknown_param_is_named_with_the_allowed_ones(
    name: str, params: dict[str, object], field: str, allowed: str
) -> None:
    with pytest.raises(ConfigError, match="unknown param") as info:
        validate_codec(name, params)
    assert field in str(info.value)
    assert allowed in str(info.value)


@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, math.nan, math.inf, "0.1", True, None])
def test_topk_ratio_must_be_in_zero_one(ratio: object) -> None:
    with pytest.raises(ConfigError) as info:
        validate_codec("topk", {"ratio": ratio})
    message = str(info.value)
    assert "'ratio'" in message
    assert "a number in (0, 1]" in message
    assert repr(ratio) in message


@pytest.mark.parametrize("rank", [0, -1, 2.5, 2.0, "2", False, None])
def test_powersgd_rank_must_be_a_positive_integer(rank: object) -> None:
    with pytest.raises(ConfigError) as info:
        validate_codec("powersgd", {"rank": rank})
    assert "'rank'" in str(info.value)
    assert "an integer >= 1" in str(info.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_make_codec_validates_before_touching_the_group() -> None:
    with pytest.raises(ConfigError, match="'ratio'"):
        make_codec("topk", object(), {"ratio": 2})
    with pytest.raises(ConfigError, match="codec must be one of"):
        make_codec("gzip", object(), {})


# -- one-rank stand-ins for a process group -----------------------------------------------


class _Work:
    def __init__(self, future: Any) -> None:
        self._future = future

    def get_future(self) -> Any:
        return self._future


def _done(value: object) -> _Work:
    future: Any = torch.futures.Future()
    future.set_result(value)
    return _Work(future)


class LoopbackGroup:
    """A one-rank group whose collectives complete at once."""

    def size(self) -> int:
        return 1

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        return _done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> _Work:
        outputs[0][0].copy_(inputs[0])
        return _done(outputs[0])


class ManualGroup:
    """A one-rank group whose collectives complete only when the test says so."""

    def __init__(self) -> None:
        self.issued: list[tuple[list[torch.Tensor], Any]] = []

    def size(self) -> int:
        return 1

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        future: Any = torch.futures.Future()
        self.issued.append((tensors, future))
        return _Work(future)

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(tensors[0].shape) for tensors, _ in self.issued]

    def complete(self, index: int) -> None:
        tensors, future = self.issued[index]
        future.set_result(tensors)

    def fail(self, index: int) -> None:
        self.issued[index][1].set_exception(RuntimeError("connection reset"))


def _reduce(codec: Codec, buffer: torch.Tensor, bucket: int = 0) -> tuple[torch.Tensor, CodecStats]:
    result: tuple[torch.Tensor, CodecStats] = codec.reduce(
        bucket, buffer, measure_error=True
    ).wait()
    return result


def _gradient(numel: int = 4000, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


# -- codec arithmetic ---------------------------------------------------------------------

ALL = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("topk", {"ratio": 0.1}),
    ("powersgd", {"rank": 2}),
]


@pytest.mark.parametrize(("name", "params"), ALL)
def test_result_is_the_bucket_overwritten_in_place(name: str, params: dict[str, object]) -> None:
    buffer = _gradient()
    out, stats = _reduce(make_codec(name, LoopbackGroup(), params), buffer)
    assert out is buffer
    assert stats.raw_bytes == 4000 * 4
    assert stats.compression_ratio == pytest.approx(stats.wire_bytes / stats.raw_bytes)
    assert stats.encode_s >= 0
    assert stats.decode_s >= 0
    assert stats.relative_error is not None


@pytest.mark.parametrize(("name", "params"), ALL)
def test_error_is_measured_only_when_asked(name: str, params: dict[str, object]) -> None:
    codec = make_codec(name, LoopbackGroup(), params)
    _, stats = codec.reduce(0, _gradient(), measure_error=False).wait()
    assert stats.relative_error is None


def test_none_and_casts_round_trip_with_the_expected_error() -> None:
    gradient = _gradient()
    for name, ratio, bound in [("none", 1.0, 0.0), ("fp16", 0.5, 1e-3), ("bf16", 0.5, 1e-2)]:
        out, stats = _reduce(make_codec(name, LoopbackGroup(), {}), gradient.clone())
        assert stats.compression_ratio == ratio
        assert stats.relative_error is not None and stats.relative_error <= bound
        actual = float((out - gradient).norm() / gradient.norm())
        assert actual == pytest.approx(stats.relative_error, abs=1e-7)


def test_topk_sends_values_and_int32_indices_of_the_largest_entries() -> None:
    gradient = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05, 0.4, -2.0])
    out, stats = _reduce(make_codec("topk", LoopbackGroup(), {"ratio": 0.3}), gradient.clone())
    assert out.tolist() == pytest.approx([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, -2.0])
    assert stats.wire_bytes == 3 * (4 + 4)
    kept = torch.tensor([5.0, 3.0, 2.0]).norm()
    assert stats.relative_error == pytest.approx(
        float((gradient.norm() ** 2 - kept**2).sqrt() / gradient.norm())
    )


def test_topk_with_ratio_one_is_exact() -> None:
    gradient = _gradient()
    out, stats = _reduce(make_codec("topk", LoopbackGroup(), {"ratio": 1.0}), gradient.clone())
    assert torch.equal(out, gradient)
    assert stats.relative_error == 0.0


def test_int8_sends_one_byte_per_entry_and_a_scale() -> None:
    gradient = _gradient()
    out, stats = _reduce(make_codec("int8", LoopbackGroup(), {}), gradient.clone())
    assert stats.wire_bytes == 4000 + 4
    # Max-abs scaling of a Gaussian: step ~ 3.5 sigma / 127, rounding error ~ step / sqrt(12).
    assert stats.relative_error is not None and stats.relative_error < 0.02
    step = float(gradient.abs().max()) / 127
    assert float((out - gradient).abs().max()) <= step / 2 + 1e-6


def test_powersgd_sends_two_thin_factors_of_the_square_view() -> None:
    codec = make_codec("powersgd", LoopbackGroup(), {"rank": 3})
    _, stats = _reduce(codec, _gradient(4000))  # viewed as 63 x 64, zero-padded
    assert stats.wire_bytes == 3 * (63 + 64) * 4
    assert stats.relative_error is not None and 0 < stats.relative_error < 1


def test_powersgd_leaves_buckets_too_small_to_gain_uncompressed() -> None:
    gradient = _gradient(10)  # 4 x 3: rank 2 factors would be 14 >= 10 entries
    out, stats = _reduce(make_codec("powersgd", LoopbackGroup(), {"rank": 2}), gradient.clone())
    assert torch.equal(out, gradient)
    assert stats.compression_ratio == 1.0
    assert stats.relative_error == 0.0


@pytest.mark.parametrize(
    ("name", "params"),
    [("int8", {}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2})],
)
def test_error_feedback_keeps_the_accumulated_error_bounded(
    name: str, params: dict[str, object]
) -> None:
    """Small steady entries that one step's compression drops (below half an int8
    step next to the spike, outside the top-k, off the leading singular vectors)
    are sent later: the sum of outputs trails the sum of inputs by a bounded
    residual, where without error feedback the gap would grow with every step."""
    codec = make_codec(name, LoopbackGroup(), params)
    steady = 0.1 * _gradient(3000, seed=1)
    noise = torch.Generator().manual_seed(2)
    sent = torch.zeros(3000, dtype=torch.float64)
    wanted = torch.zeros(3000, dtype=torch.float64)
    gaps = {}
    for step in range(1, 301):
        gradient = steady + 0.05 * torch.randn(3000, generator=noise)
        gradient[0] = 50.0
        wanted += gradient.double()
        sent += _reduce(codec, gradient.clone())[0].double()
        if step in (150, 300):
            gaps[step] = float((wanted - sent).norm() / gradient.norm())
    # Measured: gaps of 0.12 (int8), 0.94 (topk), 3.2 (powersgd) steps' worth, flat
    # from step 150 to 300; without error feedback 20-32 and doubling.
    assert gaps[300] < 5
    assert gaps[300] < 1.25 * gaps[150]
    assert float((wanted - sent).norm() / wanted.norm()) < 0.02


@pytest.mark.parametrize(
    ("name", "params"),
    [("int8", {}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2})],
)
def test_reset_forgets_every_bucket(name: str, params: dict[str, object]) -> None:
    fresh = _reduce(make_codec(name, LoopbackGroup(), params), _gradient(seed=5))[0]
    codec = make_codec(name, LoopbackGroup(), params)
    for seed in range(3):
        _reduce(codec, _gradient(seed=seed))
    codec.reset()
    assert torch.equal(_reduce(codec, _gradient(seed=5))[0], fresh)


@pytest.mark.parametrize(
    ("name", "params"),
    [("int8", {}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2})],
)
def test_a_bucket_that_changes_size_without_reset_starts_afresh(
    name: str, params: dict[str, object]
) -> None:
    codec = make_codec(name, LoopbackGroup(), params)
    _reduce(codec, _gradient(4000))
    out, stats = _reduce(codec, _gradient(900))
    assert out.shape == (900,)
    assert stats.raw_bytes == 900 * 4


@pytest.mark.parametrize(
    ("name", "params"),
    [("int8", {}), ("topk", {"ratio": 0.05}), ("powersgd", {"rank": 2})],
)
def test_a_non_finite_step_propagates_once_and_does_not_poison_the_residual(
    name: str, params: dict[str, object]
) -> None:
    codec = make_codec(name, LoopbackGroup(), params)
    poisoned = _gradient()
    poisoned[7] = math.inf
    poisoned[11] = math.nan
    out, _ = _reduce(codec, poisoned)
    assert not bool(torch.isfinite(out).all())
    for seed in range(3):
        out, _ = _reduce(codec, _gradient(seed=seed))
        assert bool(torch.isfinite(out).all())


def test_params_reports_the_validated_values() -> None:
    codec = make_codec("topk", LoopbackGroup(), {})
    assert codec.params == {"ratio": 0.01}
    codec.params["ratio"] = 0.5
    assert codec.params == {"ratio": 0.01}


# -- PowerSGD's ordering of collectives ---------------------------------------------------


def test_powersgd_issues_each_buckets_rounds_before_the_next_bucket_starts() -> None:
    """Gloo matches collectives by issue order: a later bucket's P must not slip in
    between an earlier bucket's P and Q, whichever order the rounds complete in."""
    group = ManualGroup()
    codec = make_codec("powersgd", group, {"rank": 1})
    first = codec.reduce(0, _gradient(1850), measure_error=False)  # 43 x 44
    second = codec.reduce(1, _gradient(10_000), measure_error=False)  # 100 x 100
    assert group.shapes() == [(43, 1)]
    group.complete(0)
    assert group.shapes() == [(43, 1), (44, 1), (100, 1)]
    group.complete(2)
    assert group.shapes() == [(43, 1), (44, 1), (100, 1), (100, 1)]
    group.complete(3)
    assert second.done() and not first.done()
    group.complete(1)
    assert first.wait()[0].shape == (1850,)
    assert second.wait()[0].shape == (10_000,)


def test_powersgd_failure_reaches_the_future_and_later_buckets_still_run() -> None:
    group = ManualGroup()
    codec = make_codec("powersgd", group, {"rank": 1})
    first = codec.reduce(0, _gradient(1850), measure_error=False)
    second = codec.reduce(1, _gradient(10_000), measure_error=False)
    group.fail(0)
    with pytest.raises(RuntimeError, match="connection reset"):
        first.wait()
    assert group.shapes() == [(43, 1), (100, 1)]
    group.complete(1)
    group.complete(2)
    assert second.wait()[0].shape == (10_000,)


def test_powersgd_reset_while_a_reduction_is_in_flight_lets_it_finish() -> None:
    group = ManualGroup()
    codec = make_codec("powersgd", group, {"rank": 1})
    gradient = _gradient(1850)
    pending = codec.reduce(0, gradient.clone(), measure_error=False)
    codec.reset()
    group.complete(0)
    group.complete(1)
    out, stats = pending.wait()
    assert out.shape == (1850,)
    assert bool(torch.isfinite(out).all())
    assert stats.wire_bytes == (43 + 44) * 4
