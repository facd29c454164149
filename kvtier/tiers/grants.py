"""Cpu arena slots granted to clients ahead of their puts: the daemon's book of them.

A client with a grant writes its block straight into the final arena slot (kvtier/shm/grant_ring.py
has the ring that carries grants to it): one pass over the bytes, where staging costs two, and
the daemon never touches the payload. Its put names the slot; the cpu worker checks the header
(READY, key, gen, length, and the tag that binds the key to the checksum) and flips it to
VALID, a batch's blocks together (`adopt_blocks`). Readers verify the checksum the client
wrote, as they verify every block, so a client that lies or keeps writing costs its own block (a
miss), never another's bytes.

The book is the truth: a slot is adopted only if this daemon granted it to that very segment
and it was not adopted or taken back since. Grants are slots of the pool's index under no key
(kvtier/core/index.py), not free: at most `client_cap` and a sixteenth of the arena per segment,
and a quarter of the arena in all, since a full arena frees clean blocks to grant; an arena of
fewer than GRANT_MIN_SLOTS slots grants none. They come back
when a put of a block already here hands its slot back, when the header does not check out,
when they expire unused (GRANT_EXPIRE_S), and when the client dies or closes its segment
(`forget`, from the reaper): a fill that died half way is emptied then.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.core.events import Failure, StagedBlock, Store, StoreBatch, Tier
from kvtier.core.index import Entry
from kvtier.core.outcomes import Outcome, failed, held, stored
from kvtier.errors import SegmentError
from kvtier.logs import Log
from kvtier.shm.flips import check_ready, flip_valid
from kvtier.shm.grant_ring import GRANT_EXPIRE_S, RING, RingFile
from kvtier.shm.slots import EMPTY_KEY
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.pool import PoolRuntime

GRANT_SHARE = 4  # all grants of a pool hold at most a quarter of its cpu arena ...
CLIENT_SHARE = 16  # ... and one client's at most a sixteenth, so others get theirs
# A smaller arena grants nothing: every slot a grant holds is one a staged put (another client's,
# or this one's beyond its grants) cannot use, which in a toy arena turns fits into failed stores.
GRANT_MIN_SLOTS = 256


@dataclass(slots=True)
class Held:
    """One client's grants. A grant is its slot and its position in the client's ring: positions
    grow with every push and are never handed out again once pushed (a failed push's are, but
    its slots stay booked until `forget`), so (slot, position) names one grant of the slot, not
    one it had before or since."""

    pool: str
    head: int  # the ring's head, as this daemon wrote it
    slots: dict[int, int] = field(default_factory=dict)  # slot -> position: granted, not adopted or taken back yet
    # The sweep's queues, so that it walks what changed since the last one, not every grant held:
    # grants pushed, in ring order, not yet seen taken; and (when first seen taken, slot, position),
    # oldest first. An entry whose grant has gone since (adopted, taken back) is dropped when the
    # sweep meets it, or when its queue outgrows what is held (`compact`).
    in_ring: deque[tuple[int, int]] = field(default_factory=deque)
    taken: deque[tuple[float, int, int]] = field(default_factory=deque)

    def holds(self, slot: int, pos: int) -> bool:
        """Whether this very grant (not one the slot had before or since) is still held."""
        return self.slots.get(slot) == pos

    def compact(self) -> None:
        """Drop the gone grants' entries once a queue holds far more than is held: the tail the
        sweep goes by is the client's word, and a client that never moves it past its adopted
        grants must not grow the queue without bound."""
        bound = 2 * (RING + len(self.slots))
        if len(self.in_ring) > bound:
            self.in_ring = deque(x for x in self.in_ring if self.holds(*x))
        if len(self.taken) > bound:
            self.taken = deque(x for x in self.taken if self.holds(x[1], x[2]))


def _not_whole(store: Store) -> tuple[Outcome, str]:
    return failed(store, Tier.CPU, Failure.VERIFY), "granted slot changed, or not written whole"


class GrantBook:
    def __init__(self, pools: dict[str, PoolRuntime], staging: StagingSegments, per_client: int, log: Log,
                 per_client_bytes: int = 256 << 20) -> None:
        self.pools = pools
        self.staging = staging
        # What each staging segment holds at most, in blocks and in bytes (0: none): the bytes
        # bound big blocks, so that small ones, whose per-block cost is the daemon's, get many.
        self.per_client = per_client
        self.per_client_bytes = per_client_bytes
        self.epoch = secrets.randbits(62) | 1  # puts carry it: one granted by an earlier daemon is refused
        self.log = log.bind(worker="grants")
        self._held: dict[str, Held] = {}
        self._wanted: dict[str, str] = {}  # segment -> pool: to top up at the cpu worker's next flush
        self._topping_up = asyncio.Lock()

    def want(self, pool: str, segment: str) -> None:
        """The segment's client puts into this pool's cpu tier: grant it slots at the next top-up."""
        if self.client_cap(self.pools[pool]) and self.pools[pool].cpu.device_payload is None:
            self._wanted[segment] = pool

    def client_cap(self, rt: PoolRuntime) -> int:
        """Grants one segment holds at most in this pool: `per_client` blocks, and no more
        than `per_client_bytes` of them."""
        return min(self.per_client, self.per_client_bytes // rt.layout.block_bytes)

    def take(self, pool: str, segment: str, slot: int) -> bool:
        """Take `slot` out of the book for a put naming it: False unless this daemon granted it to
        `segment` for `pool` and has not taken it since."""
        h = self._held.get(segment)
        if h is None or h.pool != pool or slot not in h.slots:
            return False
        del h.slots[slot]
        return True

    def release(self, rt: PoolRuntime, slot: int) -> None:
        """A slot taken from the book that holds no block to keep: emptied, then free again."""
        rt.cpu.table.invalidate(slot)
        rt.placement.ungrant(Tier.CPU, slot)
        rt.counters.grants_reclaimed += 1

    def give_back(self, rt: PoolRuntime, segment: str, slot: int) -> bool:
        """A put wrote a block that is here already into its granted slot: the slot is freed,
        and the client gets a grant in its place at the next top-up."""
        if not self.take(rt.name, segment, slot):
            return False
        self.release(rt, slot)
        self.want(rt.name, segment)
        return True

    def adopt(self, rt: PoolRuntime, ev: Store) -> tuple[Outcome, str]:
        """A put the client wrote into granted slot `ev.slot`: checked in its header and made
        visible, the payload untouched. The outcome, and what the failure met ("" if none)."""
        return self.adopt_many(rt, [ev])[0]

    def adopt_many(self, rt: PoolRuntime, evs: list[Store]) -> list[tuple[Outcome, str]]:
        """`adopt` for a batch's granted stores, in batch order (`adopt_blocks` per segment, with
        an outcome made for each block adopted)."""
        got: list[tuple[Outcome, str] | None] = [None] * len(evs)
        for segment in dict.fromkeys(ev.segment for ev in evs):
            at = [i for i, ev in enumerate(evs) if ev.segment == segment]
            batch = StoreBatch(rt.name, Tier.CPU, segment,
                               tuple(StagedBlock(evs[i].key, evs[i].parent, evs[i].slot, evs[i].gen, True) for i in at))
            for i, r in zip(at, self.adopt_blocks(rt, batch, batch.blocks)):
                got[i] = r
        return [(stored(ev, Tier.CPU, ev.slot), "") if r is None else r for ev, r in zip(evs, got)]

    def adopt_blocks(self, rt: PoolRuntime, batch: StoreBatch,
                     blocks: Sequence[StagedBlock]) -> list[tuple[Outcome, str] | None]:
        """`blocks` of `batch`, put into slots granted to its segment, in batch order: the headers
        are gathered and checked in one pass, and the READY -> VALID flips made in one pass, rather
        than three header reads and writes per block. A header's tag must bind its key and
        checksum, as every reader demands: a header mixed from two writers is refused here, not
        made VALID. Per block None where it was adopted (stored: the common case, for which the
        caller makes one fact for the batch rather than an outcome a block), else its outcome
        and what a failure met."""
        segment = batch.segment
        table = rt.cpu.table
        slots = np.fromiter((b.slot for b in blocks), dtype=np.int64, count=len(blocks))  # out of range: a miss
        # A gen no write leaves (negative, or past 63 bits) reads as odd: not written whole.
        gens = np.fromiter((b.gen if 0 <= b.gen < 1 << 63 else 1 for b in blocks), dtype=np.uint64,
                           count=len(blocks))
        headers = table.headers(0, table.n)
        # Copies of the headers as the client left them, checked: whole, and each naming its block.
        snap, ok = check_ready(headers, slots, gens, b"".join(b.key for b in blocks), rt.layout.block_bytes)
        out: list[tuple[Outcome, str] | None] = []
        claims: list[int] = []  # batch positions whose header checks out, claimed below together
        index, placement = rt.cpu.index, rt.placement
        h = self._held.get(segment)  # `take`, once for the batch: its grants, if of this pool
        book: dict[int, int] = h.slots if h is not None and h.pool == rt.name else {}
        used = False  # a grant of the segment was used: it is topped up at the next flush
        for j, b in enumerate(blocks):
            if not 0 <= b.slot < table.n:
                out.append((failed(batch.store(b), Tier.CPU, Failure.BAD_STAGING),
                            f"slot {b.slot} outside the arena"))
                continue
            e = index.get(b.key)
            if e is not None and e.slot == b.slot and (here := held(placement, batch.store(b), Tier.CPU)):
                out.append((here, ""))  # adopted already: a redelivery
                continue
            if book.pop(b.slot, None) is None:
                out.append((failed(batch.store(b), Tier.CPU, Failure.BAD_STAGING),
                            f"slot {b.slot} not granted to {segment}"))
                continue
            used = True
            if e is not None and (here := held(placement, batch.store(b), Tier.CPU)) is not None:
                self.release(rt, b.slot)  # another put stored it first
                out.append((here, ""))
                continue
            if not ok[j]:
                self.release(rt, b.slot)
                out.append(_not_whole(batch.store(b)))
                continue
            claims.append(j)
            out.append(None)
        if used:
            self.want(rt.name, segment)
        if not claims:
            return out
        # Claimed together (the owners counted once), as PENDING entries: made VALID below.
        entries = placement.claim_many(Tier.CPU, [(blocks[j].slot, blocks[j].key, blocks[j].parent) for j in claims])
        flips: list[tuple[int, Entry]] = []  # (batch position, claimed entry)
        for j, entry in zip(claims, entries):
            if entry is None:  # the key has an entry after all (a store of it on its way in)
                self.release(rt, blocks[j].slot)
                out[j] = _not_whole(batch.store(blocks[j]))
            else:
                flips.append((j, entry))
        if flips:
            at = [j for j, _ in flips]
            checked = snap[at]
            # The parent the put names, as the index has it (a warm restart reads it back from here).
            checked["parent"] = np.frombuffer(b"".join(blocks[j].parent or EMPTY_KEY for j in at), dtype="V32")
            try:
                flip_valid(headers, slots[at], checked)
            except BaseException:  # claimed, never visible: emptied and freed, as a failed fill is
                for _, entry in flips:
                    rt.abort(rt.cpu, entry)
                raise
            rt.finish_many(rt.cpu, [entry for _, entry in flips])
            rt.counters.granted_puts += len(flips)
        return out

    async def top_up(self, make_room: Callable[[PoolRuntime], Awaitable[bool]]) -> int:
        """Grant the wanted segments free cpu slots up to `client_cap` each, freeing clean blocks
        with `make_room(rt)` where none is free. How many were granted. One top-up at a time (the
        coordinator's and the cpu worker's): each reads a ring's room before it waits in
        `make_room` and pushes after, so two at once could overrun the ring."""
        async with self._topping_up:
            return await self._top_up(make_room)

    async def _top_up(self, make_room: Callable[[PoolRuntime], Awaitable[bool]]) -> int:
        wanted, self._wanted = self._wanted, {}
        total = 0
        for segment, pool in wanted.items():
            rt = self.pools[pool]
            try:
                ring = RingFile(self.staging.get(segment, rt.layout.block_bytes).fd)
                h = self._held.get(segment)
                if h is None:
                    head = ring.begin(self.epoch)
                    if head is None:
                        continue
                    h = self._held[segment] = Held(pool, head)
                if h.pool != pool:
                    continue
                idx = rt.placement.tiers[Tier.CPU]
                slots_all = idx.slots or 0
                if slots_all < GRANT_MIN_SLOTS:
                    continue
                mine = min(self.client_cap(rt), slots_all // CLIENT_SHARE) - len(h.slots)
                n = min(mine, ring.room(h.head), slots_all // GRANT_SHARE - idx.granted)
                slots = rt.placement.grant(Tier.CPU, n) if n > 0 else []
                while len(slots) < n and await make_room(rt):
                    slots += rt.placement.grant(Tier.CPU, n - len(slots))
                if self._held.get(segment) is not h:  # forgotten meanwhile: the client went
                    for slot in slots:
                        rt.placement.ungrant(Tier.CPU, slot)
                    continue
                # Booked first: a push that fails leaves them to `forget`.
                marks = list(zip(slots, range(h.head, h.head + len(slots))))
                h.slots.update(marks)
                if slots:
                    h.head = ring.push(h.head, slots)
                    h.in_ring.extend(marks)  # only once pushed: a failed push's positions come again
                    h.compact()
                total += len(slots)
            except (SegmentError, OSError) as e:
                self.log.warning("grants.top_up_failed", segment=segment, error=str(e))
        return total

    def renew(self, segments: list[str]) -> None:
        """At start, before serving: stamp this daemon's epoch on every client's ring, so that a
        client drops the grants an earlier daemon gave it before it writes into them."""
        for name in segments:
            try:
                f = self.staging.open_unchecked(name)
            except (SegmentError, OSError):
                continue
            try:
                RingFile(f.fd).begin(self.epoch)
            except OSError:
                continue

    def expire(self, now: float | None = None) -> int:
        """Take back grants the client took from its ring GRANT_EXPIRE_S ago or more and no put
        has named since (the client starts no write into one GRANT_USE_S after taking it:
        kvtier/shm/grant_ring.py). A grant still in the ring is the client's to take whenever it
        puts next, so it is left: an idle client's grants stay until it puts, dies or closes.
        `now` never goes back between sweeps (the queues are in its order). How many were taken
        back."""
        now = time.monotonic() if now is None else now
        n = 0
        for segment, h in self._held.items():
            try:
                st = RingFile(self.staging.open_unchecked(segment).fd).state()
            except (SegmentError, OSError):
                continue  # gone: the reaper forgets it
            if st is None:
                continue
            tail = st[3]  # the client's word: a tail pushed ahead only expires its own grants sooner
            in_ring, taken = h.in_ring, h.taken
            while in_ring and in_ring[0][1] < tail:  # taken since the last sweep: its time starts now
                slot, mark = in_ring.popleft()
                if h.holds(slot, mark):
                    taken.append((now, slot, mark))
            old = []
            while taken and (now - taken[0][0] > GRANT_EXPIRE_S or not h.holds(taken[0][1], taken[0][2])):
                _, slot, mark = taken.popleft()
                if h.holds(slot, mark):
                    old.append(slot)
            h.compact()
            for slot in old:
                self.take(h.pool, segment, slot)
                self.release(self.pools[h.pool], slot)
                self._wanted[segment] = h.pool
            n += len(old)
        return n

    def forget(self, segment: str) -> None:
        """The segment's client died or closed it: every slot still granted to it is emptied (a
        fill it died in the middle of included) and freed."""
        self._wanted.pop(segment, None)
        h = self._held.pop(segment, None)
        if h is None or (rt := self.pools.get(h.pool)) is None:
            return
        for slot in h.slots:
            self.release(rt, slot)
        if h.slots:
            self.log.info("grants.reclaimed", segment=segment, pool=h.pool, slots=len(h.slots))
