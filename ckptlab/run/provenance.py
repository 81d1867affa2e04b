"""Provenance of a run: the grid and the environment it ran in (package versions, device, git
commit). Deliberately no environment variables, no command line and no absolute paths."""

from __future__ import annotations

import dataclasses
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
from .cells import Grid, now


def run_metadata(grid: Grid, out: Path, isolate: bool, previous: Optional[dict] = None) -> dict:
    """What run.json holds: the grid and the environment. Deliberately no environment
    variables, no command line and no absolute paths (they can carry secrets or home paths)."""
    history = list((previous or {}).get("history", []))
    started = now()
    history.append({"started_at": started, "cells": len(grid.cells())})
    return {
        "run": out.name,
        "ckptlab_version": __version__,
        "git_commit": _git_commit(),
        "grid": dataclasses.asdict(grid),
        "memory_limit": format_bytes(grid.memory_limit_bytes) if grid.memory_limit_bytes else None,
        "isolate": isolate,
        "started_at": (previous or {}).get("started_at", started),
        "finished_at": None,
        "history": history,
        "environment": environment(grid.device),
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


def _git_commit() -> Optional[str]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None



__all__ = ["environment", "run_metadata"]
