"""Per-job caps on probe-supplied label values (``torshmon.labels``)."""

from __future__ import annotations

import pytest

from torshmon.labels import OTHER, LabelCap


def test_values_past_the_cap_fold_into_other_and_are_counted_per_job_and_label() -> None:
    cap = LabelCap(max_values=2)
    assert [cap.value("a", "codec", c) for c in ("fp16", "bf16", "int8", "fp16", "topk")] == [
        "fp16",
        "bf16",
        OTHER,
        "fp16",
        OTHER,
    ]
    assert cap.value("b", "codec", "int8") == "int8"  # another job has its own values
    assert cap.folded() == [("a", "codec", 2)]


def test_collectives_cap_each_label_and_the_pairs() -> None:
    cap = LabelCap(max_values=3, max_collectives=4)
    kept = [cap.collective("j", op, pg) for op in ("o1", "o2", "o3", "o4") for pg in ("p1", "p2")]
    assert kept[:4] == [("o1", "p1"), ("o1", "p2"), ("o2", "p1"), ("o2", "p2")]
    # Past four pairs the group folds; past three ops the op does.
    assert kept[4:] == [("o3", OTHER), ("o3", OTHER), (OTHER, "p1"), (OTHER, "p2")]
    assert cap.collective("j", "o1", "p2") == ("o1", "p2")  # a kept pair stays kept
    assert dict(((label, n) for _, label, n in cap.folded())) == {"op": 2, "pg": 2}


def test_forget_drops_a_jobs_values_and_counts() -> None:
    cap = LabelCap(max_values=1)
    cap.value("j", "op", "a")
    cap.value("j", "op", "b")
    cap.forget("j")
    assert cap.folded() == []
    assert cap.value("j", "op", "b") == "b"


def test_caps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        LabelCap(max_values=0)
