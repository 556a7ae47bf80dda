"""Annotation templates: ``str.format`` over an alert's labels, bounded so a rule file
cannot ask for a gigabyte-wide field."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Final

from torshmon.aggregator.core.rules import (
    LABEL_NAME,
)

#: The widest field and the most digits an annotation template may ask for: a width of
#: 10**9 would make one annotation a gigabyte (or a MemoryError) at each render.
MAX_FORMAT_WIDTH: Final = 100
#: Python's format-spec mini-language, for str and float values.
_FORMAT_SPEC: Final = re.compile(
    r"(?:.?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?[bcdeEfFgGnosxX%]?\Z",
    re.DOTALL,
)


def render_template(template: str, fields: Mapping[str, object]) -> str:
    """``template.format_map(fields)`` that refuses what could allocate without bound:
    a width or precision above MAX_FORMAT_WIDTH, and field names that are not plain
    names (``{job.__class__}``). Raises ValueError, KeyError as ``format_map`` does."""
    return _FORMATTER.vformat(template, (), fields)


def _spec_problem(spec: str) -> str | None:
    """Why a format spec is refused, or None (see ``render_template``)."""
    match = _FORMAT_SPEC.match(spec)
    if match is None:
        return f"format spec {spec!r} is not [[fill]align][sign][width][,][.precision][type]"
    for part in ("width", "precision"):
        digits = match[part]
        if digits and (len(digits) > 3 or int(digits) > MAX_FORMAT_WIDTH):
            return f"format spec {spec!r} has a {part} above {MAX_FORMAT_WIDTH}"
    return None


class _BoundedFormatter(string.Formatter):
    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if not LABEL_NAME.match(field_name):
            raise ValueError(f"template field {{{field_name}}} must be a plain name")
        return super().get_field(field_name, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        problem = _spec_problem(format_spec)
        if problem:
            raise ValueError(problem)
        return super().format_field(value, format_spec)


_FORMATTER: Final = _BoundedFormatter()


def check_template(template: str, fields: frozenset[str]) -> str | None:
    """Why ``template`` cannot be rendered with ``fields``, or None if it can."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"invalid template: {exc} (write {{{{ and }}}} for literal braces)"
    known = ", ".join(sorted(fields))
    for _, field_name, spec, _ in parsed:
        if field_name is None:
            continue
        if not LABEL_NAME.match(field_name):
            return f"template field {{{field_name}}} must be a plain name (known: {known})"
        if field_name not in fields:
            return f"template names unknown field {{{field_name}}} (known: {known})"
        if spec and "{" in spec:
            return f"template field {{{field_name}}} has a nested format spec"
        problem = _spec_problem(spec or "")
        if problem:
            return f"template field {{{field_name}}}: {problem}"
    sample: dict[str, object] = dict.fromkeys(fields, "x")
    sample["value"] = 0.5
    try:
        render_template(template, sample)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return f"template cannot be rendered: {exc}"
    return None


__all__ = [
    "MAX_FORMAT_WIDTH",
    "check_template",
    "render_template",
]
