"""The command line's parsing and output, in process; tests/integration/test_cli.py runs it."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
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


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the command tree with its words after ``torshmon``."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))


def test_every_help_ends_with_examples_that_parse(capsys: pytest.CaptureFixture[str]) -> None:
    from torshmon.faults import parse_fault

    commands = dict(_commands(build_parser()))
    assert {"demo", "report", "tune", "alerts ack", "silence add", "db upgrade"} <= {
        " ".join(words) for words in commands
    }
    for words in commands:
        text = _help(capsys, *words)
        assert "\nexamples:\n" in text, words
        block = text.split("\nexamples:\n")[1].split("\n\n")[0]
        examples = [line.strip() for line in block.splitlines()]
        assert examples, words
        for example in examples:
            argv = shlex.split(example)
            assert argv[: len(words) + 1] == ["torshmon", *words], example
            if argv[1:] == ["aggregator", "--help"]:
                continue
            args = build_parser().parse_args(argv[1:])  # SystemExit(2) if it does not parse
            for spec in getattr(args, "inject", []):
                parse_fault(spec)  # FaultError if the example's fault is not one


#: The commands that talk to an aggregator, with what else they need to parse.
URL_COMMANDS = [
    ["agent"],
    ["report", "job"],
    ["tune", "job"],
    ["alerts", "list"],
    ["alerts", "ack", "1"],
    ["silence", "add", "job=j", "--for", "1h"],
    ["silence", "list"],
    ["silence", "expire", "1"],
]


@pytest.mark.parametrize("argv", URL_COMMANDS, ids=" ".join)
def test_the_aggregator_url_has_one_name_everywhere(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    for flag in ("--aggregator", "--url"):  # --url: a hidden alias, as tune once took it
        args = parser.parse_args([*argv, flag, "http://h:1"])
        assert args.aggregator == "http://h:1", (argv, flag)
    words = argv[:2] if argv[0] in ("alerts", "silence") else argv[:1]
    text = _help(capsys, *words)
    assert "--aggregator URL" in text and "--url" not in text, text


def test_user_mistakes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torshmon.cli import main

    db = str(tmp_path / "h.db")
    assert main(["db", "upgrade", "--db", db]) == 0
    capsys.readouterr()
    for sql, says in (
        ("SELECT nope FROM steps", "no such column: nope"),
        ("DELETE FROM steps", "refused"),
    ):
        assert main(["query", "--db", db, sql]) == 2, sql
        err = capsys.readouterr().err
        assert err.startswith("torshmon query: ") and err.count("\n") == 1, err
        assert says in err, err
