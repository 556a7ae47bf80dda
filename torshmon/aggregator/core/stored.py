"""What one ingest stored: the new messages the live state, the tuner and exporters read.

``IngestStore.store`` returns a ``Stored``; the ingest process sends back only a
``StoreSummary`` and the aggregator ``rebuild``s the ``Stored`` from the batch it posted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Final

from torshmon.wire import Batch, Command, CommandAck, Hello, IngestBatch, NodeSample


@dataclass(slots=True)
class Stored:
    """What one ``store`` call took in: the new data for the live state, in order."""

    acked_seq: int
    hellos: list[Hello] = field(default_factory=list)
    batches: list[tuple[Batch, str]] = field(default_factory=list)  # (batch, node)
    node_samples: list[NodeSample] = field(default_factory=list)
    command_acks: list[CommandAck] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    duplicates: int = 0  # records and probe batches seen before
    records: int = 0  # new agent records stored
    samples: int = 0
    #: Positions in the ``IngestBatch`` of what was seen before: records, and probe
    #: batches (record, message) of new records. ``rebuild`` needs no more than these.
    skipped_records: list[int] = field(default_factory=list)
    skipped_batches: list[tuple[int, int]] = field(default_factory=list)

    def summary(self) -> StoreSummary:
        """What ``rebuild`` needs besides the ``IngestBatch``: small, to send back from
        the ingest process."""
        return StoreSummary(**{name: getattr(self, name) for name in _SUMMARY_FIELDS})


@dataclass(frozen=True, slots=True)
class StoreSummary:
    """``Stored`` without the messages, which the ``IngestBatch`` holds."""

    acked_seq: int
    commands: list[Command]
    duplicates: int
    records: int
    samples: int
    skipped_records: list[int]
    skipped_batches: list[tuple[int, int]]


#: The fields ``Stored`` and ``StoreSummary`` share: all of the summary's.
_SUMMARY_FIELDS: Final = tuple(f.name for f in fields(StoreSummary))


def rebuild(batch: IngestBatch, summary: StoreSummary) -> Stored:
    """The ``Stored`` that ``IngestStore.store(batch)`` returned with ``summary``: its
    new messages taken from ``batch`` in the same order."""
    stored = Stored(**{name: getattr(summary, name) for name in _SUMMARY_FIELDS})
    skipped_records = set(summary.skipped_records)
    skipped_batches = set(summary.skipped_batches)
    node = batch.node
    for i, item in enumerate(batch.records):
        if i in skipped_records:
            continue
        for j, message in enumerate(item.record.messages):
            if isinstance(message, Hello):
                stored.hellos.append(message)
            elif (i, j) not in skipped_batches:
                stored.batches.append((message, node))
                stored.command_acks.extend(message.command_acks)
        stored.node_samples.extend(item.record.node_samples)
    return stored


__all__ = ["StoreSummary", "Stored", "rebuild"]
