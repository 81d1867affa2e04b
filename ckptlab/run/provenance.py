"""Provenance of a run: its configuration and the environment it ran in (package versions, device, git
commit). Deliberately no environment variables, no command line and no absolute paths."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional

import torch

from ..core.meta import __version__
from ..core.units import format_bytes
from ..probe.step import device_name
from .config import SweepConfig


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_metadata(config: SweepConfig, previous: Optional[dict] = None) -> dict:
    """What run.json holds: the configuration and the environment. Deliberately no environment
    variables, no command line and no absolute paths (they can carry secrets or home paths):
    `out` is the folder run.json is in, and the folders it names are left out."""
    history = list((previous or {}).get("history", []))
    started = now()
    history.append({"started_at": started, "cells": len(config.cells())})
    saved = {k: v for k, v in config.to_dict().items() if k not in ("out", "submitit_folder")}
    return {
        "run": config.out.name,
        "ckptlab_version": __version__,
        "git_commit": source_commit(),
        "config": saved,
        "memory_limit": format_bytes(config.memory_limit) if config.memory_limit else None,
        "started_at": (previous or {}).get("started_at", started),
        "finished_at": None,
        "history": history,
        "environment": environment(config.device),
    }


def environment(device: str) -> dict:
    packages = {}
    for name in ("torch", "numpy", "pandas", "matplotlib", "tqdm", "PyYAML", "submitit"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    dev = torch.device(device)
    capacity = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _ram_bytes()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "packages": packages,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device,
        "device_name": device_name(dev),
        "device_capacity_bytes": capacity,
        "cpu": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def source_commit(root: Path = Path(__file__).resolve().parents[2]) -> Optional[str]:
    """The git commit of the ckptlab source in `root` (the folder holding ckptlab/), "-dirty" when
    tracked files differ from it; None when `root` is not the top of a git work tree — an installed
    copy inside someone else's repository must not report that repository's commit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != Path(root).resolve():
            return None
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


__all__ = ["environment", "now", "run_metadata", "source_commit"]
