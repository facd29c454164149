"""A slot-based local tier of one pool: the gpu pool or the cpu arena.

It joins the shared slot headers (the truth readers verify against), the payload memory (the
shared mapping, or a CUDA tensor for a real GPU pool), the pure index and this tier's column in
the client directory. Every write is seqlocked; every read is verified.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.core.events import Tier
from kvtier.core.index import Entry, State, TierIndex
from kvtier.keys import BlockKey
from kvtier.shm.directory import NO_SLOT, DirectoryWriter
from kvtier.shm.slots import EMPTY_KEY, Flags, SlotTable, checksum


class LocalTier:
    """The slots and payload of one local tier. The index is the pool's Placement's: read here,
    changed only through the Placement (the tier worker reserves, commits and drops there, and
    does the slot I/O here; a warm restart restores there)."""

    def __init__(self, tier: Tier, table: SlotTable, index: TierIndex, directory: DirectoryWriter,
                 device_payload: Any = None) -> None:
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

    def read(self, key: BlockKey, out: np.ndarray) -> int | None:
        """Copy `key`'s block into `out` (uint8, block_bytes); returns its checksum, or None on a miss."""
        slot = self.slot_of(key)
        return None if slot is None else self.read_slot(slot, key, out)

    def slot_of(self, key: BlockKey) -> int | None:
        e = self.index.get(key)
        return e.slot if e is not None and e.state is State.READY else None

    def read_slot(self, slot: int, key: BlockKey, out: np.ndarray) -> int | None:
        """The copy and its verification. Touches only the slot (seqlocked: a slot rewritten
        meanwhile is a miss), never the index, so it may run off the event loop."""
        if self.device_payload is None:
            return self.table.read_into(slot, key, out)
        snap = self.table.begin_read(slot, key)
        if snap is None:
            return None
        import torch  # only on the CUDA path

        from kvtier.shm.device_sum import device_sum

        # Clients can write a CUDA IPC mapping: the bytes that travel on are a copy verified on
        # the device (the header holds the device sum), then brought back to the host, where the
        # next tier's checksum (xxh3) is made of what arrived.
        scratch = self._scratch()
        scratch.copy_(self.device_payload[slot])
        if device_sum(scratch) != snap[1]:
            return None
        torch.from_numpy(out).copy_(scratch)  # a blocking D2H, straight into out
        if not self.table.end_read(slot, snap[0], key):
            return None
        return checksum(out)

    def _scratch(self) -> Any:
        """A block's room on the pool's device, private to this call: reads and fills run in
        several copy threads at once. (torch's caching allocator makes this cheap.)"""
        import torch  # only on the CUDA path

        return torch.empty_like(self.device_payload[0])

    # The slot side of a write, around the Placement's reserve and commit: `fill` (or `begin_fill` and `end_fill`)
    # touches only the reserved slot, so it may run off the event loop; `publish` lists the
    # committed block in the client directory, `discard` empties the slot of a failed write.

    def fill(self, e: Entry, data: np.ndarray, csum: int) -> None:
        """Write a block verified as `csum` (xxh3) into the reserved slot."""
        if self.device_payload is None:
            self.table.write(e.slot, e.key, data, Flags.VALID, csum, e.parent)
        else:
            import torch  # only on the CUDA path

            from kvtier.shm.device_sum import device_sum

            # A CUDA pool's headers hold the device sum of the verified data (csum), taken on a
            # private scratch copy: a client writing the slot through its IPC mapping meanwhile
            # cannot get its bytes summed in.
            scratch = self._scratch()
            scratch.copy_(torch.from_numpy(data))
            csum = device_sum(scratch)
            g = self.table.begin_write(e.slot)
            self.device_payload[e.slot].copy_(scratch)
            self.table.end_write(e.slot, g, e.key, self.block_bytes, csum, Flags.VALID, e.parent)

    def begin_fill(self, e: Entry) -> tuple[int, np.ndarray]:
        """Start filling the reserved slot in place (a staging pread straight into the arena: one
        copy fewer than through a buffer): its odd gen, and its payload to copy into. A batch
        verifies its sources once for all its blocks before `end_fill` (tiers/staged.py)."""
        return self.table.begin_write(e.slot), self.table.payload(e.slot)

    def end_fill(self, e: Entry, odd_gen: int, csum: int | None) -> int | None:
        """Publish the filled slot with its verified checksum, or (None) leave it empty."""
        if csum is None:
            self.table.end_write(e.slot, odd_gen, EMPTY_KEY, 0, 0, Flags.EMPTY)
            return None
        self.table.end_write(e.slot, odd_gen, e.key, self.block_bytes, csum, Flags.VALID, e.parent)
        return csum

    def publish(self, e: Entry) -> None:
        self.directory.set_slot(e.key, int(self.tier), e.slot)

    def publish_many(self, entries: list[Entry]) -> None:
        self.directory.set_slots(int(self.tier), [e.key for e in entries], [e.slot for e in entries])

    def discard(self, e: Entry) -> None:
        self.table.invalidate(e.slot)

    def unlist(self, e: Entry) -> None:
        """The slot side of a drop, before the Placement frees the slot: invalidate first (readers
        now miss), then unlist."""
        self.table.invalidate(e.slot)
        self.directory.set_slot(e.key, int(self.tier), NO_SLOT)
