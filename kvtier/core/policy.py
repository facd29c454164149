"""Placement policy: a pure function of the tier indices that returns commands for the workers.

It imports neither asyncio, redis nor torch. The coordinator calls it after each batch of client
events and tier facts and publishes what it returns; the tier workers carry the commands out and
report what they did to the tier indices through it (kvtier/core/residency.py), which owns them.

Rules (config `[policy]`):
- A put lands in the highest local tier with room (gpu, then cpu), head first; when the chain
  does not fit, room for more of its head is made by dropping colder chains' clean tails (blocks
  Redis holds), and only the tail goes to Redis, so a burst of puts is not dropped while
  write-backs catch up. A put that spills to Redis is written there whole: its local head, and
  the local ancestors Redis lacks, are copied too (unless the frequency filter is on), so that
  another node can read the chain from its first block (core/spill.py).
- Above `high_watermark` of its slots, a tier sheds its coldest evictable blocks down to
  `low_watermark`: a block the next tier already holds is evicted at once; any other is demoted
  (write-back) and stays readable, pinned, until the next tier reports it stored. Candidates
  are the tier's LRU leaves (no resident child in the same tier); a block is also kept while a
  child of it sits in the other local tier and the move would take it off the node, so no
  block leaves the node before its extensions. When cpu has no room, gpu writes its victims
  that have no child in cpu straight to Redis: cpu may be full of exactly those protected
  parents, and waiting for it would freeze both tiers.
- A block read `promote_after_hits` times while only in cpu is promoted to gpu if gpu has room.
- Redis writes are write-back (when cpu sheds a block) or write-through (a `copy` as soon as a
  block is stored locally; core/write_through.py), per `redis_write`. With `redis_admit_after_hits` = N > 0 only blocks
  read N times go to Redis (write-through copies them on the N-th read); cpu drops the others
  when it sheds them, with the reason "unreused" (Dynamo's frequency filter).
- A prefetch promotes the blocks that are not local from Redis into `prefetch_to` (cpu, or gpu
  while it has room). A block with no free cpu slot yet waits (up to half the tier, for
  `prefetch_lease_s`) and is promoted as shedding frees room: a promote is sent only with a
  slot for it. Prefetched blocks are leased for `prefetch_lease_s`: shedding skips them until
  they are read or the lease runs out, and a move out of a tier chosen before the prefetch is
  called off, so a prefetch into a full tier is not undone before the client gets to read it.
  Leases cover at most half the local slots, so prefetches cannot crowd out blocks being read.
- A block a client read straight from Redis (read-through, `RemoteRead`) `promote_remote_after_reads`
  times is promoted into cpu when cpu has a slot for it now (free, or a clean block the worker
  drops at once), and never waits for one: the client has its bytes already, so bringing them up
  only helps the next reader. The reads are counted for at most as many blocks as the node holds.
- Commands in flight are remembered until their outcome fact arrives or `transfer_timeout_s`
  passes, whichever is first: a command that never reports (dead-lettered, trimmed, lost with a
  Redis restart) cannot shrink a tier's room or pin a block for ever.
Time is passed in (`now`), never read here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.core.events import Cause, Copy, Demote, Evict, Failure, Promote, Reason, Removed, Store, Stored, Tier
from kvtier.core.index import State, TierIndex
from kvtier.core.knobs import PolicyKnobs, RedisWrite
from kvtier.core.residency import LOCAL
from kvtier.core.room import Room
from kvtier.core.spill import SpillCopies
from kvtier.core.write_through import copy_for_fact, copy_on_read
from kvtier.keys import BlockKey

# Evict reasons that may drop a block no lower tier holds: documented rules, not accidents.
DROP_REASONS = frozenset({Reason.UNREUSED})

Command = Store | Promote | Demote | Copy | Evict


class Placement(Room):
    """Decisions for one pool, over the tier indices it owns (`Residency`) and what it has in
    flight (`Room`)."""

    def __init__(self, pool: str, tiers: dict[Tier, TierIndex], knobs: PolicyKnobs) -> None:
        super().__init__(tiers)
        self.pool = pool
        self.knobs = knobs
        self._leaving: dict[tuple[Tier, BlockKey], float] = {}  # (tier, key) chosen to leave -> give-up time
        # Prefetched blocks waiting for a free cpu slot, in request order (a chain's head
        # first): key -> (parent, give-up time). Promoted as shedding frees room.
        self._wanted: dict[BlockKey, tuple[BlockKey | None, float]] = {}
        # Demotes in flight: (destination, key) -> source. A block can be leaving gpu and cpu at
        # once (gpu -> cpu done, its gpu evict not yet carried out, cpu -> redis under way), so
        # the fact alone does not say which copy a completed write-back releases.
        self._demoting: dict[tuple[Tier, BlockKey], Tier] = {}
        # Blocks read straight from Redis and not yet brought up: key -> reads, oldest first.
        self._remote_reads: OrderedDict[BlockKey, int] = OrderedDict()
        self._spill = SpillCopies(pool)  # heads of spilled puts, copied to Redis once stored
        self._now = 0.0  # the time of the latest decision (every one passes it in)

    # --- decisions -----------------------------------------------------------------------------

    def admit(self, keys: Sequence[BlockKey], now: float, parent: BlockKey | None = None) -> list[Tier | None]:
        """Where each new block from a client goes, head first: the highest local tier with room
        (counting blocks already on their way in), then, for a chain that does not fit, a slot
        the worker frees by dropping a colder chain's clean tail block, else straight to Redis
        rather than dropping it. None for a block already here or already on its way (a
        duplicate put)."""
        self._expire(now)
        fresh: dict[BlockKey, None] = {}  # new to this node, in put order (a chain: head first)
        for key in keys:
            if all(self.tiers[t].get(key) is None and key not in self._incoming[t] for t in LOCAL):
                fresh[key] = None
        slots = [t for t in LOCAL for _ in range(min(self.room(t), len(fresh)))]
        if len(slots) < len(fresh):
            # Colder chains' tails make way for this chain's head: blocks Redis (for gpu: cpu)
            # holds too, which the worker drops when it finds the tier full (room_victim).
            for t in LOCAL:
                slots += [t] * self._clean_spares(t, len(fresh) - len(slots))
        place = dict(zip(fresh, slots))
        out: list[Tier | None] = []
        for key in keys:  # a chain: each block's parent is the one before it (the first's: `parent`)
            if key not in fresh:
                out.append(None)  # here already, on its way, or a duplicate within this put
            else:
                del fresh[key]
                tier = place.get(key, Tier.REDIS)
                if tier in self._incoming:
                    self._incoming[tier].add(key, parent, now + self.knobs.transfer_timeout_s)
                out.append(tier)
            parent = key
        return out

    def on_put(self, keys: Sequence[BlockKey], parent: BlockKey | None, now: float
               ) -> tuple[list[Tier | None], list[Command]]:
        """`admit`, and the Redis copies a put that spills calls for (core/spill.py): the copies
        of its local ancestors go now, those of its own local head once they are stored."""
        tiers = self.admit(keys, now, parent)
        if (self.knobs.redis_write is RedisWrite.WRITE_THROUGH or self.knobs.redis_admit_after_hits
                or Tier.REDIS not in tiers):
            return tiers, []
        return tiers, list(self._spill.spilled(self, keys, tiers, parent, now + self.knobs.transfer_timeout_s))

    def on_access(self, keys: Iterable[BlockKey], now: float) -> list[Command]:
        self._expire(now)
        out: list[Command] = []
        gpu, cpu = self.tiers[Tier.GPU], self.tiers[Tier.CPU]
        for key in keys:
            self._leases.pop(key, None)  # read: the lease has served its purpose
            g = gpu.touch(key)
            c = cpu.touch(key)
            if (g is None and c is not None and c.state is State.READY and self.room(Tier.GPU) > 0
                    and c.hits >= self.knobs.promote_after_hits and key not in self._incoming[Tier.GPU]):
                out.append(Promote(self.pool, key, c.parent, Tier.CPU, Tier.GPU, c.slot, 0))
                self._incoming[Tier.GPU].add(key, c.parent, now + self.knobs.transfer_timeout_s)
            if (copy := copy_on_read(self, self.knobs, self.pool, key, g, c)) is not None:
                out.append(copy)
        return out

    def reused(self, key: BlockKey) -> bool:
        """Whether Redis should admit this block (the frequency filter): read often enough, or no
        filter. The filter's drop (reason "unreused") is for the others only."""
        n = self.knobs.redis_admit_after_hits
        return not n or any((e := self.tiers[t].get(key)) is not None and e.hits >= n for t in LOCAL)

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
                        out.append(Promote(self.pool, key, parent, Tier.REDIS, dst, -1, 0))
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
                for t in LOCAL:
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
            here = any(self.tiers[t].get(key) is not None or key in self._incoming[t] for t in LOCAL)
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

    def on_fact(self, fact: Stored | Removed) -> list[Command]:
        """Settle what was in flight; finish write-backs: once the next tier stored a demoted
        block, drop it up here."""
        cause = fact.cause  # a Removed of any cause but EVICT is that command's failure
        if fact.tier in self._incoming and cause in (Cause.STORE, Cause.PROMOTE, Cause.DEMOTE):
            self._incoming[fact.tier].pop(fact.key)
        spill = None
        until = self._now + self.knobs.transfer_timeout_s  # facts carry no time: the latest decision's
        if fact.tier in LOCAL and cause == Cause.STORE:
            if isinstance(fact, Stored):
                spill = self._spill.stored(self, fact.key, until)
            else:
                self._spill.forget(fact.key)
        elif fact.tier == Tier.REDIS and cause == Cause.COPY:
            if isinstance(fact, Removed) and isinstance(fact.why, Failure):
                spill = self._spill.copy_failed(self, fact.key, fact.why, until)
            else:
                self._spill.copied(fact.key)
        if fact.tier != Tier.GPU and cause == Cause.DEMOTE:
            src = self._demoting.pop((fact.tier, fact.key), None)
            if src is None:
                # No demote to this tier is in flight: the fact is late or redelivered, and its
                # record settled or expired. A leaving mark the block carries now belongs to
                # another command (an evict, or a demote elsewhere), which reports on its own;
                # the copy below, if stored, is merely a spare.
                return []
            if isinstance(fact, Stored):
                e = self.tiers[src].get(fact.key)
                # Only a block still on its way out may go; a redelivered fact must not evict a
                # block that has since come back. And a child may have arrived meanwhile: then
                # the parent stays (tail first; also while a child sits in the other local tier
                # and this copy would leave the node) and the copy below is merely a spare.
                if e is None or not e.leaving:
                    return []
                if (self.children(src, fact.key) or self.strands_children(src, fact.key, fact.tier)
                        or e.pins > 1):
                    self._unmark(src, fact.key)
                    return []
                if (src, fact.key) in self._leaving:  # a full timeout for the last step
                    self._leaving[(src, fact.key)] += self.knobs.transfer_timeout_s
                return [Evict(self.pool, fact.key, src, Reason.DEMOTED)]
            else:  # the demote failed: the block stays where it was and may be chosen again
                self._unmark(src, fact.key)
        if isinstance(fact, Removed) and cause == Cause.EVICT:
            # The worker drops a block before it reports it. A block here and leaving again
            # came back since (a late or redelivered fact): its record belongs to the newer
            # mark, which must still be able to expire.
            e = self.tiers[fact.tier].get(fact.key)
            if e is None or not e.leaving:
                self._leaving.pop((fact.tier, fact.key), None)
        if isinstance(fact, Removed) and cause == Cause.PROMOTE and not self._expected(fact.key):
            self._leases.pop(fact.key, None)  # nothing came: do not hold a lease slot for it
        copy = copy_for_fact(self, self.knobs, self.pool, fact) or spill
        return [] if copy is None else [copy]

    def _expected(self, key: BlockKey) -> bool:
        """Whether `key` is here or on its way: a failed promote (perhaps a late one) leaves the
        lease of such a block alone."""
        return key in self._wanted or any(self.tiers[t].get(key) is not None or key in self._incoming[t]
                                          for t in LOCAL)

    def revert(self, cmds: Iterable[Command]) -> None:
        """The commands were never published: undo what deciding them marked."""
        for c in cmds:
            dst = c.tier if isinstance(c, (Store, Evict)) else c.dst
            if dst in self._incoming and not isinstance(c, (Evict, Copy)):
                self._incoming[dst].pop(c.key)
            if isinstance(c, (Demote, Evict)):
                self._unmark(c.src if isinstance(c, Demote) else c.tier, c.key)

    def refused(self, t: Tier, key: BlockKey) -> None:
        """A worker refused to evict: the block stays and may be chosen again."""
        self._unmark(t, key)

    def pressure(self, now: float) -> list[Command]:
        """Promote prefetched blocks that now have room; shed blocks from every local tier
        above its high watermark (counting prefetched blocks still waiting for room)."""
        self._expire(now)
        out = self._promote_wanted(now)
        for t in LOCAL:
            out.extend(self._shed(t, now))
        return out

    def _promote_wanted(self, now: float) -> list[Command]:
        out: list[Command] = []
        for key in list(self._wanted):
            if self.room(Tier.CPU) <= 0:
                break
            parent, _ = self._wanted.pop(key)
            if any(self.tiers[t].get(key) is not None or key in self._incoming[t] for t in LOCAL):
                continue
            out.append(Promote(self.pool, key, parent, Tier.REDIS, Tier.CPU, -1, 0))
            self._incoming[Tier.CPU].add(key, parent, now + self.knobs.transfer_timeout_s)
        return out

    def _expire(self, now: float) -> None:
        self._now = max(self._now, now)
        self._spill.expire(now)
        for key in [k for k, until in self._leases.items() if until <= now]:
            del self._leases[key]
        for key in [k for k, (_, until) in self._wanted.items() if until <= now]:
            del self._wanted[key]
        for pending in self._incoming.values():
            pending.expire(now)
        for t, key in [tk for tk, until in self._leaving.items() if until <= now]:
            self._unmark(t, key)

    def _unmark(self, t: Tier, key: BlockKey) -> None:
        self._leaving.pop((t, key), None)
        for dst in (Tier.CPU, Tier.REDIS):
            if self._demoting.get((dst, key)) == t:
                del self._demoting[(dst, key)]
        self.tiers[t].clear_leaving(key)

    def _shed(self, t: Tier, now: float) -> list[Command]:
        idx = self.tiers[t]
        if not idx.capacity:
            return []
        wanted = len(self._wanted) if t == Tier.CPU else 0
        staying = idx.used + self.incoming(t) + wanted - idx.leaving
        if staying <= self.knobs.high_watermark * idx.capacity:
            return []
        excess = staying - int(self.knobs.low_watermark * idx.capacity)
        lower = Tier(t + 1)
        give_up = now + self.knobs.transfer_timeout_s
        out: list[Command] = []
        for key in list(idx.candidates()):
            if excess <= 0:
                break
            if key in self._leases or self._incoming[t].kids(key):
                continue  # leased; or a child is on its way into this tier (tail first)
            e = idx.get(key)
            assert e is not None
            dst = lower
            if lower == Tier.CPU and key not in self.tiers[lower] and self.room(Tier.CPU) <= 0:
                # cpu is full, perhaps of the very parents of these gpu blocks, which may not
                # leave before them: write the gpu block straight to Redis rather than deadlock.
                dst = Tier.REDIS
            if self.strands_children(t, key, dst):
                continue  # tail first across tiers too: it waits for room in cpu, or for its children
            if key in self.tiers[dst]:
                out.append(Evict(self.pool, key, t, Reason.CLEAN))
            elif dst == Tier.REDIS and not self.reused(key):
                out.append(Evict(self.pool, key, t, Reason.UNREUSED))  # the frequency filter's drop
            else:
                out.append(Demote(self.pool, key, e.parent, t, dst, e.slot, 0))
                self._demoting[(dst, key)] = t
                if dst in self._incoming:
                    self._incoming[dst].add(key, e.parent, give_up)
            idx.mark_leaving(key)  # readable until the worker acts, never picked twice
            self._leaving[(t, key)] = give_up
            excess -= 1
        return out
