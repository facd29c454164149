"""A cpu arena brought into service a chunk at a time, so the daemon serves long before a big
arena is populated.

A chunk is a run of slots. Bringing it into service takes two steps:
- `prepare` (in a population thread, GIL released): allocate its pages where the file has
  holes, fault them in; on a warm restart also read its slot headers and verify the kept blocks'
  checksums;
- `apply` (on the event loop, the index's only writer): restore the verified blocks, wipe the
  torn and the corrupt, and hand the chunk's other slots to the index as free.
No slot is handed out before its chunk is applied, so a write never lands on an unallocated page
(no SIGBUS), and no reader is pointed at a slot that was not verified.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.events import Tier
from kvtier.core.index import Entry
from kvtier.core.residency import Residency
from kvtier.keys import BlockKey
from kvtier.shm.backing import Backing
from kvtier.shm.populate import PageFiller
from kvtier.shm.slots import EMPTY_KEY, SLOT_MAGIC, Flags, checksum, key_tag
from kvtier.tiers.local import LocalTier


@dataclass(slots=True)
class Chunk:
    slots: range
    start: int  # the chunk's payload bytes in the segment: [start, end)
    end: int
    holes: list[tuple[int, int]]  # parts of [start, end) with no pages yet


@dataclass(slots=True)
class Prepared:
    chunk: Chunk
    kept: list[tuple[int, bytes, bytes | None]]  # warm restart: (slot, key, parent) verified
    wipe: list[int]  # written slots that are torn, corrupt or not blocks
    torn: int = 0  # of those, caught mid-write (odd gen): the daemon died writing them


def plan_chunks(n: int, stride: int, payload_off: int, chunk_bytes: int,
                allocated: list[tuple[int, int]]) -> list[Chunk]:
    """Chunks of whole slots, about `chunk_bytes` each, lowest slots first; `allocated` are the
    byte ranges that hold pages already (all of them for none: a new file)."""
    per = max(1, chunk_bytes // stride)
    chunks = []
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        start, end = payload_off + lo * stride, payload_off + hi * stride
        chunks.append(Chunk(range(lo, hi), start, end, holes_in(start, end, allocated)))
    return chunks


def holes_in(start: int, end: int, allocated: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) outside the `allocated` ranges (sorted, disjoint)."""
    holes, pos = [], start
    for a, b in allocated:
        if b <= pos or a >= end:
            continue
        if a > pos:
            holes.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        holes.append((pos, end))
    return holes


@dataclass(slots=True)
class ArenaFill:
    """One cpu arena's population: the chunks still to do, and the figures status shows."""

    tier: LocalTier
    filler: PageFiller
    backing: Backing
    warm: bool
    chunks: list[Chunk]
    numa_node: int | None = None
    huge_fallback: str = ""  # why huge pages were asked for and not used
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    populated_bytes: int = 0
    kept: int = 0
    discarded: int = 0  # slots that held something other than a whole, verified block: torn + corrupt
    torn: int = 0  # of those, caught mid-write (the daemon was killed writing them)
    state: str = "populating"  # populating | populated | failed
    error: str = ""

    @property
    def total_bytes(self) -> int:
        return self.tier.table.n * self.tier.table.stride

    def prepare(self, chunk: Chunk) -> Prepared:
        """The slow part of one chunk: runs in a population thread, touching only its slots."""
        for lo, hi in chunk.holes:
            self.filler.allocate(lo, hi)
        self.filler.fault_in(chunk.start, chunk.end)  # once for the whole chunk, holes or not
        if not self.warm:
            return Prepared(chunk, [], [])
        return self._scan(chunk)

    def _scan(self, chunk: Chunk) -> Prepared:
        t = self.tier.table
        lo, hi = chunk.slots.start, chunk.slots.stop
        h = t.headers(lo, hi).copy()  # a snapshot: nobody writes these slots until apply
        written = (h["magic"] != 0) | (h["gen"] != 0)
        even = h["gen"] % 2 == 0
        whole = (h["magic"] == SLOT_MAGIC) & even & (h["flags"] == Flags.VALID) & (h["length"] == t.block_bytes)
        # A slot freed by an eviction: a header with no block. Not a loss, nothing to wipe.
        freed = (h["magic"] == SLOT_MAGIC) & even & (h["flags"] == Flags.EMPTY)
        kept: list[tuple[int, bytes, bytes | None]] = []
        wipe = [lo + int(i) for i in np.flatnonzero(written & ~whole & ~freed)]
        torn = int(np.count_nonzero(written & ~even))
        keys, parents = h["key"].tobytes(), h["parent"].tobytes()
        for i in np.flatnonzero(whole):
            slot = lo + int(i)
            key, csum = keys[32 * i : 32 * i + 32], int(h["checksum"][i])
            # The tag: a header one writer wrote whole (two writers of a granted slot could mix them).
            if int(h["tag"][i]) != key_tag(key, csum) or checksum(t.payload(slot)) != csum:  # xxh3 drops the GIL
                wipe.append(slot)
                continue
            parent = parents[32 * i : 32 * i + 32]
            kept.append((slot, key, None if parent == EMPTY_KEY else parent))
        return Prepared(chunk, kept, wipe, torn)

    def apply(self, p: Prepared, residency: Residency, batch: int = 1024) -> Iterator[list[Entry]]:
        """On the event loop: restore what `prepare` verified, `batch` blocks at a time (each
        batch yielded, so the caller can let the loop run between them: restoring costs some
        microseconds a block), then bring the chunk into service once the generator is done."""
        table = self.tier.table
        for slot in p.wipe:
            table.invalidate(slot)
        self.discarded += len(p.wipe)
        self.torn += p.torn
        for i in range(0, len(p.kept), batch):
            restored = []
            for slot, key, parent in p.kept[i : i + batch]:
                e = residency.restore(Tier.CPU, BlockKey(key), None if parent is None else BlockKey(parent), slot)
                if e is None:  # the same block in two slots: keep the first
                    table.invalidate(slot)
                    self.discarded += 1
                    continue
                self.tier.publish(e)
                restored.append(e)
            self.kept += len(restored)
            yield restored
        residency.bring_into_service(Tier.CPU, p.chunk.slots)
        self.populated_bytes += p.chunk.end - p.chunk.start

    def apply_all(self, p: Prepared, residency: Residency) -> list[Entry]:
        """`apply` in one go (the first chunk, before READY; tools)."""
        return [e for batch in self.apply(p, residency) for e in batch]

    def done(self, error: str = "") -> None:
        self.finished = time.monotonic()
        self.state, self.error = ("failed", error) if error else ("populated", "")

    def stats(self) -> dict[str, object]:
        return {
            "state": self.state,
            "error": self.error,
            "bytes": self.total_bytes,
            "populated_bytes": self.populated_bytes,
            "slots": self.tier.table.n,
            "in_service": self.tier.index.capacity,
            "warm": self.warm,
            "kept": self.kept,
            "discarded": self.discarded,
            "torn": self.torn,
            "backing": self.backing.describe,
            "page_bytes": self.backing.page_bytes,
            "huge_fallback": self.huge_fallback,
            "numa_node": self.numa_node,
            "populate_s": None if self.finished is None else round(self.finished - self.started, 3),
        }
