"""Downsampled history and the progress of the retention job."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    Base,
    _table,
)


class Rollup(Base):
    __tablename__ = "rollups"
    __table_args__ = _table(
        "Raw measurements downsampled into fixed time buckets (see ROLLUP_SOURCES)."
    )

    key: Mapped[str] = mapped_column(
        String(200), primary_key=True, comment="Job name, or node name for node metrics."
    )
    rank: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Global rank; -1 for a node."
    )
    metric: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Source column (duration_s, ...)."
    )
    resolution_s: Mapped[int] = mapped_column(
        Integer, primary_key=True, autoincrement=False, comment="Bucket width, seconds."
    )
    bucket_start_unix_s: Mapped[int] = mapped_column(
        BigInteger,
        primary_key=True,
        autoincrement=False,
        comment="Start of the bucket, Unix time in seconds.",
    )
    count: Mapped[int] = mapped_column(BigInteger, comment="Non-NULL values in the bucket.")
    sum: Mapped[float] = mapped_column(Float, comment="Sum of the values, in the metric's unit.")
    min: Mapped[float] = mapped_column(Float, comment="Smallest value, in the metric's unit.")
    max: Mapped[float] = mapped_column(Float, comment="Largest value, in the metric's unit.")


class RetentionState(Base):
    __tablename__ = "retention_state"
    __table_args__ = _table("Progress of the retention job.")

    name: Mapped[str] = mapped_column(
        String(64), primary_key=True, comment="Watermark name (rollup:<table>:<resolution>)."
    )
    watermark_unix_s: Mapped[float] = mapped_column(
        Float, comment="Everything before this is done, Unix time in seconds."
    )


@dataclass(frozen=True, slots=True)
class RollupSource:
    """Which columns of a raw table are rolled up, and how a row is keyed and timed.

    ``rank_column`` None means node-level rows (rank -1); ``time_column`` is Unix ns.
    """

    table: str
    key_column: str
    rank_column: str | None
    time_column: str
    metrics: tuple[str, ...]


#: Raw tables whose measurements ``apply_retention`` rolls up, by table name.
ROLLUP_SOURCES: Final[Mapping[str, RollupSource]] = MappingProxyType(
    {
        "steps": RollupSource(
            table="steps",
            key_column="job",
            rank_column="rank",
            time_column="end_unix_ns",
            metrics=(
                "duration_s",
                "comm_wait_s",
                "compute_s",
                "communication_time_ratio",
                "samples_per_s",
                "loss",
            ),
        ),
        "node_samples": RollupSource(
            table="node_samples",
            key_column="node",
            rank_column=None,
            time_column="ts_unix_ns",
            metrics=("cpu_utilization_ratio", "memory_utilization_ratio", "io_wait_ratio"),
        ),
    }
)
