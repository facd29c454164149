"""Small process facts shared by the daemon, the client and the demo: liveness and parent death."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Runs in the child between fork and exec: the kernel sends `sig` when the parent dies,
    so a SIGKILLed parent leaves no orphan running."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


def pid_alive(pid: object) -> bool:
    """Whether a process with this pid exists (one of another user's counts as alive)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_processes(procs: Sequence[subprocess.Popen[Any]], timeout: float, sig: int = signal.SIGTERM) -> None:
    """Send `sig` (SIGTERM) to every one still running, then wait up to `timeout` each; SIGKILL
    what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
