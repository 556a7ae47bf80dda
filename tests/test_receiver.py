from __future__ import annotations

import asyncio
import os
from pathlib import Path

from torshmon.agent.receiver import ProbeReceiver, read_messages
from torshmon.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    SCHEMA_VERSION,
    Batch,
    decode_ack,
    encode_frame,
)


def _batch(seq: int, session: str = "s1") -> Batch:
    return Batch(
        v=SCHEMA_VERSION,
        session=session,
        seq=seq,
        job="j",
        rank=0,
        sent_unix_ns=0,
        dropped_records_total=0,
    )


async def _send(path: Path, frame: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(frame)
    await writer.drain()
    header = await reader.readexactly(FRAME_HEADER.size)
    payload = await reader.readexactly(int.from_bytes(header, "big"))
    writer.close()
    return payload


async def test_acks_stores_and_deduplicates(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    async with ProbeReceiver(tmp_path / "a.sock", out_path=out) as rx:
        for seq in (1, 2, 2, 1, 3):
            ack = decode_ack(await _send(rx.socket_path, encode_frame(_batch(seq))))
            assert ack.seq == seq
    assert [m.seq for m in read_messages(out) if isinstance(m, Batch)] == [1, 2, 3]
    assert rx.duplicates == 2


async def test_malformed_frames_are_counted_and_others_still_served(tmp_path: Path) -> None:
    async with ProbeReceiver(tmp_path / "a.sock") as rx:
        # garbage JSON in a well-formed frame: rejected, the same connection goes on
        reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(FRAME_HEADER.pack(9) + b"not json!")
        writer.write(encode_frame(_batch(1)))
        await writer.drain()
        header = await reader.readexactly(4)
        assert decode_ack(await reader.readexactly(int.from_bytes(header, "big"))).seq == 1
        writer.close()
        # an impossible length and random bytes: that connection is dropped
        for junk in (FRAME_HEADER.pack(MAX_FRAME_BYTES + 1) + b"x", os.urandom(3000)):
            _, w = await asyncio.open_unix_connection(str(rx.socket_path))
            w.write(junk)
            await w.drain()
            w.close()
        await asyncio.sleep(0.2)
        # a well-behaved probe is still served
        ack = decode_ack(await _send(rx.socket_path, encode_frame(_batch(2))))
        assert ack.seq == 2
    assert rx.frames_rejected >= 2
    assert rx.frames_accepted == 2


async def test_close_twice_is_safe(tmp_path: Path) -> None:
    rx = ProbeReceiver(tmp_path / "a.sock")
    await rx.start()
    await rx.aclose()
    await rx.aclose()
    assert not rx.socket_path.exists()
