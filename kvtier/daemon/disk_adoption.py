"""Adopting a disk tier's blocks again after a restart, in the background, after READY.

The block file (kvtier/disk/blockfile.py) outlives the daemon: after a clean stop, a kill -9 or a
reboot its headers still say which slot holds which block. Like the cpu arena's population
(kvtier/daemon/population.py), no slot is in service before its headers are scanned: a chunk of
slots is scanned in a thread (numpy over the mapped header table), and applied on the event
loop, where the blocks found are restored into the pool's Placement and listed for clients, and
the chunk's slots come into service. READY does not wait for it, whatever the file's size.

A header is only a claim: every read of the block verifies its bytes against the header's
checksum, so a file truncated or corrupted while the daemon was down costs misses, never wrong
bytes (adopt() already drops headers whose payload lies past the file's end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvtier.core.events import Tier
from kvtier.core.index import Entry
from kvtier.keys import BlockKey
from kvtier.tiers.pool import PoolRuntime

SCAN_SLOTS = 1 << 16  # slots per chunk: a few ms of numpy, then the loop runs other work


class DiskAdoption:
    def __init__(self, rt: PoolRuntime, log: Any, on_restored: Callable[[str, Tier, list[Entry]], None] | None = None,
                 ) -> None:
        assert rt.disk is not None
        self.rt = rt
        self.disk = rt.disk
        self.log = log.bind(pool=rt.name)
        self.on_restored = on_restored

    async def run(self) -> None:
        disk, placement, f = self.disk, self.rt.placement, self.disk.file
        t0 = time.monotonic()
        self.log.info("disk.adopting", path=str(f.path), blocks=f.n)
        for lo in range(0, f.n, SCAN_SLOTS):
            hi = min(f.n, lo + SCAN_SLOTS)
            found = await asyncio.to_thread(f.adopt, lo, hi)
            if disk.retired:  # an I/O error turned the tier off meanwhile
                return
            restored = []
            for slot, key, parent in zip(found.slots.tolist(), found.keys, found.parents):
                e = placement.restore(Tier.DISK, BlockKey(key), None if parent is None else BlockKey(parent), slot)
                if e is None:  # the same block in two slots: keep the first
                    f.invalidate(slot)
                    continue
                disk.publish(e)
                restored.append(e)
            placement.bring_into_service(Tier.DISK, range(lo, hi))
            disk.scanned, disk.adopted = hi, disk.adopted + len(restored)
            if restored and self.on_restored is not None:
                self.on_restored(self.rt.name, Tier.DISK, restored)
            await asyncio.sleep(0)
        disk.adopting = False
        disk.adopt_s = round(time.monotonic() - t0, 3)
        self.log.info("disk.adopted", path=str(f.path), blocks=f.n, adopted=disk.adopted, seconds=disk.adopt_s)
