"""Plain-text tables for the benchmark scripts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

Columns = Sequence[tuple[str, Callable[[T], str]]]


def format_table(columns: Columns[T], items: Sequence[T]) -> str:
    """Right-aligned columns: a header, a rule, then one line per item."""
    cells = [tuple(name for name, _ in columns)]
    cells += [tuple(cell(item) for _, cell in columns) for item in items]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
