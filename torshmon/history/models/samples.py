"""Node, GPU and rank samples from the agent."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    Index,
    Integer,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from torshmon.history.models._base import (
    Base,
    _surrogate_id,
    _table,
)


class NodeSample(Base):
    __tablename__ = "node_samples"
    __table_args__ = _table("One sample of a node by its agent.", Index(None, "node", "ts_unix_ns"))

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    cpu_utilization_ratio: Mapped[float | None] = mapped_column(
        Float, comment="CPU busy since the previous sample, ratio 0..1."
    )
    memory_utilization_ratio: Mapped[float | None] = mapped_column(
        Float, comment="Memory in use, ratio 0..1."
    )
    memory_used_bytes: Mapped[int] = mapped_column(BigInteger, comment="Memory in use, bytes.")
    io_wait_ratio: Mapped[float | None] = mapped_column(
        Float, comment="CPU time waiting on I/O since the previous sample, ratio 0..1."
    )
    net_rx_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes received since boot (counter)."
    )
    net_tx_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes sent since boot (counter)."
    )
    disk_read_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes read from disk since boot (counter)."
    )
    disk_write_bytes_total: Mapped[int] = mapped_column(
        BigInteger, comment="Bytes written to disk since boot (counter)."
    )


class GpuSample(Base):
    __tablename__ = "gpu_samples"
    __table_args__ = _table("One sample of one GPU of a node (NVML).")

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    gpu_index: Mapped[int] = mapped_column(BigInteger, comment="NVML device index.")
    utilization_ratio: Mapped[float | None] = mapped_column(Float, comment="GPU busy, ratio 0..1.")
    memory_used_bytes: Mapped[int] = mapped_column(BigInteger, comment="GPU memory in use, bytes.")
    memory_total_bytes: Mapped[int] = mapped_column(BigInteger, comment="GPU memory, bytes.")
    power_watts: Mapped[float | None] = mapped_column(Float, comment="Board power draw, watts.")
    temperature_celsius: Mapped[float | None] = mapped_column(
        Float, comment="GPU core temperature, degrees Celsius."
    )
    throttle_reasons: Mapped[int | None] = mapped_column(
        BigInteger, comment="NVML bitmask of clock event (throttle) reasons active; 0 none."
    )
    ecc_uncorrected_errors_total: Mapped[int | None] = mapped_column(
        BigInteger, comment="Uncorrected ECC errors since the driver loaded (NULL: no ECC)."
    )
    xid_errors_total: Mapped[int | None] = mapped_column(
        BigInteger, comment="Xid errors the agent has seen on this GPU since it started."
    )
    last_xid: Mapped[int | None] = mapped_column(
        BigInteger, comment="Latest Xid code seen; 0 none."
    )


class RankSample(Base):
    __tablename__ = "rank_samples"
    __table_args__ = _table(
        "One sample of a training process by its node's agent.",
        Index(None, "job", "rank", "ts_unix_ns"),
    )

    id: Mapped[int] = _surrogate_id()
    node: Mapped[str] = mapped_column(String(200), comment="Host name of the node.")
    ts_unix_ns: Mapped[int] = mapped_column(
        BigInteger, comment="Sample time, Unix time in nanoseconds."
    )
    job: Mapped[str] = mapped_column(String(200), comment="Job name.")
    rank: Mapped[int] = mapped_column(Integer, comment="Global rank.")
    pid: Mapped[int] = mapped_column(BigInteger, comment="Process id on the node.")
    rss_bytes: Mapped[int] = mapped_column(BigInteger, comment="Resident set size, bytes.")
