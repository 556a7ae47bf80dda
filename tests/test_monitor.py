"""The probe's Monitor apart from a running job (tests/integration/test_probe.py runs it)."""

from __future__ import annotations

from torshmon.probe.monitor import default_job_name


def test_the_job_is_named_by_torshmon_then_torchrun_then_default() -> None:
    run = {"TORCHELASTIC_RUN_ID": "train-42"}
    assert default_job_name({"TORSHMON_JOB": "mine", **run}) == "mine"
    assert default_job_name(run) == "train-42"
    # torchrun's own default, where no --rdzv-id was given, names nothing.
    assert default_job_name({"TORCHELASTIC_RUN_ID": "none"}) == "default"
    assert default_job_name({}) == "default"
    assert default_job_name({"TORSHMON_JOB": "", "TORCHELASTIC_RUN_ID": ""}) == "default"
