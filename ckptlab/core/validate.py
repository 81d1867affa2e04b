"""Validators shared by every entry point: each raises ValueError naming the parameter, the value and what is allowed."""

from __future__ import annotations


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: allowed is an integer >= {minimum}")



__all__ = ["check_int"]
