"""The agent's durable FIFO of encoded records, in one SQLite file.

Every record gets a sequence number from a persisted counter, so seqs increase
across restarts and are never reused, even after everything was acknowledged and
deleted. The aggregator de-duplicates by (agent id, seq), which is what makes
replaying after a crash safe.

Durability: WAL journal with ``synchronous=FULL``. A commit in WAL mode writes
the transaction into the ``-wal`` file before it returns, so with either FULL or
NORMAL an agent killed with SIGKILL loses nothing already appended (the bytes are
in the kernel's page cache, which outlives the process). FULL also fsyncs the WAL
on every commit, so an appended record survives a kernel crash or power loss as
well; NORMAL would lose the last commits then. The agent acknowledges data to the
training process only after ``append`` returns, and the probe forgets what was
acknowledged, so the spool is the only copy: FULL costs one fsync per append
(~ms), which is cheap at the agent's rate of a few records per second.

The file is opened in exclusive locking mode, so a second agent pointed at the
same spool fails at once with a clear error instead of interleaving seqs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Final, Literal

from torshmon.paths import secure_private_file
from torshmon.ratelog import LogLimiter

log = logging.getLogger(__name__)

_DROP_LOG_INTERVAL_S: Final = 60.0
_FORMAT_VERSION: Final = 1


class SpoolError(RuntimeError):
    """The spool file cannot be opened, read or written; the text names the path."""


class Spool:
    """A durable FIFO of encoded records with a bound on the bytes it holds.

    Thread safety: every method takes an internal lock, so the spool may be used
    from the event-loop thread and from worker threads (``asyncio.to_thread``) at
    once. Methods block for disk I/O (``append`` and ``ack`` for one fsync).
    Raises SpoolError, naming the path, when the file cannot be opened or written,
    and UnsafePathError when it is not this user's. The file and SQLite's -wal and
    -shm files are 0600 whatever the umask.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 256 * 2**20,
        synchronous: Literal["FULL", "NORMAL"] = "FULL",
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be 'FULL' or 'NORMAL', got {synchronous!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dropped_since_log = 0
        self._drop_log = LogLimiter(_DROP_LOG_INTERVAL_S)
        self._conn: sqlite3.Connection | None = self._open(synchronous)

    # -- lifecycle ------------------------------------------------------------------------

    def _open(self, synchronous: str) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise SpoolError(f"cannot create the directory of spool {self.path}: {exc}") from exc
        # Made (or tightened) before SQLite opens it, which then gives its -wal and -shm
        # files the same 0600: the records are the training job's data.
        secure_private_file(self.path)
        try:
            # isolation_level=None: transactions are opened explicitly (BEGIN IMMEDIATE).
            conn = sqlite3.connect(
                self.path, timeout=0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise SpoolError(f"cannot open spool {self.path}: {exc}") from exc
        try:
            self._init_schema(conn, synchronous)
        except sqlite3.OperationalError as exc:
            conn.close()
            if "locked" in str(exc):
                raise SpoolError(
                    f"spool {self.path} is in use by another process (another agent?)"
                ) from exc
            raise SpoolError(f"cannot open spool {self.path}: {exc}") from exc
        except sqlite3.Error as exc:
            conn.close()
            raise SpoolError(
                f"spool {self.path} is corrupt or not a spool file: {exc}; "
                "move it aside to start with an empty spool"
            ) from exc
        return conn

    def _init_schema(self, conn: sqlite3.Connection, synchronous: str) -> None:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot switch to WAL journal (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS records "
                "(seq INTEGER PRIMARY KEY, payload BLOB NOT NULL)"
            )
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value NOT NULL)")
            for key, value in (
                ("format_version", _FORMAT_VERSION),
                ("last_seq", 0),
                ("dropped_records", 0),
                ("instance_id", uuid.uuid4().hex),
            ):
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            count, total = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM records"
            ).fetchone()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if meta["format_version"] != _FORMAT_VERSION:
            raise sqlite3.DatabaseError(f"unknown spool format version {meta['format_version']}")
        self._last_seq = int(meta["last_seq"])
        self._dropped = int(meta["dropped_records"])
        self._instance_id = str(meta["instance_id"])
        self._records = int(count)
        self._bytes = int(total)

    def close(self) -> None:
        """Close the file; safe to call twice. Other methods raise SpoolError afterwards."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SpoolError(f"spool {self.path} is closed")
        return self._conn

    # -- records --------------------------------------------------------------------------

    def append(self, payload: bytes) -> int:
        """Store one record and return its seq; durable when it returns.

        If the spool then holds more than ``max_bytes``, the oldest records are
        deleted (never the one just appended) and counted in ``dropped_records``.
        """
        with self._lock:
            conn = self._connection()
            seq = self._last_seq + 1
            records, size = self._records + 1, self._bytes + len(payload)
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.execute("INSERT INTO records (seq, payload) VALUES (?, ?)", (seq, payload))
                    conn.execute("UPDATE meta SET value = ? WHERE key = 'last_seq'", (seq,))
                    dropped, freed = 0, 0
                    if size > self.max_bytes:
                        dropped, freed = self._evict_oldest(conn, size - self.max_bytes, seq)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise SpoolError(f"cannot append to spool {self.path}: {exc}") from exc
            self._last_seq = seq
            self._records, self._bytes = records - dropped, size - freed
            self._dropped += dropped
            if dropped:
                self._log_drops(dropped)
            return seq

    def _evict_oldest(
        self, conn: sqlite3.Connection, excess: int, keep_seq: int
    ) -> tuple[int, int]:
        """Delete the oldest records freeing at least ``excess`` bytes; (count, bytes)."""
        dropped, freed, cutoff = 0, 0, None
        rows = conn.execute(
            "SELECT seq, LENGTH(payload) FROM records WHERE seq < ? ORDER BY seq", (keep_seq,)
        )
        for seq, length in rows:
            cutoff, dropped, freed = seq, dropped + 1, freed + length
            if freed >= excess:
                break
        rows.close()
        if cutoff is not None:
            conn.execute("DELETE FROM records WHERE seq <= ?", (cutoff,))
            conn.execute(
                "UPDATE meta SET value = value + ? WHERE key = 'dropped_records'", (dropped,)
            )
        return dropped, freed

    def _log_drops(self, dropped: int) -> None:
        self._dropped_since_log += dropped
        if self._drop_log.allow():
            log.warning(
                "spool %s is over its %d byte bound: dropped the %d oldest records "
                "(%d in total); is the aggregator reachable?",
                self.path,
                self.max_bytes,
                self._dropped_since_log,
                self._dropped,
            )
            self._dropped_since_log = 0

    def peek(self, limit: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """The oldest records as (seq, payload), oldest first, without removing them.

        At most ``limit`` records and ``max_bytes`` payload bytes, but at least one
        record if the spool holds any (a record larger than ``max_bytes`` still goes).
        """
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        out: list[tuple[int, bytes]] = []
        with self._lock:
            conn = self._connection()
            try:
                rows = conn.execute(
                    "SELECT seq, payload FROM records ORDER BY seq LIMIT ?", (limit,)
                )
                total = 0
                for seq, payload in rows:
                    total += len(payload)
                    if out and total > max_bytes:
                        break
                    out.append((int(seq), bytes(payload)))
                rows.close()
            except sqlite3.Error as exc:
                raise SpoolError(f"cannot read spool {self.path}: {exc}") from exc
        return out

    def ack(self, through_seq: int) -> None:
        """Delete every record with seq <= ``through_seq`` (they were delivered)."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    count, size = conn.execute(
                        "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM records "
                        "WHERE seq <= ?",
                        (through_seq,),
                    ).fetchone()
                    if count:
                        conn.execute("DELETE FROM records WHERE seq <= ?", (through_seq,))
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise SpoolError(f"cannot acknowledge records in spool {self.path}: {exc}") from exc
            self._records -= int(count)
            self._bytes -= int(size)

    # -- state ----------------------------------------------------------------------------

    @property
    def records(self) -> int:
        """Records held (not yet acknowledged)."""
        return self._records

    @property
    def bytes(self) -> int:
        """Payload bytes held."""
        return self._bytes

    @property
    def dropped_records(self) -> int:
        """Records deleted unsent to keep under ``max_bytes``, over the file's lifetime."""
        return self._dropped

    @property
    def last_seq(self) -> int:
        """The seq of the last record ever appended (0 for a new file)."""
        return self._last_seq

    @property
    def instance_id(self) -> str:
        """A random id made when the file was created; changes if the spool is recreated.

        Seqs restart at 1 in a new file, so the agent id sent to the aggregator
        (which de-duplicates by agent id + seq) should include it.
        """
        return self._instance_id


__all__ = ["Spool", "SpoolError"]
