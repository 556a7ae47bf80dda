from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from torshmon.agent.receiver import ProbeReceiver, read_messages
from torshmon.wire import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    SCHEMA_VERSION,
    Batch,
    ProbeMessage,
    decode_ack,
    encode_frame,
)


def _batch(seq: int, session: str = "s1", *, urgent: bool = False) -> Batch:
    return Batch(
        v=SCHEMA_VERSION,
        session=session,
        seq=seq,
        job="j",
        rank=0,
        sent_unix_ns=0,
        dropped_records_total=0,
        urgent=urgent,
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


class _Store:
    """A store whose futures the test completes: one per call, in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[ProbeMessage, bytes]] = []
        self.futures: list[asyncio.Future[None]] = []

    def __call__(self, message: ProbeMessage, payload: bytes) -> asyncio.Future[None]:
        self.calls.append((message, payload))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future

    def called(self, times: int) -> Callable[[], bool]:
        return lambda: len(self.calls) == times

    def seqs(self) -> list[int]:
        return [m.seq for m, _ in self.calls if isinstance(m, Batch)]


async def _read_ack(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> int:
    header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER.size), timeout_s)
    return decode_ack(await reader.readexactly(int.from_bytes(header, "big"))).seq


async def _wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


async def test_read_window_reads_all_connections_at_once_and_acks_once_stored(
    tmp_path: Path,
) -> None:
    store = _Store()
    async with ProbeReceiver(tmp_path / "a.sock", store=store, read_window_s=0.3) as rx:
        clients = [await asyncio.open_unix_connection(str(rx.socket_path)) for _ in range(3)]
        sent = asyncio.get_running_loop().time()
        for i, (_, writer) in enumerate(clients):
            writer.write(encode_frame(_batch(1, session=f"s{i}")))
            await writer.drain()
        await asyncio.sleep(0.1)
        assert store.calls == []  # the window is still open: nothing read yet
        await _wait_until(lambda: len(store.calls) == 3)
        assert asyncio.get_running_loop().time() - sent >= 0.25
        # None is acknowledged before its store completes.
        for reader, _ in clients:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.readexactly(1), 0.05)
        for future in store.futures:
            future.set_result(None)
        assert [await _read_ack(reader) for reader, _ in clients] == [1, 1, 1]
        assert sorted(p for _, p in store.calls) == sorted(
            encode_frame(_batch(1, session=f"s{i}"))[FRAME_HEADER.size :] for i in range(3)
        )
        for _, writer in clients:
            writer.close()


async def test_after_an_urgent_batch_the_next_window_is_short(tmp_path: Path) -> None:
    """A probe whose fast lane is open (its batches urgent) is read within
    ``urgent_window_s``, not a whole group-commit window later; once it sends a batch
    that is not urgent, windows are long again."""
    store = _Store()
    loop = asyncio.get_running_loop()
    async with ProbeReceiver(
        tmp_path / "a.sock", store=store, read_window_s=0.4, urgent_window_s=0.01
    ) as rx:
        reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))

        async def waited(seq: int, *, urgent: bool) -> float:
            sent = loop.time()
            writer.write(encode_frame(_batch(seq, urgent=urgent)))
            await writer.drain()
            await _wait_until(store.called(seq))
            took = loop.time() - sent
            store.futures[-1].set_result(None)
            assert await _read_ack(reader) == seq
            return took

        assert await waited(1, urgent=True) >= 0.35  # nothing said it was urgent yet
        assert await waited(2, urgent=True) < 0.3
        assert await waited(3, urgent=False) < 0.3  # still read as the lane's
        assert await waited(4, urgent=False) >= 0.35
        writer.close()


async def test_frames_sent_ahead_are_stored_and_acked_in_order(tmp_path: Path) -> None:
    store = _Store()
    async with ProbeReceiver(tmp_path / "a.sock", store=store) as rx:
        reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(b"".join(encode_frame(_batch(seq)) for seq in (1, 2, 3)))
        await writer.drain()
        for seq in (1, 2, 3):
            # The next frame waits in the buffer until this one is stored and acked.
            await _wait_until(store.called(seq))
            await asyncio.sleep(0.05)
            assert store.seqs() == list(range(1, seq + 1))
            store.futures[-1].set_result(None)
            assert await _read_ack(reader) == seq
        writer.close()


async def test_failed_store_drops_the_connection_unacknowledged(tmp_path: Path) -> None:
    store = _Store()
    async with ProbeReceiver(tmp_path / "a.sock", store=store) as rx:
        reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(encode_frame(_batch(1)))
        await writer.drain()
        await _wait_until(lambda: len(store.calls) == 1)
        store.futures[0].set_exception(OSError("disk full"))
        # The connection ends without an ack: the probe keeps the batch to resend.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await _wait_until(lambda: not rx._connections)


async def test_a_batch_whose_store_failed_is_stored_when_resent(tmp_path: Path) -> None:
    store = _Store()
    async with ProbeReceiver(tmp_path / "a.sock", store=store) as rx:
        reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(encode_frame(_batch(1)))
        await writer.drain()
        await _wait_until(store.called(1))
        store.futures[0].set_exception(OSError("disk full"))
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        # The probe reconnects and resends: a second store, then the ack, not a duplicate.
        resend = asyncio.ensure_future(_send(rx.socket_path, encode_frame(_batch(1))))
        await _wait_until(store.called(2))
        assert not resend.done()
        store.futures[1].set_result(None)
        assert decode_ack(await asyncio.wait_for(resend, 5)).seq == 1
        assert rx.duplicates == 0


async def test_a_resend_during_its_store_is_acked_only_once_stored(tmp_path: Path) -> None:
    store = _Store()
    async with ProbeReceiver(tmp_path / "a.sock", store=store) as rx:
        _reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(encode_frame(_batch(1)))
        await writer.drain()
        await _wait_until(store.called(1))
        # Reconnected while the first store is still in progress: no ack before it is durable.
        resend = asyncio.ensure_future(_send(rx.socket_path, encode_frame(_batch(1))))
        await _wait_until(lambda: rx.duplicates == 1)
        await asyncio.sleep(0.05)
        assert not resend.done()
        store.futures[0].set_result(None)
        assert decode_ack(await asyncio.wait_for(resend, 5)).seq == 1
        assert len(store.calls) == 1
        writer.close()


async def test_a_batch_followed_by_eof_is_still_stored(tmp_path: Path) -> None:
    stored: list[int] = []

    async def store(message: ProbeMessage, payload: bytes) -> None:
        await asyncio.sleep(0.05)
        if isinstance(message, Batch):
            stored.append(message.seq)

    async with ProbeReceiver(tmp_path / "a.sock", store=store) as rx:
        _, writer = await asyncio.open_unix_connection(str(rx.socket_path))
        writer.write(encode_frame(_batch(1)) + encode_frame(_batch(2)))
        await writer.drain()
        writer.close()
        await _wait_until(lambda: stored == [1, 2])


async def test_close_waits_for_stores_in_progress(tmp_path: Path) -> None:
    store = _Store()
    rx = ProbeReceiver(tmp_path / "a.sock", store=store)
    await rx.start()
    _, writer = await asyncio.open_unix_connection(str(rx.socket_path))
    writer.write(encode_frame(_batch(1)))
    await writer.drain()
    await _wait_until(lambda: len(store.calls) == 1)
    closing = asyncio.create_task(rx.aclose())
    await asyncio.sleep(0.1)
    assert not closing.done()
    store.futures[0].set_result(None)
    await asyncio.wait_for(closing, 5)
    assert not store.futures[0].cancelled()
    writer.close()


def test_negative_read_window_fails_fast(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read_window_s"):
        ProbeReceiver(tmp_path / "a.sock", read_window_s=-1.0)
    with pytest.raises(ValueError, match="urgent_window_s"):
        ProbeReceiver(tmp_path / "a.sock", read_window_s=0.1, urgent_window_s=float("nan"))


async def test_a_failing_observer_costs_no_data_and_no_service(tmp_path: Path) -> None:
    def on_message(message: ProbeMessage) -> None:
        raise RuntimeError("metrics bug")

    store = _Store()
    async with ProbeReceiver(
        tmp_path / "a.sock", on_message=on_message, store=store, read_window_s=0.05
    ) as rx:
        for seq in (1, 2):
            reader, writer = await asyncio.open_unix_connection(str(rx.socket_path))
            writer.write(encode_frame(_batch(seq)))
            await writer.drain()
            await _wait_until(store.called(seq))
            store.futures[-1].set_result(None)
            assert await _read_ack(reader) == seq
            writer.close()
    assert store.seqs() == [1, 2]


async def test_a_store_that_raises_drops_only_that_connection(tmp_path: Path) -> None:
    def store(message: ProbeMessage, payload: bytes) -> asyncio.Future[None]:
        if isinstance(message, Batch) and message.session == "bad":
            raise OSError("spool gone")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async with ProbeReceiver(tmp_path / "a.sock", store=store, read_window_s=0.05) as rx:
        bad_reader, bad_writer = await asyncio.open_unix_connection(str(rx.socket_path))
        good_reader, good_writer = await asyncio.open_unix_connection(str(rx.socket_path))
        bad_writer.write(encode_frame(_batch(1, session="bad")))
        good_writer.write(encode_frame(_batch(1, session="good")))
        assert await asyncio.wait_for(bad_reader.read(), 5) == b""
        assert await _read_ack(good_reader) == 1
        good_writer.write(encode_frame(_batch(2, session="good")))
        assert await _read_ack(good_reader) == 2
        bad_writer.close()
        good_writer.close()


async def test_the_socket_is_0600_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        async with ProbeReceiver(tmp_path / "agent.sock") as receiver:
            assert stat.S_IMODE(os.stat(receiver.socket_path).st_mode) == 0o600
    finally:
        os.umask(old)


async def test_a_socket_shared_with_a_group_is_0660_in_that_group(tmp_path: Path) -> None:
    gid = 65534 if os.geteuid() == 0 else os.getgid()  # root may hand it to any group
    old = os.umask(0)
    try:
        async with ProbeReceiver(tmp_path / "agent.sock", socket_mode=0o660, socket_gid=gid) as rx:
            info = os.stat(rx.socket_path)
            assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o660, gid)
    finally:
        os.umask(old)


def test_a_socket_mode_for_others_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="owner and group only"):
        ProbeReceiver(tmp_path / "agent.sock", socket_mode=0o666)
