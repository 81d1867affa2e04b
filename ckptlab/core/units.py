"""Byte sizes: parsed from people (`size_bytes`), written back exactly (`size_label`) or for reading
(`format_bytes`). The cards ckptlab answers for are in `core.cards`. Imports nothing of ckptlab."""

from __future__ import annotations

import math

# One table of units: B, KB, MB, GB, TB (powers of 10) and KiB, MiB, GiB, TiB (powers of 2).
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")   # what format_bytes writes
SIZE_HELP = "a positive size such as 24GiB, 512MiB, 2GB or a number of bytes (at least 1 byte)"

GiB = SIZE_UNITS["gib"]


def size_bytes(name: str, value) -> int:
    """'24GiB', '512MB', '1.5e9' or a number -> whole bytes, at least 1. Units: B, KB, MB, GB,
    TB (powers of 10) and KiB, MiB, GiB, TiB (powers of 2), any case."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount, unit = float(value), "b"
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):] or "b"
        try:
            amount = float(digits)
        except ValueError:
            amount = math.nan
    else:
        amount, unit = math.nan, "b"
    if unit not in SIZE_UNITS or not math.isfinite(amount) or amount * SIZE_UNITS[unit] < 1:
        raise ValueError(f"{name}={value!r} is invalid: allowed is {SIZE_HELP}")
    return int(amount * SIZE_UNITS[unit])


def size_label(n_bytes: int) -> str:
    """Whole bytes as the largest unit that divides them exactly: 6442450944 -> '6GiB',
    10**9 -> '1GB', 1000 -> '1KB', 1500 -> '1500B'; read back by `size_bytes`."""
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        if n_bytes % SIZE_UNITS[unit.lower()] == 0:
            return f"{n_bytes // SIZE_UNITS[unit.lower()]}{unit}"
    return f"{n_bytes}B"


def parse_bytes(value: str | int | float | None, name: str = "memory_limit") -> int | None:
    """`size_bytes`, with None passing through."""
    return None if value is None else size_bytes(name, value)


def format_bytes(n: float | None, compact: bool = False) -> str:
    """A size for reading, in the largest binary unit below it: "42.7 MiB". `compact` is the form
    of a label: three significant figures and no space, "42.7MiB", "6GiB"."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    scale = next((s for s in range(len(BINARY_UNITS) - 1, 0, -1) if abs(n) >= 1024**s), 0)
    value, unit = n / 1024**scale, BINARY_UNITS[scale]
    if not compact:
        return f"{value:.0f} {unit}" if scale == 0 else f"{value:.1f} {unit}"
    if scale == 0:
        return f"{n:.0f}B"
    text = f"{value:.{0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2}f}"
    return text.rstrip("0").rstrip(".") + unit


def format_count(n: int) -> str:
    """A count for reading, as model sizes are told: exact below a million ("45,344"), else in
    millions or billions to one decimal ("124.4M", "6.7B")."""
    if abs(n) < 10**6:
        return f"{n:,}"
    return f"{n / 10**6:,.1f}M" if abs(n) < 10**9 else f"{n / 10**9:,.1f}B"


__all__ = ["BINARY_UNITS", "GiB", "SIZE_HELP", "SIZE_UNITS", "format_bytes", "format_count", "parse_bytes",
           "size_bytes", "size_label"]
