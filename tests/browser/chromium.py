"""Debian's Chromium for the browser test: found, or installed with apt-get (update once, then
install), so a fresh machine works. Run directly to install: `python tests/browser/chromium.py`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

CHROMIUM = "/usr/bin/chromium"
# What the headless browser needs on a machine with no network but package registries: no
# background connections (refused by the closed network), no GPU, no sandbox when run as root.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


def ensure_chromium(timeout: float = 900) -> str:
    """The path of Debian's chromium, installing the package first if it is missing."""
    path = shutil.which("chromium") or (CHROMIUM if os.access(CHROMIUM, os.X_OK) else None)
    if path:
        return path
    apt = shutil.which("apt-get")
    if not apt:
        raise RuntimeError("chromium is not installed and apt-get is not available: install Debian's "
                           "'chromium' package (it must provide /usr/bin/chromium)")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (sudo + [apt, "update", "-q"],
                sudo + [apt, "install", "-y", "-q", "--no-install-recommends", "chromium"]):
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    path = shutil.which("chromium") or CHROMIUM
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"apt-get installed chromium but {path} is not executable")
    return path


def chromium_version(path: str) -> str:
    done = subprocess.run([path, "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, timeout=60)
    return done.stdout.strip()


if __name__ == "__main__":
    print(chromium_version(ensure_chromium()))
