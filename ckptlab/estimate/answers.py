"""Predictions kept on disk: a question asked again, in this process or a later one, is answered
from the prediction made the first time instead of being traced again (and `explain`'s reports,
which are made of predictions, the same way).

A prediction is kept under a key that holds everything it depends on: the model (its spec, the
spec file's hash, its config, overrides, seed, weights' dtype), the shape, policy, dtype, loop, device, card
(every field), attention backend, torch version modelled, allocator option and trace asked for,
and what computed it: ckptlab's own code (a hash of its source files), the installed torch (its
CPU kernels are what a CPU prediction runs), transformers and peft (the models they build), and
the CPU's instruction set as torch reads it. A change in any of them asks again. A model made in
Python (no spec) is never kept: its code is not named by anything a key can hold. A prediction
made on a batch line (`estimate.batch_line`) is not kept either: it is valid only inside a batch
search. A command that asks before it builds its model (`ckptlab predict`'s rows) keeps its answer
under `spec_key`, named by the spec itself, without the model's config.

The answers live in one file per key under `CKPTLAB_CACHE` (default: `$XDG_CACHE_HOME/ckptlab/
predictions`, or `~/.cache/ckptlab/predictions`); `CKPTLAB_CACHE=off` turns the cache off, as
`off()` does for a block of code (the test suite and the speed benchmarks run with it off). A
file that cannot be read is asked again and written anew; a folder that cannot be written keeps
nothing. Nothing else in that folder is touched. An answer taken from it says so (`Prediction.answered_from_cache`), with the seconds it took to
fetch in `predict_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import pickle
import platform
import sys
from pathlib import Path
from typing import Optional

import torch

from ..core.cards import Card
from ..workloads.base import Workload
from ..workloads.lora import SUFFIX as LORA_SUFFIX
from ..workloads.specs import file_hash
from .fake_step import workload_key

OFF = "off"
_code: Optional[str] = None


def folder() -> Optional[Path]:
    """Where answers are kept, or None when the cache is off."""
    chosen = os.environ.get("CKPTLAB_CACHE", "")
    if chosen.lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ckptlab" / "predictions"


@contextlib.contextmanager
def off():
    """Inside: every prediction is made, none is taken from or put into the cache, in this process
    and in the processes it starts (`CKPTLAB_CACHE=off` while inside)."""
    before = os.environ.get("CKPTLAB_CACHE")
    os.environ["CKPTLAB_CACHE"] = OFF
    try:
        yield
    finally:
        if before is None:
            del os.environ["CKPTLAB_CACHE"]
        else:
            os.environ["CKPTLAB_CACHE"] = before


def code_version() -> str:
    """A hash of ckptlab's source files, the installed torch, transformers and peft, the Python
    version and the CPU's instruction set: what computes a prediction besides its inputs."""
    global _code
    if _code is None:
        digest = hashlib.sha256()
        root = Path(__file__).resolve().parents[1]
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        versions = [torch.__version__, torch.backends.cpu.get_cpu_capability(), platform.machine(),
                    sys.version.split()[0]]
        for package in ("transformers", "peft"):
            try:
                versions.append(f"{package} {importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{package} none")
        digest.update(repr(versions).encode())
        _code = digest.hexdigest()
    return _code


def key(workload: Workload, batch_size: int, seq_len: int, policy, dtype: str, loop, device: str,
        card: Optional[Card], attention: Optional[str], torch_version: Optional[str], alloc_conf: Optional[str],
        trace: str, asked: tuple = ("predict",)) -> Optional[str]:
    """The file name of a question's answer: a hash of everything the prediction depends on, and
    `asked`, what is asked of it beyond (`explain`'s capacity and ranks); None where nothing is
    kept (the cache off, a workload made in Python, or one whose loss its name does not pin:
    `Workload.loss_pinned`)."""
    if workload.spec is None or folder() is None or not workload.loss_pinned:
        return None
    question = (code_version(), workload_key(workload), workload.identity, batch_size, seq_len, str(policy), dtype,
                repr(loop), device, repr(dataclasses.astuple(card)) if card is not None else None, attention,
                torch_version, alloc_conf, trace, asked)
    return hashlib.sha256(repr(question).encode()).hexdigest()


def spec_key(spec: str, overrides: dict, seed: int, asked: tuple) -> Optional[str]:
    """The file name of an answer about the model that `spec` names, known before that model is
    built (a command asked again: `ckptlab predict`'s rows): a hash of the spec, the file it names
    (its hash), the overrides, the seed, `asked` (everything else the answer depends on) and what
    computes answers (`code_version`). None where the cache is off or the spec's model is made
    from more than these and the installed packages: a config read from the Hugging Face hub's
    cache (hf:org/name) or a module found on the path (package.module:factory), or where the
    file it names is missing."""
    source = _spec_source(spec)
    if source is None or folder() is None:
        return None
    question = (code_version(), "spec", source, repr(sorted(overrides.items())), seed, asked)
    return hashlib.sha256(repr(question).encode()).hexdigest()


def _spec_source(spec: str) -> Optional[tuple]:
    """(spec, the hash of the file it names where it names one), or None (`spec_key`)."""
    base = spec.rpartition(LORA_SUFFIX)[0] if LORA_SUFFIX in spec else spec
    if base.startswith("hf:"):
        target = base[3:]
        if target.endswith(".json") or Path(target).exists():
            path = Path(target) if target.endswith(".json") else Path(target) / "config.json"
            return (spec, file_hash(path)) if path.is_file() else None
        return None if "/" in target else (spec,)   # hf:<model_type>: transformers' own config
    if ":" in base:
        source = base.rpartition(":")[0]
        if source.endswith(".py") or "/" in source or "\\" in source:
            return (spec, file_hash(source)) if Path(source).is_file() else None
        return None
    return (spec,)   # a preset: ckptlab's own


def fetch(name: str):
    """The prediction kept under `name`, or None (not kept, cache off, or unreadable)."""
    where = folder()
    if where is None:
        return None
    try:
        with open(where / f"{name}.pickle", "rb") as file:
            return pickle.load(file)
    except Exception:   # noqa: BLE001 - missing, partly written by a process that died, or from another layout
        return None


def keep(name: str, prediction) -> None:
    """Write the prediction under `name` (a whole file or none: written aside, then renamed)."""
    where = folder()
    if where is None:
        return
    aside = where / f"{name}.{os.getpid()}.partial"
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(aside, "wb") as file:
            pickle.dump(prediction, file)
        os.replace(aside, where / f"{name}.pickle")
    except OSError:   # a folder that cannot be written keeps nothing; the prediction stands
        with contextlib.suppress(OSError):
            aside.unlink()


__all__ = ["OFF", "code_version", "fetch", "folder", "keep", "key", "off", "spec_key"]
