"""The declarative base of every history table, its naming convention, and the helpers
the table modules share (allowed values, table comment, surrogate key)."""

from __future__ import annotations

from typing import Any, Final, get_args

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Identity,
    Integer,
    MetaData,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from torshmon.aggregator.core.alert import AlertState
from torshmon.aggregator.core.findings import FindingKind

#: Surrogate key type: SQLite's INTEGER PRIMARY KEY is its rowid (fast); PostgreSQL bigint.
ID_TYPE: Final = BigInteger().with_variant(Integer, "sqlite")

COMMAND_STATUSES: Final[tuple[str, ...]] = (
    "pending",
    "sent",
    "accepted",
    "rejected",
    "applied",
    "expired",
)
ALERT_STATES: Final[tuple[str, ...]] = get_args(AlertState)
FINDING_KINDS: Final[tuple[str, ...]] = get_args(FindingKind)

#: The comment of every ``run_id`` column of the rows that belong to one launch.
RUN_ID_COMMENT: Final = (
    "The run (launch) of the job the row belongs to (runs.run_id); NULL where its probe "
    "sent no run id."
)
#: The comment of the ``run_id`` of rows the aggregator writes for a job (commands,
#: tuning, evidence): the run it ran when the row was made.
JOB_RUN_COMMENT: Final = (
    "The run (launch) of the job the row was made in (runs.run_id): the job's latest "
    "then, a tuning session's and its trials' the run it started in; NULL where none."
)

# Named constraints and indexes make migrations reproducible across backends.
NAMING_CONVENTION: Final[dict[str, str]] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _one_of(column: str, values: tuple[str, ...]) -> CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({allowed})", name=column)


def _table(comment: str, *items: Any) -> tuple[Any, ...]:
    return (*items, {"comment": comment})


def _surrogate_id() -> Mapped[int]:
    # Identity: PostgreSQL gets a bigint identity column; SQLite ignores it (rowid alias).
    return mapped_column(ID_TYPE, Identity(), primary_key=True, comment="Surrogate key.")


class Base(DeclarativeBase):
    """Declarative base of every history table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
