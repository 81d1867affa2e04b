"""Units: byte sizes parsed from and formatted for people, and the card sizes ckptlab answers for."""

from __future__ import annotations

from .validate import size_bytes

GiB = 2**30
CARD_LIMITS = {"24 GiB": 24 * GiB, "40 GiB": 40 * GiB, "80 GiB": 80 * GiB, "141 GiB": 141 * GiB}


def parse_bytes(value: str | int | float | None, name: str = "memory_limit") -> int | None:
    """'24GiB', '512MB', '1.5e9' or a number of bytes -> int bytes, at least 1 (None passes
    through); see `validate.size_bytes`."""
    return None if value is None else size_bytes(name, value)


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"



__all__ = ["CARD_LIMITS", "GiB", "format_bytes", "parse_bytes"]
