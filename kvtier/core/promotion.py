"""Promotion: blocks brought up a tier, on hits, by prefetch, or after reads straight from Redis.
Pure: no I/O; time is passed in.

- A block read `promote_after_hits` times while only in cpu is promoted to gpu if gpu has room.
  (A read also ends the block's prefetch lease, and under the frequency filter copies the block
  to Redis on its N-th read: core/write_through.py.)
- A prefetch promotes the blocks that are not local from Redis into `prefetch_to` (cpu, or gpu
  while it has room). A promote is sent only with a slot for it: a free one, or one the worker can
  free at once by dropping a clean cpu block. A block with neither waits (up to half the tier, for
  `prefetch_lease_s`) and is promoted as shedding frees room. Prefetched blocks are leased for
  `prefetch_lease_s`: shedding skips them until they are read or the lease runs out, and a move
  out of a tier chosen before the prefetch is called off, so a prefetch into a full tier is not
  undone before the client gets to read it. Leases cover at most half the local slots, so
  prefetches cannot crowd out blocks being read.
- A block a client read straight from Redis (read-through, `RemoteRead`)
  `promote_remote_after_reads` times is promoted into cpu when cpu has a slot for it now (free,
  or a clean block the worker drops at once), and never waits for one: the client has its bytes
  already, so bringing them up only helps the next reader. The reads are counted for at most as
  many blocks as the node holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.core.events import Command, Promote, Tier
from kvtier.core.index import State, TierIndex
from kvtier.core.knobs import PolicyKnobs
from kvtier.core.residency import LOCAL, NODE
from kvtier.core.shedding import Shedding
from kvtier.core.write_through import copy_on_read, copy_on_read_on
from kvtier.keys import BlockKey


class Promotion(Shedding):
    def __init__(self, pool: str, tiers: dict[Tier, TierIndex], knobs: PolicyKnobs) -> None:
        super().__init__(pool, tiers, knobs)
        # Blocks read straight from Redis and not yet brought up: key -> reads, oldest first.
        self._remote_reads: OrderedDict[BlockKey, int] = OrderedDict()

    def on_access(self, keys: Iterable[BlockKey], now: float) -> list[Command]:
        self._expire(now)
        out: list[Command] = []
        gpu, cpu, disk = self.tiers[Tier.GPU], self.tiers[Tier.CPU], self.tiers[Tier.DISK]
        # A get of thousands of blocks is one call: what holds for the whole batch is asked once
        # (an empty index touches nothing; copy_on_read copies nothing with its filter off).
        leases, after = self._leases, self.knobs.promote_after_hits
        on_gpu, on_disk, copies = bool(gpu.used), bool(disk.used), copy_on_read_on(self.knobs)
        for key in keys:
            if leases:
                leases.pop(key, None)  # read: the lease has served its purpose
            g = gpu.touch(key) if on_gpu else None
            c = cpu.touch(key)
            d = disk.touch(key) if on_disk else None
            if (g is None and c is not None and c.state is State.READY and c.hits >= after
                    and key not in self._incoming[Tier.GPU] and self.room(Tier.GPU) > 0):
                out.append(Promote(self.pool, key, c.parent, Tier.CPU, Tier.GPU, c.slot, 0))
                self._incoming[Tier.GPU].add(key, c.parent, now + self.knobs.transfer_timeout_s)
            elif (g is None and c is None and d is not None and d.state is State.READY and d.hits >= after
                  and key not in self._incoming[Tier.CPU] and self.room(Tier.CPU) > 0):
                # Read from disk often enough: back up into memory while cpu has a free slot.
                out.append(Promote(self.pool, key, d.parent, Tier.DISK, Tier.CPU, d.slot, 0))
                self._incoming[Tier.CPU].add(key, d.parent, now + self.knobs.transfer_timeout_s)
            if copies and (copy := copy_on_read(self, self.knobs, self.pool, key, g, c)) is not None:
                out.append(copy)
        return out

    def on_prefetch(self, keys: Sequence[BlockKey], head_parent: BlockKey | None, now: float) -> list[Command]:
        out: list[Command] = []
        expiry = now + self.knobs.prefetch_lease_s
        cpu = self.tiers[Tier.CPU]
        parent = head_parent
        to_gpu = self.knobs.prefetch_to == Tier.GPU and bool(self.tiers[Tier.GPU].capacity)
        spares: int | None = None  # clean blocks cpu may drop for these promotes (counted once)
        for key in keys:
            g, c = (self.tiers[t].get(key) for t in LOCAL)
            if g is None and c is None:
                dst = Tier.GPU if to_gpu and self.room(Tier.GPU) > 0 else Tier.CPU
                if all(key not in self._incoming[t] for t in LOCAL) and key not in self._wanted:
                    full = dst == Tier.CPU and self.room(Tier.CPU) <= 0
                    if full:
                        # A block Redis holds can make way at once (the worker drops it).
                        if spares is None:
                            spares = self._clean_spares(Tier.CPU, len(keys))
                        full, spares = (False, spares - 1) if spares > 0 else (True, spares)
                    if full:
                        # No slot to promote into yet: wait for one (shedding makes it) rather
                        # than send a promote that can only fail for want of room. At most half
                        # the tier waits, so one huge prefetch cannot flush the whole tier.
                        if len(self._wanted) < (cpu.capacity or 0) // 2:
                            self._wanted[key] = (parent, expiry)
                    else:
                        src, slot = self._source(key)
                        out.append(Promote(self.pool, key, parent, src, dst, slot, 0))
                        self._incoming[dst].add(key, parent, now + self.knobs.transfer_timeout_s)
            elif (to_gpu and g is None and c is not None and c.state is State.READY
                  and self.room(Tier.GPU) > 0 and key not in self._incoming[Tier.GPU]):
                out.append(Promote(self.pool, key, parent, Tier.CPU, Tier.GPU, c.slot, 0))
                self._incoming[Tier.GPU].add(key, parent, now + self.knobs.transfer_timeout_s)
            else:
                cpu.touch(key)
            if len(self._leases) < self._lease_cap:
                self._leases[key] = expiry
                # Leased: a move out decided before this prefetch is called off, so that the
                # block stays on the node until it is read (a late evict finds it no longer
                # leaving and skips it; a write-back that completes leaves a spare copy below).
                for t in NODE:
                    if (e := self.tiers[t].get(key)) is not None and e.leaving:
                        self._unmark(t, key)
            parent = key
        return out

    def on_remote_read(self, keys: Sequence[BlockKey], head_parent: BlockKey | None, now: float) -> list[Command]:
        """A client read this chain straight from Redis: count the reads, and promote each block
        read `promote_remote_after_reads` times into cpu if cpu has a slot for it now."""
        n = self.knobs.promote_remote_after_reads
        if not n:
            return []
        out: list[Command] = []
        cap = max(1, sum(self.tiers[t].capacity or 0 for t in LOCAL))
        spares: int | None = None
        parent = head_parent
        for key in keys:
            here = any(self.tiers[t].get(key) is not None or key in self._incoming[t] for t in NODE)
            if not here and key not in self._wanted:
                reads = self._remote_reads.pop(key, 0) + 1
                ready = reads >= n
                if ready and self.room(Tier.CPU) <= 0:  # a clean block the worker may drop makes room
                    spares = self._clean_spares(Tier.CPU, len(keys)) if spares is None else spares
                    ready, spares = (True, spares - 1) if spares > 0 else (False, spares)
                if ready:
                    out.append(Promote(self.pool, key, parent, Tier.REDIS, Tier.CPU, -1, 0))
                    self._incoming[Tier.CPU].add(key, parent, now + self.knobs.transfer_timeout_s)
                else:  # not read often enough yet, or no room now: the next read asks again
                    self._remote_reads[key] = reads
                    while len(self._remote_reads) > cap:
                        self._remote_reads.popitem(last=False)
            parent = key
        return out

    @property
    def _lease_cap(self) -> int:
        """Leases may cover at most half the local slots: prefetches must not pin the whole tier
        and push out the hot blocks that are read, not prefetched."""
        return sum(self.tiers[t].capacity or 0 for t in LOCAL) // 2

    def _promote_wanted(self, now: float) -> list[Command]:
        """Promote the prefetched blocks waiting for cpu room, as far as there is room now."""
        out: list[Command] = []
        for key in list(self._wanted):
            if self.room(Tier.CPU) <= 0:
                break
            parent, _ = self._wanted.pop(key)
            if any(self.tiers[t].get(key) is not None or key in self._incoming[t] for t in LOCAL):
                continue
            src, slot = self._source(key)
            out.append(Promote(self.pool, key, parent, src, Tier.CPU, slot, 0))
            self._incoming[Tier.CPU].add(key, parent, now + self.knobs.transfer_timeout_s)
        return out

    def _source(self, key: BlockKey) -> tuple[Tier, int]:
        """Where a block not in memory is promoted from: this node's disk tier when it holds it
        (a local read), else Redis."""
        d = self.tiers[Tier.DISK].get(key)
        if d is not None and d.state is State.READY:
            return Tier.DISK, d.slot
        return Tier.REDIS, -1
