"""The probe's link check: tournament rounds and the consensus payload that carries it."""

from __future__ import annotations

import itertools

import pytest

from torshmon.probe.config import CommConfig, ConfigError
from torshmon.probe.linkcheck import MAX_SIZE_BYTES, MIN_SIZE_BYTES, LinkCheckRequest, rounds
from torshmon.probe.reconfig import (
    MAX_CONFIG_BYTES,
    PAYLOAD_BYTES,
    decode_payload,
    encode_payload,
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8, 9])
def test_every_pair_meets_once_and_no_rank_twice_in_a_round(world_size: int) -> None:
    schedule = rounds(world_size)
    met = [pair for pairs in schedule for pair in pairs]
    assert sorted(met) == list(itertools.combinations(range(world_size), 2))
    for pairs in schedule:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks))
    expected_rounds = world_size - 1 if world_size % 2 == 0 else world_size
    assert len(schedule) == (0 if world_size == 1 else expected_rounds)


def test_rounds_refuses_an_empty_world() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        rounds(0)


def _config(**params: float) -> CommConfig:
    return CommConfig(
        version=3, bucket_cap_mb=4.0, first_bucket_cap_mb=1.0, codec="topk", codec_params=params
    )


@pytest.mark.parametrize(
    ("config", "check"),
    [
        (None, None),
        (_config(ratio=0.1), None),
        (None, LinkCheckRequest(id="abc", size_bytes=2**20)),
        (_config(ratio=0.25), LinkCheckRequest(id="x" * 64, size_bytes=MAX_SIZE_BYTES)),
    ],
)
def test_payload_carries_either_both_or_none(
    config: CommConfig | None, check: LinkCheckRequest | None
) -> None:
    raw = encode_payload(config, check)
    assert len(raw) == PAYLOAD_BYTES
    assert decode_payload(raw) == (config, check)


def test_payload_of_a_config_alone_is_the_old_framing() -> None:
    """A config without a check is framed as before link checks existed."""
    config = _config(ratio=0.5)
    data = config.to_json()
    old = (len(data).to_bytes(4, "big") + data).ljust(PAYLOAD_BYTES, b"\0")
    assert encode_payload(config, None) == old
    assert decode_payload(bytes(PAYLOAD_BYTES)) == (None, None)


def test_an_unreadable_check_is_dropped_alike_on_every_rank() -> None:
    garbage = b"{not json"
    raw = (bytes(4) + len(garbage).to_bytes(4, "big") + garbage).ljust(PAYLOAD_BYTES, b"\0")
    assert decode_payload(raw) == (None, None)


def test_a_config_too_large_is_refused_by_name() -> None:
    params = {f"p{i}": float(i) for i in range(80)}
    config = _config(**params)
    assert len(config.to_json()) > MAX_CONFIG_BYTES
    with pytest.raises(ConfigError, match="config too large to send"):
        encode_payload(config, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id": ""}, "id must be 1..64 characters"),
        ({"id": "y" * 65}, "id must be 1..64 characters"),
        ({"id": "a", "size_bytes": MIN_SIZE_BYTES - 1}, "size_bytes must be in"),
        ({"id": "a", "size_bytes": MAX_SIZE_BYTES + 1}, "size_bytes must be in"),
    ],
)
def test_bad_requests_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkCheckRequest(**kwargs)  # type: ignore[arg-type]


def test_repeats_travel_in_the_payload_and_are_bounded() -> None:
    check = LinkCheckRequest(id="r", size_bytes=MIN_SIZE_BYTES, repeats=3)
    assert decode_payload(encode_payload(None, check)) == (None, check)
    with pytest.raises(ValueError, match=r"repeats must be in 1\.\.16, got 0"):
        LinkCheckRequest(id="r", repeats=0)
