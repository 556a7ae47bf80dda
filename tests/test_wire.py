from __future__ import annotations

import pytest

from torshmon.wire import (
    MAX_FRAME_BYTES,
    SCHEMA_VERSION,
    Ack,
    Batch,
    Hello,
    IngestBatch,
    StepRecord,
    WireError,
    decode_ack,
    decode_json,
    decode_probe_message,
    encode_frame,
    frame_length,
)


def _hello() -> Hello:
    return Hello(
        v=SCHEMA_VERSION,
        session="s",
        job="j",
        rank=0,
        world_size=2,
        local_rank=0,
        node="n",
        pid=1,
        backend="gloo",
        torch_version="2.13.0",
        probe_version="0.1.0",
    )


def _step(step: int = 1) -> StepRecord:
    return StepRecord(
        step=step,
        end_unix_ns=1,
        duration_s=0.1,
        comm_wait_s=0.02,
        compute_s=0.08,
        communication_time_ratio=0.2,
        comm_busy_s=0.05,
    )


def test_round_trip_keeps_every_field() -> None:
    batch = Batch(
        v=SCHEMA_VERSION,
        session="s",
        seq=3,
        job="j",
        rank=1,
        sent_unix_ns=5,
        dropped_records_total=7,
        steps=[_step(1), _step(2)],
    )
    for message in (_hello(), batch):
        frame = encode_frame(message)
        assert frame_length(frame[:4]) == len(frame) - 4
        assert decode_probe_message(frame[4:]) == message


def test_wrong_type_is_rejected_naming_the_field() -> None:
    payload = (
        b'{"kind":"batch","v":1,"session":"s","seq":"three","job":"j","rank":0,'
        b'"sent_unix_ns":0,"dropped_records_total":0}'
    )
    with pytest.raises(WireError, match=r"seq"):
        decode_probe_message(payload)


def test_missing_field_and_unknown_kind_are_rejected() -> None:
    with pytest.raises(WireError, match="session"):
        decode_probe_message(b'{"kind":"batch","v":1}')
    with pytest.raises(WireError, match="kind"):
        decode_probe_message(b'{"kind":"bogus","v":1}')
    with pytest.raises(WireError):
        decode_probe_message(b"\xff\x00not json")


def test_other_schema_version_is_rejected() -> None:
    frame = encode_frame(Ack(v=SCHEMA_VERSION + 1, seq=1))
    with pytest.raises(WireError, match="unsupported schema version"):
        decode_ack(frame[4:])


def test_oversized_frames_are_refused_both_ways() -> None:
    with pytest.raises(WireError, match="limit"):
        frame_length((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    huge = Batch(
        v=SCHEMA_VERSION,
        session="x" * (MAX_FRAME_BYTES + 1),
        seq=1,
        job="j",
        rank=0,
        sent_unix_ns=0,
        dropped_records_total=0,
    )
    with pytest.raises(WireError, match="exceeds"):
        encode_frame(huge)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"v": 1, "agent_id": "\xff", "node": "n", "records": []}', "(?i)UTF-8"),
        (b'{"v": 1, "agent_id": "a", "node": "n", "records": [], "x": ' + b"[" * 100_000, "deep"),
    ],
)
def test_undecodable_json_is_a_wire_error(body: bytes, reason: str) -> None:
    """Invalid UTF-8 and nesting deeper than the decoder recurses are bad input like any
    other (msgspec raises UnicodeDecodeError and RecursionError for them)."""
    with pytest.raises(WireError, match=reason):
        decode_json(body, IngestBatch)
