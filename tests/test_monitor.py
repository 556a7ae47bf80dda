"""The probe's Monitor apart from a running job (tests/integration/test_probe.py runs it)."""

from __future__ import annotations

import pytest

from torshmon.probe.monitor import default_job_name, env_flag


def test_the_job_is_named_by_torshmon_then_torchrun_then_default() -> None:
    run = {"TORCHELASTIC_RUN_ID": "train-42"}
    assert default_job_name({"TORSHMON_JOB": "mine", **run}) == "mine"
    assert default_job_name(run) == "train-42"
    # torchrun's own default, where no --rdzv-id was given, names nothing.
    assert default_job_name({"TORCHELASTIC_RUN_ID": "none"}) == "default"
    assert default_job_name({}) == "default"
    assert default_job_name({"TORSHMON_JOB": "", "TORCHELASTIC_RUN_ID": ""}) == "default"


def test_an_option_from_the_environment_reads_the_usual_words_and_refuses_others() -> None:
    name = "TORSHMON_FAST_LANE"
    for word in ("1", "true", "YES", " on "):
        assert env_flag(name, {name: word}) is True
    for word in ("0", "False", "no", "OFF"):
        assert env_flag(name, {name: word}) is False
    # Unset or empty: the default.
    assert env_flag(name, {}) is True
    assert env_flag(name, {name: ""}, default=False) is False
    with pytest.raises(ValueError, match=r"^\$TORSHMON_FAST_LANE must be 1 or 0 .* got '2'$"):
        env_flag(name, {name: "2"})
