"""Evidence on alert: asks a job's ranks for it, and keeps the files they send.

The ``capture_evidence`` action of a firing alert (on by default for Straggler and
Hung Collective) sends an ``evidence`` command to every rank of the job: each dumps
its Flight Recorder, and the rank the alert names plus one healthy peer record a few
steps under torch.profiler (``torshmon.probe.evidence``). The files come back in
the ranks' batches through their agents, like any other record (authenticated,
spooled, idempotent), and are kept here as gzip files under ``dir``, one
folder per capture, with their rows in the history (``evidence_captures``,
``evidence_files``). Bounded: a file is at most ``EVIDENCE_FILE_MAX_BYTES`` on the
wire, a capture at most ``capture_max_bytes`` here, all captures at most
``max_bytes``, and captures older than ``retention_s`` are deleted.
Runs on the aggregator's event loop; file I/O on a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Protocol

from torshmon.aggregator.core.alert import Alert
from torshmon.aggregator.core.commands import MAX_PROFILE_STEPS, CommandError, CommandStatus
from torshmon.history.store import EvidenceCaptureRow, EvidenceFileRow, Row
from torshmon.paths import ensure_private_dir
from torshmon.settings import Section, setting
from torshmon.wire import Batch, EvidenceFile, IngestBatch

log = logging.getLogger(__name__)

#: The files a rank may send (``torshmon.probe.evidence``).
FILE_NAMES: Final = frozenset({"flight_recorder.json", "profiler_trace.json"})
ACTION: Final = "capture_evidence"
_CAPTURE_ID: Final = re.compile(r"[0-9a-f]{1,64}\Z")
_GZIP_MAGIC: Final = b"\x1f\x8b"


class EvidenceSettings(Section, frozen=True):
    """Evidence captured on alert: where it is kept, how much, for how long."""

    dir: Annotated[
        str | None,
        setting(
            "folder of the evidence captured on alert (Flight Recorder dumps, profiler traces)",
            env="TORSHMON_EVIDENCE_DIR",
            default_text="beside a SQLite history (<db>.evidence), else "
            "$XDG_STATE_HOME/torshmon/evidence",
        ),
    ] = None
    capture_max_bytes: Annotated[
        int, setting("most bytes kept of one capture (all its ranks' files)", ge=1024)
    ] = 64 * 1024 * 1024
    max_bytes: Annotated[
        int, setting("most bytes of evidence kept; the oldest captures go first", ge=1024)
    ] = 1024 * 1024 * 1024
    retention_s: Annotated[float, setting("how long captures are kept", gt=0)] = 7 * 86400.0
    min_interval_s: Annotated[
        float, setting("least time between two captures for one alert instance", ge=0)
    ] = 300.0
    profile_steps: Annotated[
        int,
        setting(
            "steps the alert's rank and a healthy peer record under torch.profiler",
            ge=1,
            le=MAX_PROFILE_STEPS,
        ),
    ] = 3


class EvidenceStore(Protocol):
    """The history's evidence tables (``torshmon.history.store.HistoryStore``)."""

    async def add_evidence_capture(self, capture: EvidenceCaptureRow) -> None: ...

    async def add_evidence_file(self, file: EvidenceFileRow) -> bool: ...

    async def evidence_file(self, capture_id: str, rank: int, name: str) -> Row | None: ...

    async def evidence_bytes(self, capture_id: str | None = None) -> int: ...

    async def prune_evidence(self, before_unix_s: float, max_bytes: int) -> list[Row]: ...


class CommandSink(Protocol):
    """Where commands go (``torshmon.aggregator.dispatch.CommandDispatch``)."""

    async def submit_command(
        self, job: str, kind: str, args: Mapping[str, object], *, command_id: str | None = None
    ) -> CommandStatus: ...


