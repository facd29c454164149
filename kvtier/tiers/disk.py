"""The disk tier of one pool: a local tier whose slots are a block file (kvtier/disk/blockfile.py).

It offers the workers what a LocalTier does (slot_of, read_slot, fill, publish, discard, unlist),
so the tier worker's store, promote, demote and evict run over it unchanged; its I/O always runs
off the event loop (the daemon gives the disk worker an off-loop threshold of 0).

A DiskFault (EIO, ENOSPC, EROFS: the block file raises nothing else) on any read or write turns
the tier off: the failing call is a miss or a failed transfer, `fault` is set at once (from
whichever thread met it, so every later call misses without touching the device), and the next
worker on the event loop to see it retires the tier (`PoolRuntime.retire_disk`): its blocks are
forgotten, reported removed, and the tiers above shed past it into Redis.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvtier.core.events import Tier
from kvtier.core.index import Entry, State, TierIndex
from kvtier.disk.blockfile import DiskBlockFile
from kvtier.errors import DiskFault
from kvtier.keys import BlockKey
from kvtier.shm.directory import NO_SLOT, DirectoryWriter


class DiskTier:
    tier = Tier.DISK
    device_payload = None  # the LocalTier interface: no device memory

    def __init__(self, file: DiskBlockFile, index: TierIndex, directory: DirectoryWriter, adopted: bool) -> None:
        self.file = file
        self.index = index
        self.directory = directory
        self.fault: DiskFault | None = None  # the first I/O error: the tier is off from then on
        self.off_at: float | None = None  # when the tier was retired (wall clock)
        self.lost = 0  # blocks it held when it was retired
        # Adoption of what the file held at start (kvtier/daemon/disk_adoption.py).
        self.adopting = adopted
        self.scanned = 0  # slots whose headers were scanned
        self.adopted = 0  # blocks restored from them
        self.adopt_s: float | None = None

    @property
    def capacity(self) -> int:
        return self.file.n

    @property
    def block_bytes(self) -> int:
        return self.file.block_bytes

    @property
    def retired(self) -> bool:
        return self.off_at is not None

    def _failed(self, e: DiskFault) -> None:
        if self.fault is None:
            self.fault = e

    # --- reads -------------------------------------------------------------------------------------

    def slot_of(self, key: BlockKey) -> int | None:
        e = self.index.get(key)
        return e.slot if e is not None and e.state is State.READY else None

    def read_slot(self, slot: int, key: BlockKey, out: np.ndarray) -> int | None:
        """The verified block in `slot` (its checksum), or None: torn, replaced, corrupt, or the
        tier is off (an I/O error here turns it off)."""
        if self.fault is not None:
            return None
        try:
            return self.file.read_into(slot, key, out)
        except DiskFault as e:
            self._failed(e)
            return None

    # --- writes ------------------------------------------------------------------------------------

    def fill(self, e: Entry, data: np.ndarray, csum: int) -> None:
        if self.fault is not None:
            raise self.fault
        try:
            self.file.write(e.slot, e.key, data, e.parent, csum)
        except DiskFault as err:
            self._failed(err)
            raise

    def publish(self, e: Entry) -> None:
        if not self.retired:  # a write that finished after the tier was retired stays unlisted
            self.directory.set_slot(e.key, int(Tier.DISK), e.slot)

    def discard(self, e: Entry) -> None:
        self.file.invalidate(e.slot)

    def unlist(self, e: Entry) -> None:
        self.file.invalidate(e.slot)
        self.directory.set_slot(e.key, int(Tier.DISK), NO_SLOT)

    def retire(self, gone: list[Entry]) -> None:
        """The pool's Placement retired the tier, forgetting `gone`: clients stop finding them."""
        for e in gone:
            self.directory.set_slot(e.key, int(Tier.DISK), NO_SLOT)
        self.lost = len(gone)
        self.off_at = time.time()
        self.adopting = False

    def stats(self) -> dict[str, Any]:
        f = self.fault
        return {
            "state": "off" if f is not None else "adopting" if self.adopting else "on",
            "path": str(self.file.path),
            "direct": self.file.direct,
            "error": None if f is None else f"{f.op}: {f}",
            "errno": None if f is None else f.errno,
            "off_at": self.off_at,
            "lost": self.lost,
            "scanned": self.scanned,
            "adopted": self.adopted,
            "adopt_s": self.adopt_s,
        }
