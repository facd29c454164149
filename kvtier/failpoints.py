"""Named crash points for fault tests: the daemon SIGKILLs itself (or stalls) when it reaches one.

`[daemon] failpoint = "<name>[:<n>]"` (or KVTIER__DAEMON__FAILPOINT) arms one point: the n-th
time (default 1) the daemon passes it, it dies as a power cut would, with no cleanup. Empty, the
default, arms nothing and each check is one string comparison. The points sit where a crash is
hardest to recover from (fail-rs and gofail do the same for TiKV and etcd):

- shm_written: a block's bytes and header are in the arena, but neither the index, the
  directory nor the stream knows it yet.
- shm_torn:    a cpu arena slot is half written (odd generation, part of the bytes copied).
- after_xadd:  a batch's outcomes are published (XADD), but its entries are not yet acked.
- redis_write: a pipeline of Redis writes is in flight.
- block_loop:  not a crash: the event loop is blocked for BLOCK_S seconds, as by a handler that
  hogs it (reached on every stats write); the systemd watchdog pings must stop meanwhile.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time

NAMES = ("shm_written", "shm_torn", "after_xadd", "redis_write", "block_loop")
BLOCK_S = 3.0
SPEC = re.compile(rf"({'|'.join(NAMES)})(?::([1-9][0-9]{{0,6}}))?")


class Failpoints:
    def __init__(self, spec: str = "") -> None:
        m = SPEC.fullmatch(spec) if spec else None
        if spec and m is None:
            raise ValueError(f"failpoint must be one of {', '.join(NAMES)}, optionally ':<n>'; got {spec!r}")
        self.name = m.group(1) if m else ""
        self.after = int(m.group(2) or 1) if m else 0
        self.passed = 0

    def armed(self, name: str) -> bool:
        return name == self.name

    def due(self, name: str) -> bool:
        """Count a pass; True when this pass is the fatal one (the caller then sets the scene
        and calls `die`)."""
        if name != self.name:
            return False
        self.passed += 1
        return self.passed == self.after

    def reached(self, name: str) -> None:
        if self.due(name):
            if name == "block_loop":
                time.sleep(BLOCK_S)  # deliberately on the event loop
            else:
                self.die()

    @staticmethod
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


IO_SPEC = re.compile(r"(eio|enospc|erofs)(?::(read|write))?(?::([1-9][0-9]{0,6}))?")


class IoFaults:
    """Injected I/O errors for the disk tier's fault tests (`[disk] inject_fault`):
    `<eio|enospc|erofs>[:read|write][:n]` fails the n-th I/O of that kind (default the first)
    and every one after it, as a device that has failed stays failed. Empty arms nothing."""

    def __init__(self, spec: str = "") -> None:
        m = IO_SPEC.fullmatch(spec) if spec else None
        if spec and m is None:
            raise ValueError(f"inject_fault must be eio, enospc or erofs, optionally ':read' or ':write' and ':<n>'; "
                             f"got {spec!r}")
        self.err = {"eio": errno.EIO, "enospc": errno.ENOSPC, "erofs": errno.EROFS}[m.group(1)] if m else 0
        self.op = (m.group(2) or "") if m else ""
        self.after = int(m.group(3) or 1) if m else 0
        self.passed = 0

    def check(self, op: str) -> None:
        """Count an I/O of kind `op`; raise the injected error once it is due."""
        if not self.err or (self.op and op != self.op):
            return
        self.passed += 1
        if self.passed >= self.after:
            raise OSError(self.err, f"{os.strerror(self.err)} (injected)")
