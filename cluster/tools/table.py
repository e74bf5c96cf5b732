"""Plain-text tables for a terminal: columns padded to their widest cell."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header line and one line per row, each cell left-aligned, trailing blanks cut."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [tuple(columns), *rows]
    ]
