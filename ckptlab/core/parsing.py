"""Parsing what users hand in as text: comma-separated lists (the command line, the rank
processes), YAML files of settings, and the docstrings under a dataclass's fields."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path


def split_list(text: str, name: str = "list") -> list[str]:
    """'none,density=0.5,layers=0,2' -> ['none', 'density=0.5', 'layers=0,2']: a comma starts a
    new item only when what follows it starts a new policy or value (not a bare layer index).
    Text of no items (blank, or commas alone) is none; an empty item among others ('1,,2', '1,2,')
    a ValueError naming `name`."""
    if not text.replace(",", "").strip():
        return []
    items: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"{name}={text!r} is invalid: allowed is a comma-separated list, none empty")
        if items and part.isdigit() and items[-1].startswith("layers="):
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def yaml_mapping(name: str, path) -> dict:
    """The mapping a YAML file holds: plain YAML only (a tag such as !!python/object is refused,
    never run); a missing file, malformed text or anything but a mapping is a ValueError naming
    `name` and the file."""
    import yaml  # noqa: PLC0415 - read only here: `import ckptlab` needs nothing but torch

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name}={str(path)!r} is invalid: no such file; allowed is a path to a .yaml file")
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:  # malformed, or a tag that safe_load refuses
        reason = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ValueError(f"{name}={str(path)!r} is invalid: {path.name} is not plain YAML ({reason})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{name}={str(path)!r} is invalid: {path.name} must hold a mapping of names to values")
    return values


def attribute_docs(cls) -> dict[str, str]:
    """{field name: its docstring} for the string literals written under a class's annotated
    attributes (the convention the API reference reads), from the class's source: one text
    for the code's reader, the reference and the command line's help."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


__all__ = ["attribute_docs", "split_list", "yaml_mapping"]
