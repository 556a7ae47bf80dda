"""The command line's parsing and output, in process; tests/integration/test_cli.py runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torshmon.cli import build_parser, trial_line


def test_global_flags_are_taken_before_and_after_the_command() -> None:
    parser = build_parser()
    for argv in (["-v", "agent"], ["agent", "-v"], ["-v", "agent", "-v"]):
        assert parser.parse_args(argv).verbose is True, argv
    assert parser.parse_args(["agent"]).verbose is False
    for argv in (["--config", "a.yaml", "aggregator"], ["aggregator", "--config", "a.yaml"]):
        assert parser.parse_args(argv).config == Path("a.yaml"), argv
    assert parser.parse_args(["db", "upgrade", "-v"]).verbose is True
    assert parser.parse_args(["rules", "check", "-v", "f.yaml"]).verbose is True


def test_version_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("torshmon ")


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_variables_each_command_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert "TORSHMON_TOKEN_FILE" in _help(capsys)
    tune = _help(capsys, "tune")
    assert "TORSHMON_AGGREGATOR_URL" in tune and "TORSHMON_TOKEN, TORSHMON_TOKEN_FILE" in tune
    assert "TORSHMON_DB_URL" in _help(capsys, "query") and "path" in _help(capsys, "query")
    assert "TORSHMON_DB_URL" in _help(capsys, "db", "upgrade")


TRIAL: dict[str, Any] = {
    "trial_index": 2,
    "config": {
        "bucket_cap_mb": 4.0,
        "first_bucket_cap_mb": 4.0,
        "codec": "powersgd",
        "codec_params": {"rank": 4},
    },
    "decision": "worse",
    "score": 684.2,
    "reason": "slower than the incumbent (p=0.004)",
}


def test_a_trial_line_carries_the_codec_parameters_and_the_unit() -> None:
    assert trial_line(TRIAL, "samples/s per rank") == (
        "trial 2: powersgd rank 4, bucket 4 MB: worse: 684.2 samples/s per rank"
        " - slower than the incumbent (p=0.004)"
    )
    first = {**TRIAL, "config": {**TRIAL["config"], "first_bucket_cap_mb": 1.0}}
    assert "bucket 4 MB (first 1 MB)" in trial_line(first, "steps/s")
    unscored = {
        **TRIAL,
        "score": None,
        "reason": "",
        "config": {"codec": "fp16", "bucket_cap_mb": 25},
    }
    assert trial_line(unscored, "steps/s") == "trial 2: fp16, bucket 25 MB: worse"


def test_a_missing_dependency_is_named_on_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An install without its dependencies (``pip install --no-deps``, ``--target``):
    ``torshmon query`` says which package is missing, not a traceback."""
    import sys

    from torshmon.cli import main

    for name in list(sys.modules):
        if name.partition(".")[0] == "sqlalchemy" or name.startswith("torshmon.history"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # import sqlalchemy now fails
    code = main(["query", "--db", str(tmp_path / "history.db"), "SELECT 1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("torshmon query: needs the Python package 'sqlalchemy'"), err
