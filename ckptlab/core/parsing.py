"""Parsing the comma-separated lists that the command line and the rank processes pass around."""

from __future__ import annotations


def split_list(text: str) -> list[str]:
    """'none,density=0.5,layers=0,2' -> ['none', 'density=0.5', 'layers=0,2']: a comma starts a
    new item only when what follows it starts a new policy or value (not a bare layer index)."""
    items: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if items and part.isdigit() and items[-1].startswith("layers="):
            items[-1] += "," + part
        elif part:
            items.append(part)
    return items



__all__ = ["split_list"]
