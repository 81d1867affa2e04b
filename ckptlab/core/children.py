"""Child processes that die with their parent.

An isolated sweep cell or a notebook execution runs in a child process. If the parent is killed
(`kill -9`, an OOM killer), the child must not go on computing: the run folder's lock is already
free, so a resumed sweep could run beside it, and on CUDA it would keep holding device memory.

    subprocess.run(command, preexec_fn=die_with_parent())   # Linux: the kernel kills the child
    exit_when_orphaned(parent_pid)                          # in the child: any POSIX system

On Linux `die_with_parent` asks the kernel for SIGKILL when the parent dies (PR_SET_PDEATHSIG,
set between fork and exec, so there is no window where the child is unprotected). Elsewhere, or
as a second line, `exit_when_orphaned` watches the parent's pid from a daemon thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1          # from <linux/prctl.h>
PARENT_POLL_S = 0.5           # how often an orphaned child notices at the latest


PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])   # the folder holding ckptlab/


def child_environment(**variables: str) -> dict:
    """This process's environment for a child that must import this same ckptlab, installed or
    not (the folder holding it first on PYTHONPATH), plus `variables`."""
    pythonpath = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=pythonpath, **variables)


def die_with_parent() -> Optional[Callable[[], None]]:
    """A `preexec_fn` for subprocess that ties the child to this process (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before fork, only called after

    def tie() -> None:  # runs in the child, after fork, before exec
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return tie


def exit_when_orphaned(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """In a child: end this process (exit code 1) as soon as `parent_pid` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(poll_s)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    thread = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    thread.start()
    return thread


__all__ = ["die_with_parent", "exit_when_orphaned"]
