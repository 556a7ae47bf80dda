"""Small YAML files that people write (rule files, the aggregator's config), read safely.

Bounded before anything is built: the file's size, the nesting depth (PyYAML's
composer recurses once per level) and the nodes reached through aliases (a few
aliases can stand for billions of nodes). Only the plain YAML tags are allowed
(``!!python/name:os.system`` is refused, not constructed). Every problem is one
``YamlFileError`` whose text is a single ``file:line: reason`` line.
"""

from __future__ import annotations

import os
from typing import Final

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "YamlFileError",
    "compose",
    "construct",
    "read_text",
]

MAX_FILE_BYTES: Final = 1024 * 1024
MAX_DEPTH: Final = 64
MAX_NODES: Final = 100_000
_YAML_TAG_PREFIX: Final = "tag:yaml.org,2002:"


class YamlFileError(ValueError):
    """A YAML file that cannot be used; the text is ``file:line: reason``."""

    def __init__(self, source: str, line: int, reason: str) -> None:
        self.source = source
        self.line = line
        self.reason = " ".join(reason.split())  # one line, whatever the parser said
        super().__init__(f"{source}:{line}: {self.reason}")


def read_text(path: str | os.PathLike[str], *, what: str = "file") -> str:
    """The UTF-8 text of ``path``, at most MAX_FILE_BYTES; YamlFileError otherwise."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise YamlFileError(source, 1, f"cannot read the {what}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        line = data.count(b"\n", 0, MAX_FILE_BYTES) + 1
        raise YamlFileError(source, line, f"the {what} is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise YamlFileError(source, line, f"the {what} is not UTF-8 text") from None


def compose(text: str, source: str) -> Node | None:
    """The YAML node tree of ``text`` (None for an empty document), checked as the
    module says. Nodes keep their line numbers (``node.start_mark.line``, 0-based)."""
    if len(text) > MAX_FILE_BYTES:
        raise YamlFileError(source, 1, f"larger than {MAX_FILE_BYTES >> 20} MiB")
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise YamlFileError(source, *_where_and_why(exc)) from None
    except yaml.YAMLError as exc:
        raise YamlFileError(source, 1, f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if root is not None:
        _check_nodes(root, source)
    return root


def construct(node: Node) -> object:
    """The Python value of a node from ``compose`` (plain tags only, so this is safe)."""
    return SafeConstructor().construct_object(node, deep=True)


def _where_and_why(exc: yaml.MarkedYAMLError) -> tuple[int, str]:
    """The line of a parser's error and its reason, context first ("while scanning
    a quoted scalar (line 1), found unexpected end of stream")."""
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else 1
    reasons = []
    if exc.context:
        context_line = exc.context_mark.line + 1 if exc.context_mark is not None else line
        reasons.append(exc.context + (f" (line {context_line})" if context_line != line else ""))
    if exc.problem:
        reasons.append(exc.problem)
    return line, "invalid YAML: " + (", ".join(reasons) or "cannot be parsed")


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops composing beyond MAX_DEPTH levels of nesting."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_nodes(root: Node, source: str) -> None:
    """Plain tags only, and at most MAX_NODES nodes counting each alias again."""
    pending = [root]
    seen = 0
    constructor = SafeConstructor()
    while pending:
        node = pending.pop()
        seen += 1
        if seen > MAX_NODES:
            raise YamlFileError(
                source,
                node.start_mark.line + 1,
                f"more than {MAX_NODES} values (aliases count again each time they are used)",
            )
        tag = str(node.tag).replace(_YAML_TAG_PREFIX, "!!")
        if node.tag not in SafeConstructor.yaml_constructors or node.tag is None:
            raise YamlFileError(source, node.start_mark.line + 1, f"unsupported YAML tag {tag}")
        if isinstance(node, ScalarNode):
            # Built once here, so that ``construct`` cannot fail later: `!!int x`, or an
            # integer of more digits than Python converts. The value is not quoted.
            try:
                constructor.construct_object(node)
            except (yaml.YAMLError, ValueError, TypeError, OverflowError):
                raise YamlFileError(
                    source, node.start_mark.line + 1, f"not a valid {tag} value"
                ) from None
        elif isinstance(node, SequenceNode):
            pending.extend(node.value)
        elif isinstance(node, MappingNode):
            for key, value in node.value:
                pending.extend((key, value))
