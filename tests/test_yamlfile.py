"""Reading small YAML files safely: bounded size, depth and aliases, plain tags only."""

from __future__ import annotations

from pathlib import Path

import pytest

from torshmon import yamlfile
from torshmon.yamlfile import MAX_FILE_BYTES, YamlFileError, compose, construct, read_text


def test_a_plain_file_composes_and_constructs() -> None:
    root = compose("a: [1, 2.5, x, 2024-01-02]\nb: &b {c: true}\nd: *b\n", "f.yaml")
    assert root is not None
    value = construct(root)
    assert isinstance(value, dict) and value["a"][:3] == [1, 2.5, "x"]
    assert value["d"] == {"c": True}
    assert compose("", "f.yaml") is None


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("a: !!python/object/apply:os.system [id]\n", 1, "unsupported YAML tag !!python/"),
        ("a: 1\nb: !!int abc\n", 2, "not a valid !!int value"),
        ("a: " + "[" * 65 + "]" * 65, 1, f"nested deeper than {yamlfile.MAX_DEPTH} levels"),
        ("a: 'x\n\nb: 1\n", 4, "while scanning a quoted scalar (line 1)"),
        ("a: *nothing\n", 1, "found undefined alias"),
    ],
)
def test_each_problem_is_one_line_with_its_line(text: str, line: int, reason: str) -> None:
    with pytest.raises(YamlFileError) as caught:
        compose(text, "f.yaml")
    message = str(caught.value)
    assert message.startswith(f"f.yaml:{line}: ") and reason in message
    assert "\n" not in message


def test_aliases_count_again_each_time_they_are_used() -> None:
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for used, name in ("ab", "bc", "cd"):
        levels.append(f"{name}: &{name} [{', '.join([f'*{used}'] * 10)}]")
    compose("\n".join(levels), "f.yaml")  # about 11 000 values
    levels.append(f"e: [{', '.join(['*d'] * 10)}]")  # about 110 000
    with pytest.raises(YamlFileError, match="more than 100000 values"):
        compose("\n".join(levels), "f.yaml")


def test_read_text_stops_at_the_size_bound(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"a: 1\n" * (MAX_FILE_BYTES // 5 + 1))
    with pytest.raises(YamlFileError, match=r"big.yaml:\d+: the file is larger than 1 MiB"):
        read_text(path)
    with pytest.raises(YamlFileError, match="cannot read the file"):
        read_text(tmp_path / "missing.yaml")