class EvidenceKeeper:
    """Asks for evidence on alert and stores what the ranks send.

    ``world_size`` names a job's world size (None when unknown); ``clock`` is Unix
    seconds. ``on_alert`` is the action hook; ``receive`` takes each stored ingest;
    ``prune`` runs with the retention job; ``aclose`` cancels captures being asked.
    """

    def __init__(
        self,
        settings: EvidenceSettings,
        *,
        store: EvidenceStore,
        commands: CommandSink,
        world_size: Callable[[str], int | None],
        clock: Callable[[], float],
    ) -> None:
        if settings.dir is None:
            raise ValueError("settings.dir must name the evidence folder")
        self.settings = settings
        self.directory = Path(settings.dir)
        self._store = store
        self._commands = commands
        self._world_size = world_size
        self._clock = clock
        self._last_capture: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- asking --------------------------------------------------------------------------
    def on_alert(self, alert: Alert) -> None:
        """The ``capture_evidence`` action of a firing alert (at most one capture per
        alert instance every ``min_interval_s``: a flapping alert asks once)."""
        job = alert.job
        now = self._clock()
        last = self._last_capture.get(alert.fingerprint)
        if not job or (last is not None and now - last < self.settings.min_interval_s):
            return
        self._last_capture = {
            k: t for k, t in self._last_capture.items() if now - t < self.settings.min_interval_s
        }
        self._last_capture[alert.fingerprint] = now
        task = asyncio.ensure_future(self._capture_logged(job, alert))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _capture_logged(self, job: str, alert: Alert) -> None:
        try:
            capture_id = await self.capture(job, alert=alert)
        except Exception:
            log.exception("evidence capture for %s (%s) not sent", job, alert.rule)
        else:
            log.info("evidence capture %s asked of job %s for %s", capture_id, job, alert.rule)

    async def capture(
        self, job: str, *, alert: Alert | None = None, profile_ranks: Sequence[int] | None = None
    ) -> str:
        """Ask every rank of ``job`` for evidence; the capture's id. The profiler runs on
        ``profile_ranks``, by default the alert's rank and one healthy peer.
        CommandError names bad arguments."""
        if not job or len(job) > 200:
            raise CommandError("job must be a non-empty name of at most 200 characters")
        if profile_ranks is None:
            profile_ranks = self.profile_ranks(job, alert.rank if alert is not None else None)
        args = {"profile_ranks": list(profile_ranks), "profile_steps": self.settings.profile_steps}
        # Stored before the command can be sent, so no file arrives for an unknown capture.
        capture_id = uuid.uuid4().hex[:16]
        await self._store.add_evidence_capture(
            EvidenceCaptureRow(
                id=capture_id,
                job=job,
                alert_id=None,
                alert_fingerprint=alert.fingerprint if alert is not None else None,
                rule=alert.rule if alert is not None else "",
                profile_ranks=list(profile_ranks),
                created_unix_s=self._clock(),
            )
        )
        status = await self._commands.submit_command(job, "evidence", args, command_id=capture_id)
        return status.command.id

    def profile_ranks(self, job: str, rank_text: str | None) -> list[int]:
        """The rank an alert names and one healthy peer (rank 0, or 1 when rank 0 is
        named); rank 0 alone when the alert names none."""
        if rank_text is None or not rank_text.isdigit():
            return [0]
        rank = int(rank_text)
        peer = 1 if rank == 0 else 0
        world = self._world_size(job)
        if world is not None and peer >= world:
            return [rank]
        return [rank, peer]

    # -- keeping -------------------------------------------------------------------------
    async def receive(self, batch: IngestBatch) -> int:
        """Store the evidence files an ingest carried; how many were new. A file that
        cannot be kept is stored as a row saying why; nothing here raises."""
        stored = 0
        for item in batch.records:
            for message in item.record.messages:
                if not isinstance(message, Batch) or not message.evidence:
                    continue
                for evidence in message.evidence:
                    try:
                        stored += await self._keep(message.job, message.rank, evidence)
                    except Exception:
                        log.exception(
                            "evidence file %s of rank %d not stored", evidence.id, message.rank
                        )
        return stored

    async def _keep(self, job: str, rank: int, evidence: EvidenceFile) -> bool:
        if not _CAPTURE_ID.match(evidence.id) or evidence.name not in FILE_NAMES:
            log.warning(
                "evidence file %r/%r of job %s refused: unknown name",
                evidence.id,
                evidence.name,
                job,
            )
            return False
        if await self._store.evidence_file(evidence.id, rank, evidence.name) is not None:
            return False  # an agent's resend
        error = evidence.error
        data = evidence.data_gzip
        if not error and not data.startswith(_GZIP_MAGIC):
            error = "the file is not gzip data"
        if not error:
            used = await self._store.evidence_bytes(evidence.id)
            if used + len(data) > self.settings.capture_max_bytes:
                error = (
                    f"{len(data)} bytes would take the capture over the aggregator's cap of "
                    f"{self.settings.capture_max_bytes} bytes"
                )
        path: str | None = None
        if not error:
            path = f"{evidence.id}/rank{rank}-{evidence.name}.gz"
            await asyncio.to_thread(self._write, path, data)
        row = EvidenceFileRow(
            capture_id=evidence.id,
            rank=rank,
            name=evidence.name,
            job=job,
            size_bytes=evidence.size_bytes if path else 0,
            stored_bytes=len(data) if path else 0,
            path=path,
            error=error,
            taken_unix_s=evidence.created_unix_ns / 1e9,
            received_unix_s=self._clock(),
        )
        added = await self._store.add_evidence_file(row)
        if not added and path is not None:
            await asyncio.to_thread(self._remove, [path])
        return added

    def _write(self, relative: str, data: bytes) -> None:
        target = self.directory / relative
        ensure_private_dir(self.directory, "evidence folder")
        target.parent.mkdir(mode=0o700, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, target)

    def _remove(self, relatives: Sequence[str]) -> None:
        folders = set()
        for relative in relatives:
            target = self.directory / relative
            target.unlink(missing_ok=True)
            folders.add(target.parent)
        for folder in folders:
            if folder.is_dir() and not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)

    def path(self, row: Row) -> Path | None:
        """Where a file's row says its data is, if it is there."""
        relative = row.get("path")
        if not relative:
            return None
        target = self.directory / relative
        return target if target.is_file() else None

    async def prune(self, now_unix_s: float) -> int:
        """Delete captures past ``retention_s`` and the oldest beyond ``max_bytes``;
        how many files went."""
        gone = await self._store.prune_evidence(
            now_unix_s - self.settings.retention_s, self.settings.max_bytes
        )
        paths = [row["path"] for row in gone if row.get("path")]
        if paths:
            await asyncio.to_thread(self._remove, paths)
        return len(gone)

    async def aclose(self) -> None:
        """Cancel the captures still being asked for; safe twice."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
