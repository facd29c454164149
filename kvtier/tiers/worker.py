"""One tier worker: consumes its tier's command stream and carries out store, promote, demote, evict.

Uniform over tiers: the destination of a transfer pulls a verified copy from the source, stores
it, and reports a `stored` fact; the source keeps its copy until the coordinator, seeing that
fact, tells it to evict (write-back). Every command yields at most one fact, and every handler is
idempotent, because delivery is at least once. A failed transfer is a `removed` fact with the
command's cause and a `Failure`, a counter and a log line, never a half-visible block.

The worker does the I/O: copies, Redis pipelines (kvtier/tiers/redis_batch.py), publishing facts.
What each command's outcome is (its fact, its counter, what it means for Redis's copy) is decided
by the pure rules in kvtier/core/outcomes.py, what may leave a tier by those in kvtier/core/eviction.py,
and the tier indices change only through the pool's Placement, which owns them.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
from structlog.typing import FilteringBoundLogger

from kvtier.bus.consumer import Delivery
from kvtier.bus.dedup import AppliedEntries
from kvtier.core.events import (
    Command,
    Copy,
    Demote,
    Event,
    Evict,
    Failure,
    Promote,
    Reason,
    Retain,
    Store,
    StoreBatch,
    Tier,
)
from kvtier.core.fact_batches import batched
from kvtier.core.fence import CommandFence
from kvtier.core.outcomes import evicted, failed, held, read, sent, written
from kvtier.disk.blockfile import aligned_empty
from kvtier.errors import DiskFault, MalformedEvent, SegmentError
from kvtier.failpoints import Failpoints
from kvtier.keys import BlockKey
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_moves import DiskMoves
from kvtier.tiers.evicting import Evictions
from kvtier.tiers.facts import Fact, Facts, Received
from kvtier.tiers.grants import GrantBook
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime, SlotTier
from kvtier.tiers.redis_batch import Got, QueuedGet, QueuedSet, RedisBatch, retain
from kvtier.tiers.staged import CHANGED, NO_ROOM, StagedStores
from kvtier.tiers.writes import LocalWrites

Transfer = Promote | Demote | Copy


class FactPublisher(Protocol):
    async def publish_many(self, items: Sequence[tuple[str, Event]]) -> None: ...


class TierWorker:
    def __init__(self, tier: Tier, pools: dict[str, PoolRuntime], staging: StagingSegments,
                 publisher: FactPublisher, facts_stream: str, log: FilteringBoundLogger, *,
                 off_loop_bytes: int = 256 << 10, flush_bytes: int = 32 << 20, copy_threads: int = 1,
                 failpoints: Failpoints | None = None, grants: GrantBook | None = None) -> None:
        self.tier = tier
        self.grants = grants if tier == Tier.CPU else None  # cpu slots granted to clients ahead of puts
        self.pools = pools
        self.staging = staging
        self.publisher = publisher
        self.facts_stream = facts_stream
        self.log = log.bind(tier=tier.label)
        self._scratch: dict[int, np.ndarray] = {}
        self.facts = Facts(tier, self.log)
        # Room for every block the node can hold, several times over: a stamp is only needed
        # while an old entry for that block could still be redelivered.
        local = sum(rt.local_blocks for rt in pools.values())
        self.fence = CommandFence(max(4096, 4 * local))
        self.applied = AppliedEntries()
        self._fences: list[tuple[str, BlockKey, tuple[int, int]]] = []  # applied in this batch
        self.off_loop_bytes = off_loop_bytes
        self.failpoints = failpoints or Failpoints()
        self.flush_bytes = flush_bytes  # queued Redis and staging bytes that send the batch so far
        self.copy_threads = copy_threads
        self.evictions = Evictions(tier, self.facts, self.log)
        self.writes = LocalWrites(tier, self.evictions, self.facts, self.failpoints, off_loop_bytes)
        # Queued for the end of the batch: stores from staging into reserved shared-memory slots;
        # Redis SETs (the redis worker) and GETs (promotes from Redis).
        self._staged = StagedStores(staging, self.writes, self.facts, self.failpoints, copy_threads)
        self._redis = RedisBatch(self.failpoints)
        self._moves = DiskMoves(self.writes, self.facts, copy_threads)  # write-backs into the disk tier

    def _buf(self, nbytes: int) -> np.ndarray:
        buf = self._scratch.get(nbytes)
        if buf is None:  # page-aligned: the disk tier's O_DIRECT I/O then goes straight to and from it
            buf = self._scratch[nbytes] = aligned_empty(nbytes)
        return buf

    async def handle(self, d: Delivery) -> None:
        ev = d.envelope.event
        rt = self.pools.get(ev.pool)
        if rt is None:
            raise MalformedEvent(f"unknown pool {ev.pool!r}")
        if isinstance(ev, Retain) and self.tier == Tier.REDIS:
            await self._drain()  # this batch's queued SETs first: a SET sets the pool's TTL afresh
            await retain(rt, ev, self.log)
            return
        if not isinstance(ev, (Store, StoreBatch, Promote, Demote, Copy, Evict)) or _target(ev) != self.tier:
            raise MalformedEvent(f"{ev.TYPE} event is not a command for the {self.tier.label} worker")
        if self.applied.duplicate(d.envelope):  # carried out already, its facts published
            rt.counters.tiers[self.tier.label].stale += len(ev.blocks) if isinstance(ev, StoreBatch) else 1
            return
        stamp = (d.envelope.epoch, d.envelope.seq)
        cmds: list[Command] = [*await self._adopt_granted(rt, ev, stamp)] if isinstance(ev, StoreBatch) else [ev]
        bad: MalformedEvent | None = None
        for cmd in cmds:  # a batch's blocks one by one, each fenced on its own (one stamp for all)
            try:
                await self._command(rt, cmd, stamp)
            except MalformedEvent as e:  # this block only: the rest still stored (or their slots freed)
                bad = bad or e
        if bad is not None:
            raise bad  # the entry goes to the dead-letter stream, with the first reason
        self.applied.handled(d.envelope)

    def _fenced(self, rt: PoolRuntime, ev: Command, stamp: tuple[int, int]) -> bool:
        """Whether `ev` is older than a command applied to its block (a late redelivery, reported
        before or overtaken: applying it would undo a newer decision). Its slot is freed."""
        if not self.fence.stale(rt.name, ev.key, stamp):
            return False
        rt.counters.tiers[self.tier.label].stale += 1
        if isinstance(ev, Store) and ev.granted and self.grants is not None:
            self.grants.give_back(rt, ev.segment, ev.slot)
        elif isinstance(ev, Store) and not ev.granted:
            self.staging.release(ev.segment, rt.layout.block_bytes, ev.slot, ev.gen)
        self.log.info("tier.command_fenced", pool=rt.name, op=ev.TYPE, key=ev.key.hex()[:16],
                      epoch=stamp[0], seq=stamp[1])
        return True

    def queued(self, pool: str, keys: Iterable[BlockKey]) -> bool:  # this batch's work (store, Redis I/O, move) for any
        qs = [q for q in (self._staged, self._redis, self._moves) if len(q)]  # mostly none
        return bool(qs) and any((pool, k) in q for k in keys for q in qs)

    async def _adopt_granted(self, rt: PoolRuntime, batch: StoreBatch, stamp: tuple[int, int]) -> list[Store]:
        """A batch's blocks put into granted cpu slots, adopted together (GrantBook.adopt_blocks),
        each fenced on its own, those adopted reported as one stored_batch (no command or outcome
        a block); then the client's ring refilled (per put: once a batch runs dry while the
        client is puts ahead). The batch's other stores (all, where no grants), for `_command`."""
        if self.grants is None or rt.cpu.device_payload is not None:
            return batch.stores()
        todo = [b for b in batch.blocks if b.granted and not (
            self.fence.stale(rt.name, b.key, stamp) and self._fenced(rt, batch.store(b), stamp))]
        if todo:
            t0 = time.perf_counter()
            if self.queued(rt.name, (b.key for b in todo)):
                await self._drain()  # per-block order holds within a batch too
            self.facts.report_adopted(rt, batch, todo, self.grants.adopt_blocks(rt, batch, todo), t0)
            self._fences.extend((rt.name, b.key, stamp) for b in todo)
            await self.grants.top_up(self.evictions.room_for_grant)
        return [batch.store(b) for b in batch.blocks if not b.granted]

    async def _command(self, rt: PoolRuntime, ev: Command, stamp: tuple[int, int]) -> None:
        if self._fenced(rt, ev, stamp):
            return
        if self.queued(rt.name, (ev.key,)):
            await self._drain()  # per-block order holds within a batch too
        t0 = time.perf_counter()
        fact: Fact | None
        if isinstance(ev, Store):
            fact = await self._store(rt, ev, t0)
        elif isinstance(ev, Evict):
            fact = await self.evictions.evict(rt, ev)
        else:
            fact = await self._transfer(rt, ev, t0)
        self.facts.report(rt, fact, t0)
        self._retire_failed_disk(rt)  # an I/O error met by this command, or by another worker
        if self._staged.nbytes + self._redis.nbytes + self._moves.nbytes >= self.flush_bytes:
            await self._drain()
        self._fences.append((rt.name, ev.key, stamp))

    async def flush(self) -> None:
        """After each batch, before its acks: finish queued Redis I/O, then report every outcome in one pipeline."""
        try:
            await self._drain()
            if self.grants is not None:
                await self.grants.top_up(self.evictions.room_for_grant)
        except BaseException:
            self.applied.discard()
            self._fences.clear()
            self.facts.take()
            raise
        for rt in self.pools.values():  # an I/O error met by the batch's queued moves
            self._retire_failed_disk(rt)
        facts = self.facts.take()
        fences, self._fences = self._fences, []
        try:
            if facts:  # each run of stored blocks as one stored_batch
                await self.publisher.publish_many([(self.facts_stream, f) for f in batched(facts)])
        except BaseException:
            self.applied.discard()  # the batch comes back and must run again to report
            raise
        self.applied.commit()
        for pool, key, stamp in fences:
            self.fence.record(pool, key, stamp)

    async def _drain(self) -> None:
        """Fill the queued stores' slots (one thread hop), move the queued write-backs into the
        disk tier (side by side), then run the queued Redis writes and reads (one pipeline per
        pool), and report their outcomes."""
        stores, moves = self._staged.take(), self._moves.take()
        sets, gets = self._redis.take()
        await self._staged.drain(stores)
        await self._moves.drain(moves)
        wrote, got = await self._redis.send(sets, gets)
        for w, err in wrote:
            self.facts.report(w.rt, self.facts.settle(w.rt, sent(w.ev, err), w.ev, _error(err)), w.t0)
        for r, value in got:
            self.facts.report(r.rt, await self._promoted(r.rt, r.ev, value, r.t0), r.t0)

    def _retire_failed_disk(self, rt: PoolRuntime) -> None:
        """The pool's disk tier met an I/O error (in this worker or another): turn it off, with
        one log line; its blocks are reported removed, and the other tiers keep serving."""
        disk = rt.disk
        if disk is None or disk.retired or (fault := disk.fault) is None:
            return
        gone = rt.retire_disk()
        for e in gone:
            fact = evicted(rt.name, e.key, Tier.DISK, Reason.FAULT).fact
            assert fact is not None
            self.facts.add(fact)
        rt.counters.tiers[Tier.DISK.label].evicted += len(gone)
        self.log.error("disk.tier_off", pool=rt.name, path=str(disk.file.path), op=fault.op,
                       errno=errno.errorcode.get(fault.errno or 0, str(fault.errno)), error=str(fault),
                       blocks=len(gone),
                       note="the pool serves from its other tiers; a restart of the daemon tries the disk again")

    # --- store: client staging -> this tier ---------------------------------------------------

    async def _store(self, rt: PoolRuntime, ev: Store, t0: float) -> Fact | None:
        dst = rt.local(self.tier)
        if dst is None and self.tier != Tier.REDIS:
            raise MalformedEvent(f"pool {rt.name} has no {self.tier.label} tier")
        bb = rt.layout.block_bytes
        try:
            staging = self.staging.get(ev.segment, bb)
            if not 0 <= ev.slot < (dst.capacity if ev.granted and dst is not None else staging.n):
                raise SegmentError(f"slot {ev.slot} outside {'the arena' if ev.granted else 'staging'}")
        except SegmentError as e:
            return self.facts.settle(rt, failed(ev, self.tier, Failure.BAD_STAGING), ev, str(e))
        if ev.granted:  # written by the client into a cpu slot granted to it
            if self.grants is None or dst is not rt.cpu or rt.cpu.device_payload is not None:
                raise MalformedEvent("a granted store goes to the cpu worker of a host-memory arena")
            outcome, detail = self.grants.adopt(rt, ev)
            return self.facts.settle(rt, outcome, ev, detail)
        if self.grants is not None and dst is rt.cpu:
            self.grants.want(rt.name, ev.segment)  # its next puts may write their cpu slots themselves
        if (here := held(rt.placement, ev, self.tier)) is not None:  # a duplicate, or another client put it first
            self.staging.release(ev.segment, bb, ev.slot, ev.gen)
            return self.facts.settle(rt, here, ev)
        if isinstance(dst, DiskTier):
            raise MalformedEvent("a store into the disk tier: puts land in the memory tiers")
        if dst is not None and dst.device_payload is None:
            return await self._staged.queue(rt, dst, ev, staging, t0)
        # The redis worker (a put with no local room, written through) reads straight into the
        # value to send; the gpu worker on a real GPU into a buffer.
        value, buf = rt.redis.new_value() if dst is None else (None, self._buf(bb))
        try:
            csum = await self.writes.off_loop(bb, staging.read_into, ev.slot, ev.key, ev.gen, buf)
        except OSError as e:
            return self.facts.settle(rt, failed(ev, self.tier, Failure.BAD_STAGING), ev, str(e))
        self.staging.release(ev.segment, bb, ev.slot, ev.gen)  # copied (or bad): the client may reuse it
        if (bad := read(ev, self.tier, csum)) is not None:
            return self.facts.settle(rt, bad, ev, CHANGED)
        assert csum is not None
        return await self._put(rt, ev, dst, value, buf, csum, t0)

    # --- promote / demote / copy: another tier -> this tier -------------------------------------

    async def _transfer(self, rt: PoolRuntime, ev: Transfer, t0: float) -> Fact | None:
        dst = rt.local(self.tier)
        if dst is None and self.tier != Tier.REDIS:
            raise MalformedEvent(f"pool {rt.name} has no {self.tier.label} tier")
        if (here := held(rt.placement, ev, self.tier)) is not None:
            return self.facts.settle(rt, here, ev)
        if isinstance(dst, DiskTier) and dst.fault is not None:
            return self.facts.settle(rt, failed(ev, self.tier, Failure.DISK), ev, "the disk tier is off")
        if ev.src == Tier.REDIS:
            if self.tier == Tier.REDIS:
                raise MalformedEvent(f"{ev.TYPE} from redis to redis")
            self._redis.get(QueuedGet(rt, ev, t0))
            return None
        src = rt.local(ev.src)
        slot = None if src is None else src.slot_of(ev.key)
        if isinstance(dst, DiskTier) and isinstance(src, LocalTier) and slot is not None:
            return await self._moves.queue(rt, ev, src, slot, dst, t0)  # moved with the batch's others
        # Into Redis: read the source straight into the value to send.
        value, buf = rt.redis.new_value() if dst is None else (None, self._buf(rt.layout.block_bytes))
        csum = None
        if src is not None and slot is not None:
            csum = await self.writes.off_loop(buf.nbytes, src.read_slot, slot, ev.key, buf)
        if (bad := read(ev, self.tier, csum)) is not None:
            return self.facts.settle(rt, bad, ev, f"{ev.src.label} no longer holds a valid copy")
        assert csum is not None
        return await self._put(rt, ev, dst, value, buf, csum, t0)

    async def _promoted(self, rt: PoolRuntime, ev: Transfer, got: Got, t0: float) -> Fact | None:
        """A block read from Redis: store it here (then Redis is known to hold it, so this tier
        may drop it again without writing it back), or report the miss."""
        if (bad := read(ev, self.tier, got)) is not None:  # unreachable, or expired, evicted or corrupt there
            return self.facts.settle(rt, bad, ev, _error(got) or "redis no longer holds a valid copy")
        assert got is not None and not isinstance(got, Exception)
        return await self._put(rt, ev, rt.local(self.tier), None, got[0], got[1], t0)

    # --- into this tier -------------------------------------------------------------------------

    async def _put(self, rt: PoolRuntime, ev: Received, dst: SlotTier | None, value: memoryview | None,
                   buf: np.ndarray, csum: int, t0: float) -> Fact | None:
        """The verified block in `buf` into this tier: a SET queued for the batch's pipeline
        (`value` wraps `buf`), or a local write now."""
        if value is not None:
            self._redis.set(QueuedSet(rt, ev, rt.redis.seal(value, ev.key, csum), t0))
            return None
        assert dst is not None  # a local tier's worker, checked on receipt
        try:
            entry = await self.writes.write(rt, dst, ev.key, ev.parent, buf, csum)
        except DiskFault as e:  # the disk tier is off from now on (retired after this command)
            return self.facts.settle(rt, failed(ev, self.tier, Failure.DISK), ev, f"{e.op}: {e}")
        return self.facts.settle(rt, written(ev, self.tier, entry), ev, NO_ROOM)


def _error(err: object) -> str:
    """An I/O error as a log line's detail ("" for none)."""
    return f"{type(err).__name__}: {err}" if isinstance(err, Exception) else ""


def _target(ev: Received | StoreBatch | Evict) -> Tier:
    """The tier whose worker carries the command out."""
    return ev.tier if isinstance(ev, (Store, StoreBatch, Evict)) else ev.dst
