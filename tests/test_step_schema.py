"""The step's fields have one definition, the ``steps`` model; the wire record, the
ingest's rows and sample count, and the report's reads are derived from it or checked
against it, so that a field added in one place only fails here (or at import)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from torshmon.aggregator.ingest import (
    _STEPS,
    STEP_FIELDS_ELSEWHERE,
    STEP_SAMPLE_FIELDS,
    _BulkTable,
)
from torshmon.history.models import Base
from torshmon.history.store.report import OPTIONAL_STEP_COLUMNS, STEP_COLUMNS
from torshmon.report import series as report_series
from torshmon.wire import StepRecord

STEPS = Base.metadata.tables["steps"]
#: The columns ingest fills from the batch (job, rank, node), not from the step record.
CONTEXT = _STEPS.columns[: -len(_STEPS.record_columns)]


def _record_like(*, without: str = "", extra: str = "") -> type[msgspec.Struct]:
    """A wire step record that lacks the field ``without`` or has one more, ``extra``."""
    fields: list[Any] = [(f, Any, None) for f in StepRecord.__struct_fields__ if f != without]
    if extra:
        fields.append((extra, float | None, None))
    return msgspec.defstruct("StepRecord", fields, kw_only=True)


def test_the_wire_record_and_the_model_agree_as_they_are() -> None:
    table = _BulkTable("steps", CONTEXT, StepRecord, elsewhere=STEP_FIELDS_ELSEWHERE)
    wire = set(StepRecord.__struct_fields__)
    assert set(table.record_columns) == wire - set(STEP_FIELDS_ELSEWHERE)
    assert {"eval_s", "between_steps_comm_s"} <= set(table.record_columns)


def test_a_field_added_to_the_wire_only_fails() -> None:
    with pytest.raises(RuntimeError, match=r"neither columns nor stored elsewhere \['warmup_s'\]"):
        _BulkTable(
            "steps", CONTEXT, _record_like(extra="warmup_s"), elsewhere=STEP_FIELDS_ELSEWHERE
        )


def test_a_column_added_to_the_model_only_fails() -> None:
    # A column the wire record lacks is one the model has and the wire has not.
    with pytest.raises(RuntimeError, match=r"columns the wire record lacks \['eval_s'\]"):
        _BulkTable(
            "steps", CONTEXT, _record_like(without="eval_s"), elsewhere=STEP_FIELDS_ELSEWHERE
        )


def test_a_field_said_to_go_elsewhere_that_is_a_column_fails() -> None:
    elsewhere = {**STEP_FIELDS_ELSEWHERE, "eval_s": "rows of evaluations"}
    with pytest.raises(RuntimeError, match=r"columns or not fields \['eval_s'\]"):
        _BulkTable("steps", CONTEXT, StepRecord, elsewhere=elsewhere)


def test_every_measured_column_is_a_sample() -> None:
    """The sample count follows the model: its seconds, ratios, rates, loss and bytes
    (every Float column, the byte counts among the integers) are counted."""
    floats = {c.name for c in STEPS.columns if c.type.python_type is float}
    assert floats <= set(STEP_SAMPLE_FIELDS)
    assert {"eval_s", "between_steps_comm_s", "gpu_memory_peak_bytes"} <= set(STEP_SAMPLE_FIELDS)
    assert not {"step", "end_unix_ns", "config_version", "batch_size"} & set(STEP_SAMPLE_FIELDS)


def test_the_report_reads_columns_of_the_model_and_computes_with_what_it_read() -> None:
    """A name the store reads that is not a column fails the query; a field the report
    computes with that the store does not read would be NaN on every page, silently."""
    read = [*STEP_COLUMNS, *OPTIONAL_STEP_COLUMNS]
    assert set(read) <= set(STEPS.c.keys()), set(read) - set(STEPS.c.keys())
    used = set(report_series._STEP_FIELDS)
    assert used <= set(read), used - set(read)
