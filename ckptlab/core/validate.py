"""Checks of values a user hands to ckptlab: one function per kind of value.

Each returns the value in its checked form, or raises ValueError with one line that names the
parameter, the value and what is allowed: `batch_size=0 is invalid: allowed is an integer >= 1`.
The command line prints that line as `error: ...` and exits 2. Nothing here imports torch or the
rest of ckptlab, so anything may call it before doing any work.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Iterable, Sequence


def integer(name: str, value, minimum: int) -> int:
    """An int (not a bool, not a float such as 2.0) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: allowed is an integer >= {minimum}")
    return value


def integer_list(name: str, values, minimum: int) -> list[int]:
    """A non-empty list of integers >= minimum, in the order given; decimal text such as "4" (from
    a command line) counts as its integer."""
    items = non_empty(name, values)
    try:
        return [integer(name, int(v) if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v) else v, minimum)
                for v in items]
    except ValueError:
        raise ValueError(f"{name}={_show(values)} is invalid: allowed is a non-empty list of "
                         f"integers >= {minimum}") from None


def number(name: str, value, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    """A finite real number in [low, high] ((low, high] with low_open), returned as float with
    -0.0 made 0.0, so that "-0" and "0" name the same thing."""
    try:
        x = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else math.nan
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and (low < x if low_open else low <= x) and x <= high):
        bounds = f"{'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}]"
        raise ValueError(f"{name}={value!r} is invalid: allowed is a finite number in {bounds}")
    return x + 0.0


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: allowed are True, False")
    return value


def choice(name: str, value, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed are {', '.join(allowed)}")
    return value


def nearest(value: str, allowed: Sequence[str]) -> str | None:
    """The one of `allowed` that `value` most likely misspells (a letter or two off), or None."""
    close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.8)
    return close[0] if close else None


def non_empty(name: str, values) -> list:
    """A list from a list, tuple or a single value; empty is refused."""
    if isinstance(values, (str, int, float)) and not isinstance(values, bool):
        values = [values] if values != "" else []
    values = list(values)
    if not values:
        raise ValueError(f"{name}={_show(values)} is invalid: allowed is a non-empty list")
    return values


def output_folder(name: str, path) -> Path:
    """A folder ckptlab may create and write to: not empty text (which would mean the current
    folder), not an existing file, not under a file, and creatable where it does not exist yet.
    Nothing is created here."""
    if path is None or (isinstance(path, str) and not path.strip()):
        raise ValueError(f"{name}={path!r} is invalid: allowed is a folder path, e.g. results/my-run")
    folder = Path(path)
    too_long = [part for part in folder.parts if len(os.fsencode(part)) > _NAME_MAX]
    if too_long:
        raise ValueError(f"{name}={_short(str(path))!r} is invalid: the name {_short(too_long[0])!r} is longer than "
                         f"{_NAME_MAX} bytes; allowed is a folder path whose names are shorter")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name}={str(path)!r} is invalid: it is an existing file; allowed is a folder path")
    parent = folder
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{name}={str(path)!r} is invalid: {str(parent)!r} is a file, so no folder can be "
                         "made under it; allowed is a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={str(path)!r} is invalid: {'it' if parent == folder else repr(str(parent))} "
                         "is not writable; allowed is a folder you can write to")
    return folder


def made_folder(name: str, path) -> Path:
    """`output_folder`, made (with its parents): where the system refuses it anyway (a read-only
    or virtual file system, which a check of permissions cannot see, as root), ValueError naming
    `name`, before anything is written into it."""
    folder = output_folder(name, path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{name}={str(path)!r} is invalid: it cannot be made ({exc.strerror}); allowed is a folder "
                         "you can write to") from None
    return folder


def run_name(name: str, value) -> str:
    """One path component: a folder name, never a path ('a/b', '..', '.', '/abs', '')."""
    bad = (not isinstance(value, str) or value.strip() in ("", ".", "..") or "/" in value
           or "\\" in value or "\0" in value or (os.altsep and os.altsep in value))
    if bad:
        raise ValueError(f"{name}={value!r} is invalid: allowed is a folder name (one path component: "
                         "no '/', not '.', '..' or empty)")
    return value


_CREDENTIAL_PATTERNS = [re.compile(p) for p in (
    r"\bhf_[A-Za-z0-9]{20,}", r"\bsk-[A-Za-z0-9_-]{20,}", r"\bgh[pousr]_[A-Za-z0-9]{20,}",
    r"\bgithub_pat_[A-Za-z0-9_]{20,}", r"\bxox[abposr]-[A-Za-z0-9-]{10,}", r"\bAKIA[0-9A-Z]{16}\b",
    r"\bAIza[0-9A-Za-z_-]{30,}", r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
)]
_RANDOM_RUN = re.compile(r"[A-Za-z0-9_-]{32,}")


def no_credential(name: str, value) -> None:
    """Refuse a value (or any string inside a list or dict value) that looks like a credential.

    Parameter values are recorded in run folders and executed notebooks, so a credential in one
    would be written to disk and perhaps committed. Such values are refused, never silently
    redacted, and the message does not repeat the value. A value looks like a credential when it
    holds
      - the shape of a well-known token: Hugging Face (hf_...), OpenAI/Anthropic (sk-...), GitHub
        (ghp_, gho_, ghu_, ghs_, ghr_, github_pat_), Slack (xoxb-, ...), an AWS access key id
        (AKIA...), a Google API key (AIza...), a PEM private key block, a JSON Web Token; or
      - any other run of 32 or more letters, digits, '_' or '-' that mixes upper case, lower case
        and digits (a random secret; policies, model names, sizes and hex hashes never do).
    Credentials belong in the environment (HF_TOKEN, ...), which ckptlab never records.
    """
    for text in _strings(value):
        if any(p.search(text) for p in _CREDENTIAL_PATTERNS) or any(
                re.search(r"[A-Z]", run) and re.search(r"[a-z]", run) and re.search(r"\d", run)
                for run in _RANDOM_RUN.findall(text)):
            raise ValueError(f"{name} is invalid: its value looks like a credential (a token or key), and "
                             "parameter values are written to the run folder; allowed are values without "
                             "secrets: pass credentials through the environment instead")


def _strings(value) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


_NAME_MAX = 255   # bytes in one file name on Linux, macOS and Windows file systems


def _short(text: str, keep: int = 40) -> str:
    return text if len(text) <= keep else text[:keep] + "..."


def _show(values) -> str:
    return repr(values) if not isinstance(values, (list, tuple)) else "[" + ", ".join(map(repr, values)) + "]"


def _fmt(x: float) -> str:
    return ("-inf" if x < 0 else "inf") if math.isinf(x) else f"{x:g}"


__all__ = ["boolean", "choice", "integer", "integer_list", "made_folder", "nearest", "no_credential", "non_empty", "number",
           "output_folder", "run_name"]
