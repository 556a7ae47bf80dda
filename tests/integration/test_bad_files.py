"""Bad rule files, config files and token files, given to the real command line: each
is one ``file:line: reason`` line on stderr and a non-zero exit, never a traceback,
and the process stays within a small memory limit whatever the file holds."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: Address space for `torshmon rules check` and for the aggregator as far as it reads
#: its config: far below what a width of 999999999 or a YAML bomb would take.
MEMORY_LIMIT_BYTES = 1 << 30

#: YAML every file reader must survive: (name, content, line of the error, reason).
BAD_YAML: list[tuple[str, str | bytes, int, str]] = [
    ("python-tag", "rules:\n  - name: !!python/name:os.system\n", 2, "unsupported YAML tag"),
    ("custom-tag", "rules: !include other.yaml\n", 1, "unsupported YAML tag !include"),
    ("bad-indent", "rules:\n  - name: a\n     kind: hang\n", 3, "invalid YAML"),
    ("unclosed-quote", 'rules:\n  - name: "a\n    kind: hang\n', 4, "quoted scalar (line 2)"),
    ("tab", "rules:\n\t- name: a\n", 2, "invalid YAML"),
    ("huge-line", "rules: " + "x" * 10_000_000 + "\n", 1, "larger than 1 MiB"),
    ("deep-flow", "rules: " + "[" * 100_000 + "]" * 100_000, 1, "nested deeper than 64"),
    ("deep-block", "".join("  " * i + "-\n" for i in range(200)), 65, "nested deeper than 64"),
    (
        "alias-bomb",
        "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n"
            for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        1,
        "more than 100000 values",
    ),
    ("long-int", "rules: " + "9" * 5000 + "\n", 1, "not a valid !!int value"),
    ("not-utf8", b"rules:\n  - name: \xff\xfe\n", 2, "not UTF-8"),
    ("two-documents", "rules: []\n---\nrules: []\n", 2, "single document"),
]

BAD_RULES: list[tuple[str, str, int, str]] = [
    ("top-level-list", "- name: a\n  kind: hang\n", 1, "expected a mapping"),
    ("top-level-scalar", "just text\n", 1, "expected a mapping"),
    ("unknown-top-key", "rulez: []\n", 1, "rulez: unknown key"),
    ("unknown-rule-key", "rules:\n  - name: a\n    kind: hang\n    fro: 1m\n", 4, "unknown key"),
    (
        "huge-width",
        'rules:\n  - name: a\n    kind: hang\n    annotations:\n      summary: "{job:999999999}"\n',
        5,
        "width above 100",
    ),
    (
        "huge-precision",
        "rules:\n  - name: a\n    kind: threshold\n    metric: loss\n    op: '>'\n"
        "    value: 1\n    annotations:\n      summary: '{value:.999999999f}'\n",
        8,
        "precision above 100",
    ),
]

BAD_CONFIGS: list[tuple[str, str, int, str]] = [
    ("config-list", "- port: 1\n", 1, "expected a mapping of settings"),
    ("config-unknown-key", "port: 9470\nprot: 1\n", 2, "unknown setting 'prot'"),
    ("config-bad-value", "port: 9470\neval_interval_s: soon\n", 2, "must be a float"),
]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torshmon.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_memory,
        env={**os.environ, **(env or {})},
    )


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / f"{name}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _assert_one_line(
    done: subprocess.CompletedProcess[str], code: int, where: str, reason: str
) -> None:
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert where in lines[0] and reason in lines[0], lines[0]
    assert len(lines[0]) < 1000


@pytest.mark.parametrize(
    ("name", "content", "line", "reason"), BAD_YAML + BAD_RULES, ids=lambda v: str(v)[:20]
)
def test_rules_check_reports_a_bad_rule_file_in_one_line(
    tmp_path: Path, name: str, content: str | bytes, line: int, reason: str
) -> None:
    path = _write(tmp_path, name, content)
    done = _cli("rules", "check", str(path))
    _assert_one_line(done, 1, f"{path}:{line}: ", reason)


@pytest.mark.parametrize(
    ("name", "content", "line", "reason"), BAD_YAML + BAD_CONFIGS, ids=lambda v: str(v)[:20]
)
def test_the_aggregator_reports_a_bad_config_file_in_one_line(
    tmp_path: Path, name: str, content: str | bytes, line: int, reason: str
) -> None:
    path = _write(tmp_path, name, content)
    done = _cli("aggregator", "--config", str(path), "--port", "0")
    _assert_one_line(done, 2, f"torshmon aggregator: {path}:{line}: ", reason)


BAD_AGENT_CONFIGS: list[tuple[str, str, int, str]] = [
    ("agent-list", "- metrics_port: 1\n", 1, "expected a mapping of settings"),
    ("agent-unknown-key", "node: n\nprot: 1\n", 2, "unknown setting 'prot'"),
    ("agent-bad-duration", "sample_interval_s: soon\n", 1, "must be a float"),
    ("agent-bad-size", "node: n\nspool_max_bytes: 1k\n", 2, "spool_max_bytes must be >= 1048576"),
]


@pytest.mark.parametrize(
    ("name", "content", "line", "reason"), BAD_YAML + BAD_AGENT_CONFIGS, ids=lambda v: str(v)[:20]
)
def test_the_agent_reports_a_bad_config_file_in_one_line(
    tmp_path: Path, name: str, content: str | bytes, line: int, reason: str
) -> None:
    path = _write(tmp_path, name, content)
    done = _cli("agent", "--config", str(path), "--metrics-port", "0")
    _assert_one_line(done, 2, f"torshmon agent: {path}:{line}: ", reason)


def test_the_aggregator_reports_a_bad_rule_file_in_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "rules", "rules:\n  - name: !!python/object/apply:os.system [id]\n")
    done = _cli("aggregator", "--rules", str(path), "--port", "0", "--db", "sqlite://")
    _assert_one_line(done, 2, f"{path}:2: ", "unsupported YAML tag")


@pytest.mark.parametrize("command", ["agent", "aggregator", "tune"])
@pytest.mark.parametrize("content", ["", " \n\t\n"])
def test_an_empty_token_file_is_an_error_at_start(
    tmp_path: Path, command: str, content: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    args = ["tune", "job"] if command == "tune" else [command]
    done = _cli(*args, "--token-file", str(token_file))
    _assert_one_line(done, 2, f"torshmon {command}: --token-file {token_file}", "is empty")


@pytest.mark.parametrize("command", ["agent", "aggregator"])
def test_a_blank_token_variable_is_an_error_at_start(command: str) -> None:
    done = _cli(command, env={"TORSHMON_TOKEN": " "})
    _assert_one_line(done, 2, f"torshmon {command}: ", "TORSHMON_TOKEN is set but empty")
