"""One tier worker: consumes its tier's command stream and carries out store, promote, demote, evict.

Uniform over tiers: the destination of a transfer pulls a verified copy from the source, stores
it, and reports a `stored` fact; the source keeps its copy until the coordinator, seeing that
fact, tells it to evict (write-back). Every command yields at most one fact, and every handler is
idempotent, because delivery is at least once. A failed transfer is a `removed` fact with a
`*_failed:<why>` cause, a counter and a log line, never a half-visible block.
"""

from __future__ import annotations

import time

import numpy as np
import redis.exceptions

from kvtier.bus.dedup import AppliedEntries
from kvtier.bus.events import Copy, Demote, Evict, Promote, Removed, Store, Stored, Tier
from kvtier.bus.transport import Delivery
from kvtier.errors import MalformedEvent, SegmentError
from kvtier.tiers.directory import IN_REDIS
from kvtier.tiers.fence import CommandFence
from kvtier.tiers.local import LocalTier
from kvtier.tiers.policy import DROP_REASONS
from kvtier.tiers.pool import PoolRuntime

Fact = Stored | Removed


class TierWorker:
    def __init__(self, tier: Tier, pools: dict[str, PoolRuntime], staging, publisher, facts_stream: str,
                 log) -> None:
        self.tier = tier
        self.pools = pools
        self.staging = staging
        self.publisher = publisher
        self.facts_stream = facts_stream
        self.log = log.bind(tier=tier.label)
        self._scratch: dict[int, np.ndarray] = {}
        self._facts: list[Fact] = []
        # Room for every block the node can hold, several times over: a stamp is only needed
        # while an old entry for that block could still be redelivered.
        local = sum((rt.cfg.gpu_blocks + rt.cfg.cpu_blocks) for rt in pools.values())
        self.fence = CommandFence(max(4096, 4 * local))
        self.applied = AppliedEntries()
        self._fences: list[tuple[str, bytes, tuple[int, int]]] = []  # applied in this batch

    def _buf(self, nbytes: int) -> np.ndarray:
        buf = self._scratch.get(nbytes)
        if buf is None:
            buf = self._scratch[nbytes] = np.empty(nbytes, dtype=np.uint8)
        return buf

    async def handle(self, d: Delivery) -> None:
        ev = d.envelope.event
        rt = self.pools.get(getattr(ev, "pool", ""))
        if rt is None:
            raise MalformedEvent(f"unknown pool {getattr(ev, 'pool', None)!r}")
        target = {Store: "tier", Promote: "dst", Demote: "dst", Copy: "dst", Evict: "tier"}.get(type(ev))
        if target is None or getattr(ev, target) != self.tier:
            raise MalformedEvent(f"{ev.TYPE} event is not a command for the {self.tier.label} worker")
        if self.applied.duplicate(d.envelope):  # carried out already, its fact published
            rt.counters.tiers[self.tier.label].stale += 1
            return
        stamp = (d.envelope.epoch, d.envelope.seq)
        if self.fence.stale(rt.name, ev.key, stamp):
            # Older than a command already applied to this block: a late redelivery. Its
            # outcome was reported the first time, or it was overtaken; applying it now would
            # undo a newer decision (re-add an evicted block, drop one that came back).
            rt.counters.tiers[self.tier.label].stale += 1
            if isinstance(ev, Store):
                self.staging.release(ev.segment, rt.layout.block_bytes, ev.slot, ev.gen)
            self.log.info("tier.command_fenced", pool=rt.name, op=ev.TYPE, key=ev.key.hex()[:16],
                          epoch=stamp[0], seq=stamp[1])
            return
        t0 = time.perf_counter()
        if isinstance(ev, Store):
            fact = await self._store(rt, ev)
        elif isinstance(ev, Evict):
            fact = await self._evict(rt, ev)
        else:
            fact = await self._transfer(rt, ev)
        if isinstance(fact, Stored):
            rt.counters.tiers[self.tier.label].timed(time.perf_counter() - t0)
        if fact is not None:
            self._facts.append(fact)
        self.applied.handled(d.envelope)
        self._fences.append((rt.name, ev.key, stamp))

    async def flush(self) -> None:
        """After each batch, before its acks: report every outcome in one pipeline."""
        facts, self._facts = self._facts, []
        fences, self._fences = self._fences, []
        try:
            if facts:
                await self.publisher.publish_many([(self.facts_stream, f) for f in facts])
        except BaseException:
            self.applied.discard()  # the batch comes back and must run again to report
            raise
        self.applied.commit()
        for pool, key, stamp in fences:
            self.fence.record(pool, key, stamp)

    # --- store: client staging -> this tier ---------------------------------------------------

    async def _store(self, rt: PoolRuntime, ev: Store) -> Fact:
        dst = rt.local(self.tier)
        if dst is None and self.tier != Tier.REDIS:
            raise MalformedEvent(f"pool {rt.name} has no {self.tier.label} tier")
        bb = rt.layout.block_bytes
        try:
            staging = self.staging.get(ev.segment, bb)
            if not 0 <= ev.slot < staging.n:
                raise SegmentError(f"slot {ev.slot} outside staging of {staging.n} slots")
        except SegmentError as e:
            return self._failed(rt, ev, "bad_staging", str(e), dropped=True)
        held = rt.placement.tiers[self.tier].get(ev.key)
        if held is not None:  # duplicate delivery, or another client put it first
            self.staging.release(ev.segment, bb, ev.slot, ev.gen)
            return Stored(rt.name, ev.key, ev.parent, self.tier, held.slot, Store.TYPE)
        buf = self._buf(bb)
        try:
            csum = staging.read_into(ev.slot, ev.key, ev.gen, buf)
        except OSError as e:
            return self._failed(rt, ev, "bad_staging", str(e), dropped=True)
        if csum is None:
            self.staging.release(ev.segment, bb, ev.slot, ev.gen)
            return self._failed(rt, ev, "verify", "staging slot changed or failed its checksum", dropped=True)
        if self.tier == Tier.REDIS:  # no local room: write the block through to Redis
            failed = await self._redis_put(rt, ev, buf, csum)
            self.staging.release(ev.segment, bb, ev.slot, ev.gen)
            if failed is not None:
                rt.counters.puts_dropped += 1
                return failed
            slot = -1
        else:
            entry = await self._write_local(rt, dst, ev.key, ev.parent, buf, csum)
            self.staging.release(ev.segment, bb, ev.slot, ev.gen)
            if entry is None:
                return self._failed(rt, ev, "no_room", "no free slot and nothing clean to evict", dropped=True)
            slot = entry.slot
        c = rt.counters.tiers[self.tier.label]
        c.stored += 1
        c.bytes_in += bb
        return Stored(rt.name, ev.key, ev.parent, self.tier, slot, Store.TYPE)

    async def _redis_put(self, rt: PoolRuntime, ev, payload: np.ndarray, csum: int) -> Removed | None:
        """Write to Redis and record it; a Removed failure fact if Redis refused."""
        try:
            await rt.redis.put(ev.key, payload, csum)
        except redis.exceptions.RedisError as e:
            rt.redis.stats.errors += 1
            return self._failed(rt, ev, "redis", f"{type(e).__name__}: {e}")
        if any(rt.placement.tiers[t].get(ev.key) is not None for t in (Tier.GPU, Tier.CPU)):
            # Remember it only while a local copy exists: that is what eviction consults.
            rt.placement.tiers[Tier.REDIS].add(ev.key, ev.parent)
            rt.directory.set_flag(ev.key, IN_REDIS, True)
        return None

    # --- promote / demote: another tier -> this tier -------------------------------------------

    async def _transfer(self, rt: PoolRuntime, ev: Promote | Demote | Copy) -> Fact:
        dst = rt.local(self.tier)
        if self.tier != Tier.REDIS:
            if dst is None:
                raise MalformedEvent(f"pool {rt.name} has no {self.tier.label} tier")
            if (have := dst.index.get(ev.key)) is not None:
                return Stored(rt.name, ev.key, ev.parent, self.tier, have.slot, ev.TYPE)
        got = await self._read_source(rt, ev)
        if got is None:
            if ev.src == Tier.REDIS:  # expired, evicted or corrupt there: stop believing in it
                self._forget_redis(rt, ev.key)
            return self._failed(rt, ev, "source_miss", f"{ev.src.label} no longer holds a valid copy")
        payload, csum = got
        if self.tier == Tier.REDIS:
            if (failed := await self._redis_put(rt, ev, payload, csum)) is not None:
                return failed
            slot = -1
        else:
            entry = await self._write_local(rt, dst, ev.key, ev.parent, payload, csum)
            if entry is None:
                return self._failed(rt, ev, "no_room", "no free slot and nothing clean to evict")
            slot = entry.slot
        c = rt.counters.tiers[self.tier.label]
        if isinstance(ev, Promote):
            c.promoted_in += 1
        elif isinstance(ev, Demote):
            c.demoted_in += 1
        else:
            c.copied_in += 1
        c.bytes_in += rt.layout.block_bytes
        self.log.debug("tier.transfer", pool=rt.name, op=ev.TYPE, src=ev.src.label, key=ev.key.hex()[:16])
        return Stored(rt.name, ev.key, ev.parent, self.tier, slot, ev.TYPE)

    async def _read_source(self, rt: PoolRuntime, ev: Promote | Demote | Copy) -> tuple[np.ndarray, int] | None:
        if ev.src == Tier.REDIS:
            try:
                return await rt.redis.get(ev.key)
            except redis.exceptions.RedisError as e:
                rt.redis.stats.errors += 1
                self.log.warning("tier.redis_read_failed", pool=rt.name, error=f"{type(e).__name__}: {e}")
                return None
        src = rt.local(ev.src)
        if src is None:
            return None
        buf = self._buf(rt.layout.block_bytes)
        csum = src.read(ev.key, buf)
        return None if csum is None else (buf, csum)

    async def _write_local(self, rt: PoolRuntime, dst: LocalTier, key: bytes, parent: bytes | None,
                           data: np.ndarray, csum: int):
        entry = dst.write(key, parent, data, csum)
        if entry is None and await self._make_room(rt, dst):
            entry = dst.write(key, parent, data, csum)
        return entry

    async def _make_room(self, rt: PoolRuntime, dst: LocalTier) -> bool:
        """Full: drop one block the next tier holds (confirmed with Redis for the cpu tier).
        Nothing is lost; False when no such block exists."""
        for _ in range(4):  # a stale Redis record costs one more try, not a loop
            victim = rt.placement.clean_victim(self.tier)
            if victim is None:
                return False
            if self.tier == Tier.CPU and not await self._redis_has(rt, victim):
                continue
            self._drop(rt, dst, victim)
            rt.counters.tiers[self.tier.label].evicted += 1
            self._facts.append(Removed(rt.name, victim, self.tier, "evict:make_room"))  # reported like any eviction
            self.log.info("tier.evicted", pool=rt.name, key=victim.hex()[:16], reason="make_room")
            return True
        return False

    async def _redis_has(self, rt: PoolRuntime, key: bytes) -> bool:
        """Confirm a block is really in Redis before dropping the last local copy: Redis may have
        expired or evicted it since we wrote it. Forget it if it is gone; any error means no."""
        try:
            (present,) = await rt.redis.exists([key])
        except redis.exceptions.RedisError as e:
            rt.redis.stats.errors += 1
            self.log.warning("tier.redis_check_failed", pool=rt.name, error=f"{type(e).__name__}: {e}")
            return False
        if not present:
            self._forget_redis(rt, key)
        return present

    def _forget_redis(self, rt: PoolRuntime, key: bytes) -> None:
        rt.placement.tiers[Tier.REDIS].remove(key)
        rt.directory.set_flag(key, IN_REDIS, False)

    def _drop(self, rt: PoolRuntime, local: LocalTier, key: bytes) -> None:
        """Drop a local copy. Once no local tier holds the block, stop tracking its Redis copy
        too: the daemon only needs to know about Redis for blocks it might drop locally, and
        that keeps the record bounded by local capacity."""
        local.drop(key)
        if all(rt.placement.tiers[t].get(key) is None for t in (Tier.GPU, Tier.CPU)):
            rt.placement.tiers[Tier.REDIS].remove(key)

    # --- evict ------------------------------------------------------------------------------------

    async def _evict(self, rt: PoolRuntime, ev: Evict) -> Fact | None:
        c = rt.counters.tiers[self.tier.label]
        if self.tier == Tier.REDIS:
            try:
                await rt.redis.delete(ev.key)
            except redis.exceptions.RedisError as e:
                rt.redis.stats.errors += 1
                raise  # leave the command pending: it is retried, then dead-lettered
            rt.placement.tiers[Tier.REDIS].remove(ev.key)
            rt.directory.set_flag(ev.key, IN_REDIS, False)
            c.evicted += 1
            return Removed(rt.name, ev.key, self.tier, f"evict:{ev.reason}")
        local = rt.local(self.tier)
        entry = None if local is None else local.index.get(ev.key)
        if entry is None:
            return None  # already gone: a duplicate
        if not entry.leaving:
            # A late or redelivered command: the policy chose this block to leave, but it has
            # since stayed (a child arrived, the move failed) or come back. Not ours to drop.
            c.stale += 1
            return None
        if (local.index.children(ev.key) or entry.pins > 1
                or (self.tier == Tier.CPU and rt.placement.tiers[Tier.GPU].children(ev.key))):
            # Decided a moment ago, but a child has arrived (here, or in gpu for a cpu block) or a
            # reader holds it since: tail first, and pins are honoured at the moment of eviction,
            # not only at the moment of choice.
            rt.placement.refused(self.tier, ev.key)
            c.refused += 1
            return None
        # Safe when a lower tier holds it: cpu (for gpu), or Redis, confirmed there first.
        safe = self.tier == Tier.GPU and ev.key in rt.placement.tiers[Tier.CPU]
        if not safe and ev.key in rt.placement.tiers[Tier.REDIS]:
            safe = await self._redis_has(rt, ev.key)
        safe = safe or ev.reason in DROP_REASONS  # a documented drop (the frequency filter)
        if not safe:
            # The only copy: refuse rather than lose it. The policy may choose it again later,
            # and will then demote it first.
            rt.placement.refused(self.tier, ev.key)
            c.refused += 1
            self.log.warning("tier.evict_refused", pool=rt.name, key=ev.key.hex()[:16], reason=ev.reason)
            return None
        self._drop(rt, local, ev.key)
        c.evicted += 1
        return Removed(rt.name, ev.key, self.tier, f"evict:{ev.reason}")

    def _failed(self, rt: PoolRuntime, ev, why: str, detail: str, dropped: bool = False) -> Removed:
        rt.counters.tiers[self.tier.label].failed += 1
        if dropped:
            rt.counters.puts_dropped += 1
        self.log.warning("tier.transfer_failed", pool=rt.name, op=ev.TYPE, key=ev.key.hex()[:16],
                         why=why, detail=detail)
        return Removed(rt.name, ev.key, self.tier, f"{ev.TYPE}_failed:{why}")
