"""A slot-based local tier of one pool: the gpu pool or the cpu arena.

It joins the shared slot headers (the truth readers verify against), the payload memory (the
shared mapping, or a CUDA tensor for a real GPU pool), the pure index and this tier's column in
the client directory. Every write is seqlocked; every read is verified.
"""

from __future__ import annotations

import numpy as np

from kvtier.bus.events import Tier
from kvtier.tiers.directory import NO_SLOT, DirectoryWriter
from kvtier.tiers.index import Entry, State, TierIndex
from kvtier.tiers.slots import SLOT_MAGIC, Flags, SlotTable, checksum


class LocalTier:
    def __init__(self, tier: Tier, table: SlotTable, index: TierIndex, directory: DirectoryWriter,
                 device_payload=None) -> None:
        self.tier = tier
        self.table = table
        self.index = index
        self.directory = directory
        # A torch CUDA tensor [n, block_bytes] when the gpu pool is on a real GPU; else None and
        # the payload lives in the shared mapping next to the headers.
        self.device_payload = device_payload

    @property
    def capacity(self) -> int:
        return self.table.n

    @property
    def block_bytes(self) -> int:
        return self.table.block_bytes

    def read(self, key: bytes, out: np.ndarray) -> int | None:
        """Copy `key`'s block into `out` (uint8, block_bytes); returns its checksum, or None on a miss."""
        e = self.index.get(key)
        if e is None or e.state is not State.READY:
            return None
        if self.device_payload is None:
            return self.table.read_into(e.slot, key, out)
        snap = self.table.begin_read(e.slot, key)
        if snap is None:
            return None
        out[:] = self.device_payload[e.slot].cpu().numpy()  # synchronous D2H
        # Clients can write a CUDA IPC mapping: verify the bytes before they travel further down.
        if not self.table.end_read(e.slot, snap[0], key) or checksum(out) != snap[1]:
            return None
        return snap[1]

    def write(self, key: bytes, parent: bytes | None, data: np.ndarray, csum: int) -> Entry | None:
        """Store a verified block and make it visible. None when the tier has no free slot.
        Writing a key that is already here is a no-op that returns the existing entry."""
        existing = self.index.get(key)
        if existing is not None:
            return existing
        e = self.index.reserve(key, parent)
        if e is None:
            return None
        try:
            if self.device_payload is None:
                self.table.write(e.slot, key, data, Flags.VALID, csum, parent)
            else:
                import torch  # only on the CUDA path

                g = self.table.begin_write(e.slot)
                self.device_payload[e.slot].copy_(torch.from_numpy(data))
                self.table.end_write(e.slot, g, key, self.block_bytes, csum, Flags.VALID, parent)
        except BaseException:
            self.table.invalidate(e.slot)
            self.index.remove(key)
            raise
        self.index.commit(key)
        self.directory.set_slot(key, int(self.tier), e.slot)
        return e

    def drop(self, key: bytes) -> bool:
        """Invalidate first (readers now miss), then unlist, then free the slot."""
        e = self.index.get(key)
        if e is None:
            return False
        self.table.invalidate(e.slot)
        self.directory.set_slot(key, int(self.tier), NO_SLOT)
        self.index.remove(key)
        return True

    def rebuild(self) -> tuple[int, int]:
        """Warm restart: re-index every slot whose header and checksum verify; wipe the rest.
        Returns (kept, discarded)."""
        kept = discarded = 0
        for slot in range(self.table.n):
            h = self.table.header(slot)
            if h.magic == 0 and h.gen == 0:
                continue  # never written
            ok = (h.magic == SLOT_MAGIC and h.gen % 2 == 0 and h.flags == Flags.VALID
                  and h.length == self.block_bytes and self.device_payload is None
                  and checksum(self.table.payload(slot)) == h.checksum
                  and self.index.get(h.key) is None)
            if ok and self.index.add(h.key, h.parent_key, slot) is not None:
                self.directory.set_slot(h.key, int(self.tier), slot)
                kept += 1
            else:
                self.table.invalidate(slot)  # torn (odd gen), corrupt or a duplicate
                discarded += h.flags == Flags.VALID or h.gen % 2 == 1
        return kept, discarded
