"""Map a client's view of the cpu arena ahead of use, in a background thread.

A fresh mapping of a populated shared-memory file still takes a minor page fault on the first
touch of each 4 KiB page: measured here, 0.39 s per GiB on a first write against 0.06 s for the
copy itself, which made a client's first puts into granted slots (kvtier/tiers/grants.py) slower
than staging. MADV_POPULATE_READ (Linux 5.14) maps the pages in one call per chunk, about 0.1 s
per GiB, with the GIL released (ctypes), so the client's first reads and writes run at memory
speed. The page tables cost about 2 MiB per GiB mapped, as they would once every page had been
touched anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import threading

MADV_POPULATE_READ = 22
CHUNK = 64 << 20


class Prefault:
    """Populates [addr, addr + size) chunk by chunk in a daemon thread until done or stopped."""

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size
        self.done = 0  # bytes mapped so far
        self.error: str | None = None  # why it gave up (an old kernel: EINVAL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-prefault", daemon=True)

    def start(self) -> Prefault:
        self._thread.start()
        return self

    def _run(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        off = 0
        while off < self.size and not self._stop.is_set():
            n = min(CHUNK, self.size - off)
            if libc.madvise(self.addr + off, n, MADV_POPULATE_READ) != 0:
                self.error = errno.errorcode.get(ctypes.get_errno(), "?")
                return
            off += n
            self.done = off

    def stop(self, timeout: float = 5.0) -> None:
        """Stop before the mapping goes: at most the chunk in progress finishes."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
