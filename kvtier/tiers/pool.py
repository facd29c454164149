"""Everything the workers need about one pool: its layout, tiers, directory, policy and counters."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.events import Tier
from kvtier.core.index import Entry
from kvtier.core.policy import Placement
from kvtier.descriptor import PoolEntry, Segment
from kvtier.keys import BlockKey
from kvtier.layout import BlockLayout
from kvtier.shm.directory import IN_REDIS, DirectoryWriter
from kvtier.store.redis_blocks import RedisBlocks
from kvtier.tiers.arena_fill import ArenaFill
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.local import LocalTier
from kvtier.tiers.stats import PoolCounters

SlotTier = LocalTier | DiskTier  # a tier of slots on this node: the memory tiers, or the disk tier


@dataclass(slots=True)
class PoolRuntime:
    name: str
    layout: BlockLayout
    gpu: LocalTier | None
    cpu: LocalTier
    redis: RedisBlocks
    directory: DirectoryWriter
    placement: Placement
    counters: PoolCounters
    gpu_ipc: dict[str, object] | None = None
    arena: ArenaFill | None = None  # the cpu arena's population (kvtier/daemon/population.py)
    disk: DiskTier | None = None  # the disk tier, where the pool has one
    disk_error: str | None = None  # why a configured disk tier could not open at start (then `disk` is None)

    @property
    def local_blocks(self) -> int:
        """Blocks the node's tiers of this pool hold at most."""
        return (self.cpu.capacity + (self.gpu.capacity if self.gpu is not None else 0)
                + (self.disk.capacity if self.disk is not None else 0))

    def local(self, tier: Tier) -> SlotTier | None:
        """The slot tier on this node: gpu, cpu or disk (None: Redis, or a tier the pool lacks)."""
        return {Tier.GPU: self.gpu, Tier.CPU: self.cpu, Tier.DISK: self.disk}.get(tier)

    def retire_disk(self) -> list[Entry]:
        """The disk tier met an I/O error (its `fault`): it holds nothing and takes nothing from
        now on. The blocks it held, which the caller reports removed."""
        assert self.disk is not None and self.disk.fault is not None
        gone = self.placement.retired(Tier.DISK)
        self.disk.retire(gone)  # unlisted: a directory row left with no slot goes, its flags with it
        return gone

    # What a tier worker did, told to both the Placement (which owns the indices) and the client
    # directory. A local write or drop changes the slot (LocalTier) and the index in this order,
    # so a reader never finds a listed block its slot lacks.

    def finish(self, dst: SlotTier, e: Entry) -> Entry:
        """The reserved slot `e` of `dst` is filled: visible in the index, then to clients."""
        self.placement.commit(dst.tier, e.key)
        dst.publish(e)
        return e

    def finish_many(self, dst: LocalTier, entries: list[Entry]) -> None:
        """`finish` for a batch of reserved slots of `dst`, all filled: visible in the index, then
        to clients."""
        self.placement.commit_many(dst.tier, entries)
        dst.publish_many(entries)

    def abort(self, dst: SlotTier, e: Entry) -> None:
        """Filling the reserved slot failed (or was cancelled): empty it, then free it."""
        dst.discard(e)
        self.placement.unreserve(dst.tier, e.key)

    def drop(self, dst: SlotTier, key: BlockKey) -> None:
        """Drop `key` from `dst`: readers miss it first, then its slot is freed."""
        e = dst.index.get(key)
        if e is not None:
            dst.unlist(e)
            self.placement.dropped(dst.tier, key)

    def in_redis(self, key: BlockKey, parent: BlockKey | None) -> None:
        """Redis holds `key` now: the Placement records it while a local copy exists (eviction
        consults that record), and then clients are told too."""
        if self.placement.in_redis(key, parent):
            self.directory.set_flag(key, IN_REDIS, True)

    def not_in_redis(self, key: BlockKey) -> None:
        """Redis no longer holds `key`: neither the Placement nor the directory says it does."""
        self.placement.not_in_redis(key)
        self.directory.set_flag(key, IN_REDIS, False)

    def descriptor(self) -> PoolEntry:
        """This pool in the daemon's descriptor (kvtier/descriptor.py): what a client maps."""
        def part(t: LocalTier) -> Segment:
            return Segment(t.table.seg.name, t.capacity, str(t.table.seg.directory))

        gpu = None
        if self.gpu is not None:
            g = part(self.gpu)
            gpu = Segment(g.segment, g.capacity, g.dir, "cpu" if self.gpu_ipc is None else "cuda", self.gpu_ipc)
        disk = None
        if self.disk is not None:  # a block file: clients read it themselves (kvtier/disk/reader.py)
            f = self.disk.file
            disk = Segment(f.path.name, f.n, str(f.path.parent), "disk")
        return PoolEntry(self.layout, self.layout.fingerprint.hex(), self.layout.block_bytes, gpu, part(self.cpu),
                         Segment(self.directory.seg.name, self.directory.capacity), disk)
