"""Child processes die with their parent: an isolated sweep cell whose sweep is killed with -9
stops at once, instead of computing on beside a resumed sweep (the lock is already free)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlab.core import children
from ckptlab.run.cells import CELL_TIMEOUT_S, run_isolated
from ckptlab.run.config import SweepConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running (a zombie that nobody has reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_child(parent: subprocess.Popen, marker: str, timeout_s: float = 60) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for pid in children_of(parent.pid):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_text():
                    return pid
            except OSError:
                pass
        assert parent.poll() is None, parent.stderr.read().decode()[-800:]
        time.sleep(0.02)
    raise AssertionError(f"no child running {marker!r} within {timeout_s} s")


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def child_gone_after_parent_killed(parent: subprocess.Popen, marker: str, ready=lambda: True) -> bool:
    """Find `parent`'s child running `marker`, wait until `ready()`, SIGKILL the parent; whether
    the child is gone within 2 s. Nothing is left running either way."""
    child = None
    try:
        child = wait_for_child(parent, marker)
        deadline = time.time() + 30
        while not ready() and time.time() < deadline:
            time.sleep(0.02)
        parent.kill()
        parent.wait()
        return gone_within(child, 2.0)
    finally:
        parent.kill()
        if child is not None:
            kill(child)


def test_isolated_cell_dies_when_its_sweep_is_killed(tmp_path):
    # A cell long enough to be still running when its sweep is killed.
    code = ("from ckptlab.run.config import SweepConfig; from ckptlab.run.sweep import run_sweep; "
            "run_sweep(SweepConfig(model='mlp-chain', batch_sizes=[1], seq_lens=[8], policies=['none'], "
            f"steps=10**7, warmup=0, isolate=True, progress=False, out={str(tmp_path / 'run')!r}))")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert child_gone_after_parent_killed(parent, "child_main"), "the isolated cell outlived its sweep"


def test_child_notices_a_dead_parent_without_the_kernels_help(tmp_path):
    """The fallback for systems without PR_SET_PDEATHSIG: the child watches its parent's pid."""
    children_py = Path(children.__file__)
    child_code = ("import importlib.util, os, time; "
                  f"spec = importlib.util.spec_from_file_location('children', {str(children_py)!r}); "
                  "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                  "m.exit_when_orphaned(os.getppid(), poll_s=0.1); "
                  f"open({str(tmp_path / 'watching')!r}, 'w').close(); time.sleep(60)")
    parent_code = ("import subprocess, sys, time; "
                   f"subprocess.Popen([sys.executable, '-c', {child_code!r}, 'orphan-watch']); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stderr=subprocess.PIPE)
    assert child_gone_after_parent_killed(parent, "orphan-watch", (tmp_path / "watching").exists), \
        "the orphaned child kept running"


def test_isolated_cells_have_a_default_timeout(monkeypatch, tmp_path):
    seen = {}

    def fake_run(*args, **kwargs):
        seen.update(kwargs)
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", fake_run)
    config = SweepConfig(model="mlp-chain", batch_sizes=[1], seq_lens=[8], policies=["none"], out=tmp_path)
    record = run_isolated(config, config.cells()[0])
    assert seen["timeout"] == CELL_TIMEOUT_S and seen["preexec_fn"] is not None
    assert record["status"] == "error" and f"timed out after {CELL_TIMEOUT_S}" in record["message"]
