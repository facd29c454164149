"""Tie a child process's life to its parent's (Linux PR_SET_PDEATHSIG), for subprocess preexec_fn."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Runs in the child between fork and exec: the kernel sends `sig` when the parent dies,
    so a SIGKILLed parent leaves no orphan running."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
