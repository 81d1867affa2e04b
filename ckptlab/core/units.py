"""Units: byte sizes parsed from and formatted for people, and the card sizes ckptlab answers for."""

from __future__ import annotations

GiB = 2**30
CARD_LIMITS = {"24 GiB": 24 * GiB, "40 GiB": 40 * GiB, "80 GiB": 80 * GiB, "141 GiB": 141 * GiB}


def parse_bytes(value: str | int | float | None, name: str = "memory_limit") -> int | None:
    """'24GiB', '512MB', '1.5e9' or a number of bytes -> int bytes (None passes through)."""
    if value is None:
        return None
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), "b"
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):] or "b"
        try:
            number = float(digits)
        except ValueError:
            number = -1.0
        if unit not in units:
            number = -1.0
    if not number > 0:
        raise ValueError(
            f"{name}={value!r} is invalid: allowed is a positive size such as 24GiB, 512MiB, 2GB or bytes"
        )
    return int(number * units[unit])


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"



__all__ = ["CARD_LIMITS", "GiB", "format_bytes", "parse_bytes"]
