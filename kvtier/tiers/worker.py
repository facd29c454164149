"""One tier worker: consumes its tier's command stream and carries out store, promote, demote, evict.

Uniform over tiers: the destination of a transfer pulls a verified copy from the source, stores
it, and reports a `stored` fact; the source keeps its copy until the coordinator, seeing that
fact, tells it to evict (write-back). Every command yields at most one fact, and every handler is
idempotent, because delivery is at least once. A failed transfer is a `removed` fact with a
`*_failed:<why>` cause, a counter and a log line, never a half-visible block.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import redis.exceptions

from kvtier.bus.dedup import AppliedEntries
from kvtier.core.events import Copy, Demote, Evict, Promote, Removed, Store, Stored, Tier
from kvtier.bus.transport import Delivery
from kvtier.errors import MalformedEvent, SegmentError
from kvtier.failpoints import Failpoints
from kvtier.offload import map_shares, run_off_loop
from kvtier.shm.directory import IN_REDIS
from kvtier.core.fence import CommandFence
from kvtier.core.index import Entry
from kvtier.tiers.local import LocalTier
from kvtier.core.eviction import (
    REFUSED,
    Verdict,
    after_local_drop,
    after_redis_check,
    evict_verdict,
    forget_redis_copy,
)
from kvtier.tiers.pool import PoolRuntime

if TYPE_CHECKING:
    from kvtier.shm.staging import StagingFile

Fact = Stored | Removed


class TierWorker:
    def __init__(self, tier: Tier, pools: dict[str, PoolRuntime], staging, publisher, facts_stream: str,
                 log, *, off_loop_bytes: int = 256 << 10, pipeline_bytes: int = 64 << 20, copy_threads: int = 1,
                 failpoints: Failpoints | None = None) -> None:
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
        local = sum(rt.local_blocks for rt in pools.values())
        self.fence = CommandFence(max(4096, 4 * local))
        self.applied = AppliedEntries()
        self._fences: list[tuple[str, bytes, tuple[int, int]]] = []  # applied in this batch
        self.off_loop_bytes = off_loop_bytes
        self.failpoints = failpoints or Failpoints()
        self.pipeline_bytes = pipeline_bytes
        self.copy_threads = copy_threads
        self._stores: list[_LocalStore] = []  # reserved slots waiting for their staged bytes
        self._writes: list[_RedisWrite] = []  # queued SETs (the redis worker)
        self._reads: list[_RedisRead] = []  # queued GETs (promotes from Redis into this tier)
        self._queued: set[tuple[str, bytes]] = set()
        self._queued_bytes = 0

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
        if (rt.name, ev.key) in self._queued:  # per-block order holds within a batch too
            await self._drain()
        t0 = time.perf_counter()
        if isinstance(ev, Store):
            fact = await self._store(rt, ev, t0)
        elif isinstance(ev, Evict):
            fact = await self._evict(rt, ev)
        else:
            fact = await self._transfer(rt, ev, t0)
        self._report(rt, fact, t0)
        if self._queued_bytes >= self.pipeline_bytes:
            await self._drain()
        self.applied.handled(d.envelope)
        self._fences.append((rt.name, ev.key, stamp))

    def _report(self, rt: PoolRuntime, fact: Fact | None, t0: float) -> None:
        if isinstance(fact, Stored):
            rt.counters.tiers[self.tier.label].timed(time.perf_counter() - t0)
        if fact is not None:
            self._facts.append(fact)

    async def flush(self) -> None:
        """After each batch, before its acks: finish queued Redis I/O, then report every
        outcome in one pipeline."""
        try:
            await self._drain()
        except BaseException:
            self.applied.discard()
            self._fences.clear()
            self._facts.clear()
            raise
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

    async def _store(self, rt: PoolRuntime, ev: Store, t0: float) -> Fact | None:
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
        if self.tier == Tier.REDIS:  # no local room: written through to Redis, read straight into the value
            value, buf = rt.redis.new_value()
        elif dst.device_payload is None:
            return await self._queue_store(rt, dst, ev, staging, t0)
        else:
            value, buf = None, self._buf(bb)
        try:
            csum = await self._off_loop(bb, staging.read_into, ev.slot, ev.key, ev.gen, buf)
        except OSError as e:
            return self._failed(rt, ev, "bad_staging", str(e), dropped=True)
        self.staging.release(ev.segment, bb, ev.slot, ev.gen)  # copied (or bad): the client may reuse it
        if csum is None:
            return self._failed(rt, ev, "verify", "staging slot changed or failed its checksum", dropped=True)
        if value is not None:
            self._queue_write(_RedisWrite(rt, ev, rt.redis.seal(value, ev.key, csum), t0))
            return None
        entry = await self._write_local(rt, dst, ev.key, ev.parent, buf, csum)
        if entry is None:
            return self._failed(rt, ev, "no_room", "no free slot and nothing clean to evict", dropped=True)
        return self._stored(rt, ev, entry.slot)

    async def _queue_store(self, rt: PoolRuntime, dst: LocalTier, ev: Store, staging, t0: float) -> Fact | None:
        """Reserve the slot now; the bytes are read from staging straight into it at the next
        drain, together with the batch's other stores, in one thread hop (`_drain_stores`)."""
        e = await self._reserve(rt, dst, ev.key, ev.parent)
        if e is None:
            self.staging.release(ev.segment, rt.layout.block_bytes, ev.slot, ev.gen)
            return self._failed(rt, ev, "no_room", "no free slot and nothing clean to evict", dropped=True)
        self._stores.append(_LocalStore(rt, ev, dst, e, staging, t0))
        self._queued.add((rt.name, ev.key))
        self._queued_bytes += rt.layout.block_bytes
        return None

    async def _drain_stores(self, stores: list["_LocalStore"]) -> None:
        self._maybe_tear(stores[0].dst, stores[0].entry)
        try:
            nbytes = sum(s.rt.layout.block_bytes for s in stores)
            if nbytes < self.off_loop_bytes:
                results = _fill_from_staging(stores)
            else:  # each thread writes only its own share of the reserved slots
                results = await map_shares(None, _fill_from_staging, stores, self.copy_threads)
        except BaseException:
            # Cancelled (the copy itself has finished): unreserve, and leave the staging slots
            # to the redelivery of these commands, or to their client's reclaim.
            for s in stores:
                s.dst.abort(s.entry)
            raise
        self.failpoints.reached("shm_written")
        for s, got in zip(stores, results):
            self.staging.release(s.ev.segment, s.rt.layout.block_bytes, s.ev.slot, s.ev.gen)
            if got is None or isinstance(got, OSError):
                s.dst.abort(s.entry)
                why, detail = (("verify", "staging slot changed or failed its checksum") if got is None
                               else ("bad_staging", str(got)))
                fact = self._failed(s.rt, s.ev, why, detail, dropped=True)
            else:
                s.dst.finish(s.entry)
                fact = self._stored(s.rt, s.ev, s.entry.slot)
            self._report(s.rt, fact, s.t0)

    def _stored(self, rt: PoolRuntime, ev: Store | Promote | Demote | Copy, slot: int) -> Stored:
        """Count a completed store or transfer into this tier and make its fact."""
        c = rt.counters.tiers[self.tier.label]
        if isinstance(ev, Store):
            c.stored += 1
        elif isinstance(ev, Promote):
            c.promoted_in += 1
        elif isinstance(ev, Demote):
            c.demoted_in += 1
        else:
            c.copied_in += 1
        c.bytes_in += rt.layout.block_bytes
        if not isinstance(ev, Store):
            self.log.debug("tier.transfer", pool=rt.name, op=ev.TYPE, src=ev.src.label, key=ev.key.hex()[:16])
        return Stored(rt.name, ev.key, ev.parent, self.tier, slot, ev.TYPE)

    # --- Redis I/O, pipelined per batch --------------------------------------------------------

    def _queue_write(self, w: "_RedisWrite") -> None:
        self._writes.append(w)
        self._queued.add((w.rt.name, w.ev.key))
        self._queued_bytes += len(w.value)

    def _queue_read(self, r: "_RedisRead") -> None:
        self._reads.append(r)
        self._queued.add((r.rt.name, r.ev.key))
        self._queued_bytes += r.rt.layout.block_bytes

    async def _drain(self) -> None:
        """Run the queued stores (one thread hop), then the queued Redis writes and reads (one
        pipeline per pool), and report their outcomes."""
        stores, self._stores = self._stores, []
        writes, self._writes = self._writes, []
        reads, self._reads = self._reads, []
        self._queued.clear()
        self._queued_bytes = 0
        if stores:
            await self._drain_stores(stores)
        for rt, group in _by_pool(writes):
            put = asyncio.ensure_future(rt.redis.put_many([(w.ev.key, w.value) for w in group]))
            if self.failpoints.armed("redis_write"):
                await asyncio.sleep(0)  # let the pipeline start sending, then die mid-write
                self.failpoints.reached("redis_write")
            errors = await put
            for w, err in zip(group, errors):
                self._report(rt, self._wrote(rt, w.ev, err), w.t0)
        for rt, group in _by_pool(reads):
            try:
                got = await rt.redis.get_many([r.ev.key for r in group])
            except redis.exceptions.RedisError as e:
                got = [e] * len(group)
            for r, one in zip(group, got):
                self._report(rt, await self._promoted(rt, r.ev, one), r.t0)

    def _wrote(self, rt: PoolRuntime, ev: Store | Demote | Copy, err: Exception | None) -> Fact:
        if err is not None:
            rt.redis.stats.errors += 1
            if isinstance(ev, Store):
                rt.counters.puts_dropped += 1
            return self._failed(rt, ev, "redis", f"{type(err).__name__}: {err}")
        if any(rt.placement.tiers[t].get(ev.key) is not None for t in (Tier.GPU, Tier.CPU)):
            # Remember it only while a local copy exists: that is what eviction consults.
            rt.placement.tiers[Tier.REDIS].add(ev.key, ev.parent)
            rt.directory.set_flag(ev.key, IN_REDIS, True)
        return self._stored(rt, ev, -1)

    async def _promoted(self, rt: PoolRuntime, ev: Promote | Demote | Copy, got) -> Fact:
        """A block read from Redis: store it here, or report the miss."""
        if isinstance(got, Exception):
            rt.redis.stats.errors += 1
            self.log.warning("tier.redis_read_failed", pool=rt.name, error=f"{type(got).__name__}: {got}")
            got = None
        if got is None:  # expired, evicted or corrupt there: stop believing in it
            self._forget_redis(rt, ev.key)
            return self._failed(rt, ev, "source_miss", "redis no longer holds a valid copy")
        fact = await self._store_local(rt, ev, got[0], got[1])
        if isinstance(fact, Stored):
            # It came from Redis, so Redis holds it: this tier may drop it again without
            # writing it back (an evict, not a demote), and make room with it when full.
            rt.placement.tiers[Tier.REDIS].add(ev.key, ev.parent)
            rt.directory.set_flag(ev.key, IN_REDIS, True)
        return fact

    # --- promote / demote: another tier -> this tier -------------------------------------------

    async def _transfer(self, rt: PoolRuntime, ev: Promote | Demote | Copy, t0: float) -> Fact | None:
        dst = rt.local(self.tier)
        if self.tier != Tier.REDIS:
            if dst is None:
                raise MalformedEvent(f"pool {rt.name} has no {self.tier.label} tier")
            if (have := dst.index.get(ev.key)) is not None:
                return Stored(rt.name, ev.key, ev.parent, self.tier, have.slot, ev.TYPE)
        if ev.src == Tier.REDIS:
            if self.tier == Tier.REDIS:
                raise MalformedEvent(f"{ev.TYPE} from redis to redis")
            self._queue_read(_RedisRead(rt, ev, t0))
            return None
        src = rt.local(ev.src)
        slot = None if src is None else src.slot_of(ev.key)
        if self.tier == Tier.REDIS:  # read the source straight into the value to send
            value, buf = rt.redis.new_value()
        else:
            value, buf = None, self._buf(rt.layout.block_bytes)
        csum = None if slot is None else await self._off_loop(buf.nbytes, src.read_slot, slot, ev.key, buf)
        if csum is None:
            return self._failed(rt, ev, "source_miss", f"{ev.src.label} no longer holds a valid copy")
        if value is not None:
            self._queue_write(_RedisWrite(rt, ev, rt.redis.seal(value, ev.key, csum), t0))
            return None
        return await self._store_local(rt, ev, buf, csum)

    async def _store_local(self, rt: PoolRuntime, ev: Promote | Demote | Copy, payload: np.ndarray,
                           csum: int) -> Fact:
        dst = rt.local(self.tier)
        entry = await self._write_local(rt, dst, ev.key, ev.parent, payload, csum)
        if entry is None:
            return self._failed(rt, ev, "no_room", "no free slot and nothing clean to evict")
        return self._stored(rt, ev, entry.slot)

    async def _write_local(self, rt: PoolRuntime, dst: LocalTier, key: bytes, parent: bytes | None,
                           data: np.ndarray, csum: int):
        if (have := dst.index.get(key)) is not None:
            return have
        e = await self._reserve(rt, dst, key, parent)
        if e is None:
            return None
        self._maybe_tear(dst, e)
        try:
            await self._off_loop(data.nbytes, dst.fill, e, data, csum)
        except BaseException:
            dst.abort(e)
            raise
        self.failpoints.reached("shm_written")
        return dst.finish(e)

    async def _reserve(self, rt: PoolRuntime, dst: LocalTier, key: bytes, parent: bytes | None) -> Entry | None:
        """A PENDING slot for `key`, making room once if the tier is full; None when there is none."""
        e = dst.begin(key, parent)
        if e is None and await self._make_room(rt, dst):
            e = dst.begin(key, parent)
        return e

    def _maybe_tear(self, dst: LocalTier, e: Entry) -> None:
        """The `shm_torn` failpoint: die halfway through a cpu-arena write, the slot left odd."""
        if self.tier == Tier.CPU and dst.device_payload is None and self.failpoints.due("shm_torn"):
            dst.table.begin_write(e.slot)
            dst.table.payload(e.slot)[: dst.block_bytes // 2] = 0xA5
            self.failpoints.die()

    async def _off_loop(self, nbytes: int, fn, *args):
        """Run a block copy in a thread when it is big enough to stall the loop (waited for even
        if we are cancelled: it writes into a slot we are about to free)."""
        if nbytes < self.off_loop_bytes:
            return fn(*args)
        return await run_off_loop(None, fn, *args)

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
        forget_redis_copy(rt.placement, key)
        rt.directory.set_flag(key, IN_REDIS, False)

    def _drop(self, rt: PoolRuntime, local: LocalTier, key: bytes) -> None:
        local.drop(key)
        after_local_drop(rt.placement, key)

    # --- evict ------------------------------------------------------------------------------------

    async def _evict(self, rt: PoolRuntime, ev: Evict) -> Fact | None:
        c = rt.counters.tiers[self.tier.label]
        if self.tier == Tier.REDIS:
            try:
                await rt.redis.delete(ev.key)
            except redis.exceptions.RedisError:
                rt.redis.stats.errors += 1
                raise  # leave the command pending: it is retried, then dead-lettered
            rt.placement.tiers[Tier.REDIS].remove(ev.key)
            rt.directory.set_flag(ev.key, IN_REDIS, False)
            c.evicted += 1
            return Removed(rt.name, ev.key, self.tier, f"evict:{ev.reason}")
        local = rt.local(self.tier)
        if local is None:
            return None
        verdict = evict_verdict(rt.placement, self.tier, ev.key, ev.reason)
        if verdict is Verdict.ASK_REDIS:
            verdict = after_redis_check(await self._redis_has(rt, ev.key), ev.reason)
        if verdict in (Verdict.GONE, Verdict.STALE):
            c.stale += verdict is Verdict.STALE
            return None
        if verdict in REFUSED:
            # BUSY: a child arrived or a reader pins it since the choice. ONLY_COPY: refuse rather
            # than lose it; the policy may choose it again later, and will then demote it first.
            rt.placement.refused(self.tier, ev.key)
            c.refused += 1
            if verdict is Verdict.ONLY_COPY:
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


@dataclass(slots=True)
class _LocalStore:
    rt: PoolRuntime
    ev: Store
    dst: LocalTier
    entry: Entry  # the reserved (PENDING) slot
    staging: StagingFile
    t0: float


def _fill_from_staging(stores: list[_LocalStore]) -> list[int | None | OSError]:
    """Each staged block read straight into its reserved slot and verified there (off the loop:
    it touches only those slots and the staging files)."""
    out: list[int | None | OSError] = []
    for s in stores:
        try:
            out.append(s.dst.fill_from(s.entry, partial(s.staging.read_into, s.ev.slot, s.ev.key, s.ev.gen)))
        except OSError as e:
            out.append(e)
    return out


@dataclass(slots=True)
class _RedisWrite:
    rt: PoolRuntime
    ev: Store | Demote | Copy
    value: memoryview  # header + payload, ready to SET
    t0: float  # when the command was received


@dataclass(slots=True)
class _RedisRead:
    rt: PoolRuntime
    ev: Promote | Demote | Copy
    t0: float


def _by_pool(items: list) -> list[tuple[PoolRuntime, list]]:
    """Group queued operations by pool, keeping their order within each pool."""
    groups: dict[str, tuple[PoolRuntime, list]] = {}
    for item in items:
        groups.setdefault(item.rt.name, (item.rt, []))[1].append(item)
    return list(groups.values())
