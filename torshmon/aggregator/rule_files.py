"""Rule files from disk and the ``torshmon rules`` commands: the shell around the core's parser.

The core (``torshmon.aggregator.core.rule_file``) parses and validates rule text; this module
reads the text (a user's file, or the ``default_rules.yaml`` shipped in the core's package)
and prints what ``torshmon rules check`` and ``torshmon rules export`` report.
"""

from __future__ import annotations

import os
import sys
from importlib import resources

from torshmon import yamlfile
from torshmon.aggregator.core.promrules import FORMATS, to_prometheus
from torshmon.aggregator.core.rule_file import load_rules_text
from torshmon.aggregator.core.rules import RuleError, RuleSet


def default_rules() -> RuleSet:
    """The rules shipped with torshmon (``default_rules.yaml``, the documented defaults)."""
    shipped = resources.files("torshmon.aggregator.core").joinpath("default_rules.yaml")
    text = shipped.read_text("utf-8")
    return load_rules_text(text, source="default_rules.yaml")


def load_rules(path: str | os.PathLike[str]) -> RuleSet:
    """Load and validate a rule file; RuleError lists every mistake with file and line.

    Size, nesting and tags are bounded as ``torshmon.yamlfile`` says.
    """
    try:
        text = yamlfile.read_text(path, what="rule file")
    except yamlfile.YamlFileError as exc:
        raise RuleError([str(exc)]) from None
    return load_rules_text(text, source=os.fspath(path))


def check_rules_cli(path: str) -> int:
    """``torshmon rules check FILE``: prints ``OK: N rules`` (exit 0) or every error to
    stderr (exit 1)."""
    try:
        ruleset = load_rules(path)
    except RuleError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    print(f"OK: {len(ruleset)} rules")
    return 0


def export_rules_cli(path: str | None, fmt: str) -> int:
    """``torshmon rules export --format prometheus [FILE]``: the translated rule file on
    stdout (the default rules without FILE); errors on stderr with exit 1."""
    if fmt not in FORMATS:
        print(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}", file=sys.stderr)
        return 1
    try:
        ruleset = default_rules() if path is None else load_rules(path)
    except RuleError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    sys.stdout.write(to_prometheus(ruleset))
    return 0
