"""Workloads from spec strings: your own model in a file or a module, named wherever a preset is.

    path/to/file.py:factory     the file is imported (as a module of its own, each time it changes)
    package.module:factory      imported from sys.path

`factory(**overrides)` returns a `Workload` (usually `Workload.custom(...)`); overrides (`--set
k=v`, `model_overrides`) are its keyword arguments. The workload gets `spec` (so isolated cells,
submitit jobs and FSDP ranks re-create it in their own process) and `spec_hash`, a content hash of
the file that defines the factory (so a resumed sweep refuses a changed model). Helper modules the
file imports are not part of the hash.

Everything is checked before any measurement: the file or module, the factory, the keyword
arguments it accepts, that it returns a Workload, and that the model has repeated blocks.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

from .base import SPEC_MODULE_PREFIX, Workload
from .stacks import find_stacks

HASH_CHARS = 16


def is_code_spec(spec: str) -> bool:
    """True for 'file.py:factory' and 'package.module:factory' (not presets, not hf: specs)."""
    return isinstance(spec, str) and ":" in spec and not spec.startswith("hf:")


def file_hash(path: str | Path) -> str:
    """sha256 of the file's bytes, shortened: what records and run folders name."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:HASH_CHARS]


def load_code_workload(spec: str, seed: int = 0, **overrides) -> Workload:
    """The Workload that `spec`'s factory returns for `overrides`, with spec, hash, overrides and
    seed set. Raises ValueError naming the spec and what was wrong, before any work."""
    source, _, factory_name = spec.rpartition(":")
    if not source or not factory_name.isidentifier():
        raise ValueError(f"model={spec!r} is invalid: allowed specs are a preset, hf:<model_type>, "
                         "hf:path/config.json, hf:org/name, path/to/file.py:factory or package.module:factory")
    if source.endswith(".py") or "/" in source or "\\" in source:
        module, path = _import_file(spec, Path(source))
    else:
        module, path = _import_module(spec, source)
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"model={spec!r} is invalid: {path.name} has no callable {factory_name!r}; "
                         f"it defines {', '.join(found) or 'no public functions'}")
    _check_overrides(spec, factory, overrides)
    try:
        workload = factory(**overrides)
    except Exception as exc:  # noqa: BLE001 - whatever the factory refuses is one line naming the spec
        raise ValueError(f"model={spec!r} is invalid with overrides {overrides}: {factory_name}(...) raised "
                         f"{type(exc).__name__}: {one_line(exc)}") from exc
    if not isinstance(workload, Workload):
        raise ValueError(f"model={spec!r} is invalid: {factory_name}(...) returned {type(workload).__name__}, "
                         "allowed is a ckptlab.Workload (e.g. Workload.custom(name, build_model, make_batch, loss))")
    workload.spec = spec
    workload.spec_hash = file_hash(path)
    workload.overrides = dict(overrides)
    workload.seed = seed
    check_blocks(workload)
    return workload


def check_blocks(workload: Workload) -> None:
    """Refuse a workload whose model has no repeated blocks (or whose blocks= paths are wrong),
    building it on the meta device: nothing is allocated."""
    try:
        model = workload.build("meta")
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"model={workload.label!r} is invalid: building it failed with "
                         f"{type(exc).__name__}: {one_line(exc)}") from exc
    try:
        find_stacks(model)
    except ValueError as exc:
        raise ValueError(f"model={workload.label!r} is invalid: {exc}") from None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line; a validator's wrapper (huggingface_hub's, transformers'
    configs) says only which validator failed, so the cause it wraps is named too."""
    text = " ".join(str(exc).split())
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} {type(cause).__name__}: {' '.join(str(cause).split())}"
    return text or type(exc).__name__


def project_relative(spec: str, root: Path) -> str:
    """A file spec as a process whose working directory is `root` must write it to load the same
    file (a notebook kernel runs in the project, not where the user stands); other specs as they
    are. Relative, so that nothing written to results/ holds where this machine keeps files."""
    if not is_code_spec(spec):
        return spec
    source, _, factory = spec.rpartition(":")
    path = Path(source)
    if not (source.endswith(".py") or "/" in source or "\\" in source) or path.is_absolute() or not path.is_file():
        return spec
    return f"{os.path.relpath(path.resolve(), root.resolve())}:{factory}"


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise ValueError(f"model={spec!r} is invalid: file {str(path)!r} does not exist "
                         f"(relative paths start at {Path.cwd().name!r}, the working directory)")
    # One module per file name and content: an edited file is imported again.
    name = f"{SPEC_MODULE_PREFIX}{path.stem}_{file_hash(path)}"
    if name in sys.modules:
        return sys.modules[name], path
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or path.suffix != ".py":
        raise ValueError(f"model={spec!r} is invalid: {str(path)!r} is not a Python file; allowed is "
                         "path/to/file.py:factory")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"model={spec!r} is invalid: importing {path.name} failed with "
                         f"{type(exc).__name__}: {one_line(exc)}") from exc
    return module, path


def _import_module(spec: str, module_name: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"model={spec!r} is invalid: module {module_name!r} cannot be imported "
                         f"({exc}); a file spec is written path/to/file.py:factory") from None
    path = getattr(module, "__file__", None)
    if path is None:
        raise ValueError(f"model={spec!r} is invalid: module {module_name!r} has no source file to hash")
    return module, Path(path)


def _check_overrides(spec: str, factory, overrides: dict) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(f"override {unknown[0]}={overrides[unknown[0]]!r} is invalid for model={spec!r}: "
                         f"allowed overrides are the factory's keyword arguments: {', '.join(accepted) or 'none'}")
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                and n not in overrides]
    if required:
        raise ValueError(f"model={spec!r} is invalid: its factory needs {', '.join(required)}: "
                         f"pass {required[0]}=... as an override (--set {required[0]}=...)")


__all__ = ["check_blocks", "file_hash", "is_code_spec", "load_code_workload", "one_line", "project_relative"]
