"""Plain-text tables for the terminal and notebooks."""

from __future__ import annotations


def format_table(rows: list[dict], columns: list[tuple[str, str, callable]]) -> str:
    """Plain-text table: columns are (header, key, formatter)."""
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        cells.append([fmt(row.get(key)) for _, key, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["format_table"]
