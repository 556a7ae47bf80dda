from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from torshmon.agent.spool import Spool, SpoolError

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    s = Spool(tmp_path / "nested" / "dir" / "spool.db")
    try:
        yield s
    finally:
        s.close()


def test_append_peek_ack_keep_fifo_order(spool: Spool) -> None:
    seqs = [spool.append(b"record-%d" % i) for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    assert spool.records == 5
    assert spool.bytes == sum(len(b"record-%d" % i) for i in range(5))
    assert spool.peek(3, 1 << 20) == [(1, b"record-0"), (2, b"record-1"), (3, b"record-2")]

    spool.ack(2)
    assert spool.peek(10, 1 << 20) == [(3, b"record-2"), (4, b"record-3"), (5, b"record-4")]
    assert spool.records == 3
    assert spool.bytes == 3 * len(b"record-0")
    spool.ack(2)  # acknowledging again changes nothing
    assert spool.records == 3


def test_peek_bounds_bytes_but_returns_at_least_one(spool: Spool) -> None:
    assert spool.peek(10, 100) == []
    spool.append(b"a" * 60)
    spool.append(b"b" * 30)
    spool.append(b"c" * 30)
    assert [seq for seq, _ in spool.peek(10, 100)] == [1, 2]
    assert [seq for seq, _ in spool.peek(10, 10)] == [1]  # larger than the bound, still sent
    assert [seq for seq, _ in spool.peek(1, 1 << 20)] == [1]


def test_seq_is_monotonic_across_reopen_and_after_ack_all(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path) as s:
        assert s.last_seq == 0
        s.append(b"x")
        s.append(b"y")
        s.ack(s.last_seq)
        assert s.records == 0
        instance = s.instance_id
    with Spool(path) as s:
        assert (s.records, s.bytes, s.last_seq) == (0, 0, 2)
        assert s.append(b"z") == 3
        assert s.instance_id == instance
    with Spool(path) as s:
        assert s.peek(10, 100) == [(3, b"z")]
        assert s.append(b"w") == 4


def test_bound_drops_oldest_and_counts_persistently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "spool.db"
    with Spool(path, max_bytes=100) as s:
        for _ in range(10):
            s.append(b"0123456789")
        assert s.dropped_records == 0
        s.append(b"0123456789" * 3)  # 130 bytes held: the 3 oldest go
        assert s.dropped_records == 3
        assert s.bytes == 100
        assert s.peek(1, 1)[0][0] == 4
        assert "dropped the 3 oldest records" in caplog.text
        s.append(b"0123456789")
        assert s.dropped_records == 4
    with Spool(path, max_bytes=100) as s:
        assert s.dropped_records == 4
        assert (s.records, s.bytes) == (8, 100)
        assert [seq for seq, _ in s.peek(100, 1000)] == [5, 6, 7, 8, 9, 10, 11, 12]


def test_record_larger_than_the_bound_is_kept_alone(spool: Spool) -> None:
    spool.max_bytes = 10
    spool.append(b"12345")
    seq = spool.append(b"x" * 50)
    assert spool.peek(10, 1000) == [(seq, b"x" * 50)]
    assert spool.dropped_records == 1


_WRITER = textwrap.dedent(
    """
    import sys
    from torshmon.agent.spool import Spool

    spool = Spool(sys.argv[1])
    for i in range(1_000_000):
        seq = spool.append(b"payload-%d" % i)
        sys.stdout.write(f"{seq}\\n")
        sys.stdout.flush()
    """
)


def test_sigkill_loses_nothing_already_appended(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    printed: list[int] = []
    with subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, env=env, cwd=REPO_ROOT
    ) as proc:
        assert proc.stdout is not None
        try:
            while len(printed) < 300:
                line = proc.stdout.readline()
                assert line, f"writer exited early with {proc.wait()}"
                printed.append(int(line))
            proc.send_signal(signal.SIGKILL)
            # Seqs printed before the kill landed are still in the pipe.
            printed.extend(int(line) for line in proc.stdout.read().split())
        finally:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    with Spool(path) as s:
        stored = dict(s.peek(10**7, 1 << 40))
        assert s.last_seq >= printed[-1]
    assert printed == list(range(1, len(printed) + 1))
    for seq in printed:
        assert stored[seq] == b"payload-%d" % (seq - 1)


def test_corrupt_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    path.write_bytes(b"this is not a database\n" * 500)
    with pytest.raises(SpoolError, match=r"spool .*spool\.db is corrupt"):
        Spool(path)


def test_second_opener_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path), pytest.raises(SpoolError, match="in use by another process"):
        Spool(path)


def test_close_is_idempotent_and_later_use_fails_clearly(tmp_path: Path) -> None:
    s = Spool(tmp_path / "spool.db")
    s.close()
    s.close()
    with pytest.raises(SpoolError, match="is closed"):
        s.append(b"x")


def test_invalid_arguments_fail_fast(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Spool(tmp_path / "a.db", max_bytes=0)


def test_the_spool_and_its_wal_are_0600_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with Spool(tmp_path / "spool" / "spool.db") as spool:
            spool.append(b"record")
            files = sorted(p.name for p in spool.path.parent.iterdir())
            assert "spool.db-wal" in files
            for name in files:
                mode = stat.S_IMODE(os.stat(spool.path.parent / name).st_mode)
                assert mode == 0o600, (name, oct(mode))
            assert stat.S_IMODE(os.stat(spool.path.parent).st_mode) == 0o700
    finally:
        os.umask(old)
