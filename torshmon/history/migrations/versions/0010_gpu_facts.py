"""GPU facts: power, temperature, throttle reasons, ECC and Xid errors per GPU sample;
CUDA memory (allocated, reserved, peak) per step.

Revision ID: 0010
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_GPU_COLUMNS = (
    ("power_watts", sa.Float(), True, "Board power draw, watts."),
    ("temperature_celsius", sa.Float(), True, "GPU core temperature, degrees Celsius."),
    (
        "throttle_reasons",
        sa.BigInteger(),
        True,
        "NVML bitmask of clock event (throttle) reasons active; 0 none.",
    ),
    (
        "ecc_uncorrected_errors_total",
        sa.BigInteger(),
        True,
        "Uncorrected ECC errors since the driver loaded (NULL: no ECC).",
    ),
    (
        "xid_errors_total",
        sa.BigInteger(),
        True,
        "Xid errors the agent has seen on this GPU since it started.",
    ),
    ("last_xid", sa.BigInteger(), True, "Latest Xid code seen; 0 none."),
)
_STEP_COLUMNS = (
    (
        "gpu_memory_allocated_bytes",
        "CUDA memory allocated at the step's end, bytes (NULL off CUDA).",
    ),
    ("gpu_memory_reserved_bytes", "CUDA memory reserved by the caching allocator, bytes."),
    ("gpu_memory_peak_bytes", "Peak CUDA memory allocated since start or the job's reset, bytes."),
)


def upgrade() -> None:
    # Nullable: rows from agents before these fields (and other writers) have none.
    with op.batch_alter_table("gpu_samples") as batch:
        for name, type_, nullable, comment in _GPU_COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=nullable, comment=comment))
    with op.batch_alter_table("steps") as batch:
        for name, comment in _STEP_COLUMNS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True, comment=comment))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for name, _comment in reversed(_STEP_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("gpu_samples") as batch:
        for name, *_rest in reversed(_GPU_COLUMNS):
            batch.drop_column(name)
