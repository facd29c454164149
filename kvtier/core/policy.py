"""Placement policy: a pure function of the tier indices that returns commands for the workers.

It imports neither asyncio, redis nor torch. The coordinator calls it after each batch of client
events and tier facts and publishes what it returns; the tier workers carry the commands out and
report what they did to the tier indices through it (kvtier/core/residency.py), which owns them.

`Placement` is built up in layers, each a module of its own:
- kvtier/core/residency.py `Residency`: the tier indices, and the one way to change them;
- kvtier/core/room.py `Room`: what is in flight, and how much room a tier has;
- kvtier/core/shedding.py `Shedding`: tiers above their high watermark shed down to the low one
  (evict what a lower tier holds, write back the rest), and the leaving marks;
- kvtier/core/promotion.py `Promotion`: promotion on hits, prefetch and its leases, and bringing
  up blocks clients read straight from Redis;
- here: admission of new blocks (`admit`, `on_put`), settling what was in flight as the facts
  come back (`on_fact`, `revert`), and the after-batch step (`pressure`).

Rules (config `[policy]`; shedding and promotion in their modules):
- A put lands in the highest local tier with room (gpu, then cpu), head first; when the chain
  does not fit, room for more of its head is made by dropping colder chains' clean tails (blocks
  Redis holds), and only the tail goes to Redis, so a burst of puts is not dropped while
  write-backs catch up. A put that spills to Redis is written there whole: its local head, and
  the local ancestors Redis lacks, are copied too (unless the frequency filter is on), so that
  another node can read the chain from its first block (core/spill.py).
- Redis writes are write-back (when cpu sheds a block) or write-through (a `copy` as soon as a
  block is stored locally; core/write_through.py), per `redis_write`. With `redis_admit_after_hits`
  = N > 0 only blocks read N times go to Redis (write-through copies them on the N-th read); cpu
  drops the others when it sheds them, with the reason "unreused" (Dynamo's frequency filter).
- A write-back ends when the lower tier reports the block stored: the copy above is evicted then,
  if it is still leaving, childless and unpinned (else it stays, and the copy below is a spare).
- A session-pinned block (core/pins.py) stays on the node until its pin ends; its Redis copy
  lives at least as long (`on_pin`'s Retain).
- Tenants share each node tier by weight (core/tenants.py): while one is over its share, the
  tier sheds and makes room only from tenants over theirs; a capped tenant's puts past its cap
  go on down.
- Commands in flight are remembered until their outcome fact arrives or `transfer_timeout_s`
  passes, whichever is first: a command that never reports (dead-lettered, trimmed, lost with a
  Redis restart) cannot shrink a tier's room or pin a block for ever.
Time is passed in (`now`), never read here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.core.events import (
    Cause,
    Command,
    Copy,
    Demote,
    Evict,
    Failure,
    Reason,
    Removed,
    Retain,
    Store,
    Stored,
    Tier,
)
from kvtier.core.index import TierIndex
from kvtier.core.knobs import PolicyKnobs, RedisWrite
from kvtier.core.pins import PinRules, Pins, PinVerdict
from kvtier.core.promotion import Promotion
from kvtier.core.residency import LOCAL, NODE
from kvtier.core.shedding import DROP_REASONS
from kvtier.core.spill import SpillCopies
from kvtier.core.tenants import TenantRules
from kvtier.core.write_through import copy_for_fact
from kvtier.keys import BlockKey

__all__ = ["DROP_REASONS", "Command", "Placement"]


class Placement(Promotion):
    """Decisions for one pool, over the tier indices it owns (`Residency`) and what it has in
    flight (`Room`)."""

    def __init__(self, pool: str, tiers: dict[Tier, TierIndex], knobs: PolicyKnobs, *,
                 pin_rules: PinRules | None = None, block_bytes: int = 1, tenant_rules: TenantRules | None = None
                 ) -> None:
        super().__init__(pool, tiers, knobs)
        self.tenants.rules = tenant_rules or TenantRules()
        self._spill = SpillCopies(pool)  # heads of spilled puts, copied to Redis once stored
        self._now = 0.0  # the time of the latest decision (every one passes it in)
        self.pins = Pins(pin_rules or PinRules(), block_bytes, self.node_slots)

    def caches(self) -> dict[str, tuple[int, int]]:
        """What the policy remembers besides the tier indices, each as (entries, the most it may
        hold). What it keeps per block in flight (commands, leaving marks, spilled puts' copies)
        is bounded in time instead: `transfer_timeout_s`."""
        node = self.node_slots()
        return {
            "redis_record": (len(self.tiers[Tier.REDIS]), node),  # only while a node copy exists
            "remote_reads": (len(self._remote_reads), max(1, sum(self.tiers[t].capacity or 0 for t in LOCAL))),
            "leases": (len(self._leases), self._lease_cap),
            "prefetch_waiting": (len(self._wanted), (self.tiers[Tier.CPU].capacity or 0) // 2),
            "pins": (len(self.pins), int(self.pins.rules.node_share * node)),
            "tenant_owners": (len(self.tenants), 2 * node),  # blocks on the node, or on their way into it
        }

    # --- session pins --------------------------------------------------------------------------

    def on_pin(self, keys: Sequence[BlockKey], tenant: str, ttl_s: int, now: float
               ) -> tuple[PinVerdict, Retain | None]:
        """Pin a chain for a session (core/pins.py). A move off the node already decided for a
        block now pinned is called off; the Retain keeps the Redis copies at least as long."""
        self._expire(now)
        verdict = self.pins.pin(keys, tenant, ttl_s, now)
        for key in verdict.pinned:
            for t in NODE:
                e = self.tiers[t].get(key)
                if e is not None and e.leaving and self.held_below(t, key) not in NODE and not any(
                        self._demoting.get((d, key)) == t for d in NODE):
                    self._unmark(t, key)  # leaving the node (an evict, or a write-back to Redis)
        return verdict, Retain(self.pool, verdict.pinned, verdict.ttl_s) if verdict.pinned else None

    # --- admission -----------------------------------------------------------------------------

    def admit(self, keys: Sequence[BlockKey], now: float, parent: BlockKey | None = None, granted: int = 0,
              tenant: str = "", adopting: bool = False) -> list[Tier | None]:
        """Where each new block from a client goes, head first: the highest local tier with room
        (counting blocks already on their way in), then, for a chain that does not fit, a slot
        the worker frees by dropping a colder chain's clean tail block, else straight to Redis
        rather than dropping it. The first `granted` blocks were written into cpu slots granted
        to the client (kvtier/tiers/grants.py): they go to the cpu tier, where their bytes are
        (promotion moves them up when they are hot). None for a block already here or already
        on its way (a duplicate put). A tenant with a cap (core/tenants.py) gets no more slots
        of a tier than its cap leaves: the rest of its chain goes on down. `adopting`: the caller
        adopts the granted blocks before its next decision (kvtier/tiers/granted_puts.py), so they
        are never in flight and are not recorded as such."""
        self._expire(now)
        fresh: dict[BlockKey, None] = {}  # new to this node, in put order (a chain: head first)
        placed: set[BlockKey] = set()  # the granted ones, in their cpu slots already
        # What the local tiers hold or have on its way in, found by intersecting key views in C:
        # this runs for every block put, where a call a key and tier cost a fifth of admission.
        put = dict.fromkeys(keys).keys()
        here = (self.tiers[Tier.GPU].present(put) | self.tiers[Tier.CPU].present(put)
                | (put & self._incoming[Tier.GPU].keys()) | (put & self._incoming[Tier.CPU].keys()))
        for i, key in enumerate(keys):
            if key not in here and key not in placed:
                if i < granted:
                    placed.add(key)
                else:
                    fresh[key] = None
        # (Room is only asked for when there is something to place: all granted, there is not.)
        slots = [t for t in LOCAL for _ in range(min(self.room(t), len(fresh)))] if fresh else []
        if len(slots) < len(fresh):
            # Colder chains' tails make way for this chain's head: blocks Redis (for gpu: cpu)
            # holds too, which the worker drops when it finds the tier full (room_victim).
            for t in LOCAL:
                slots += [t] * self._clean_spares(t, len(fresh) - len(slots))
        allow = {t: self.tenants.allowance(t, tenant) for t in LOCAL}
        if any(a is not None for a in allow.values()):
            capped = []
            for t in slots:
                if (a := allow[t]) is None or a > 0:
                    capped.append(t)
                    allow[t] = None if a is None else a - 1
            slots = capped
        place = dict(zip(fresh, slots))
        until = now + self.knobs.transfer_timeout_s
        incoming, redis, cpu = self._incoming, Tier.REDIS, Tier.CPU
        out: list[Tier | None] = []
        for key in keys:  # a chain: each block's parent is the one before it (the first's: `parent`)
            if key in placed:  # (a key is in one of placed and fresh at most)
                placed.remove(key)
                tier = cpu
                if not adopting:
                    incoming[tier].add(key, parent, until)
            elif key in fresh:
                del fresh[key]
                tier = place.get(key, redis)
                if tier in incoming:
                    incoming[tier].add(key, parent, until)
            else:
                out.append(None)  # here already, on its way, or a duplicate within this put
                parent = key
                continue
            # Not counted for anyone yet (new to gpu and cpu, as checked above).
            if tenant and tier in incoming and self.tiers[Tier.DISK].get(key) is None:
                self.tenants.claim(key, tenant)
            out.append(tier)
            parent = key
        return out

    def on_put(self, keys: Sequence[BlockKey], parent: BlockKey | None, now: float, granted: int = 0,
               tenant: str = "", adopting: bool = False) -> tuple[list[Tier | None], list[Command]]:
        """`admit`, and the Redis copies a put that spills calls for (core/spill.py): the copies
        of its local ancestors go now, those of its own local head once they are stored.
        `tenant` is the name the put carries (before the operator's aliases)."""
        tiers = self.admit(keys, now, parent, granted, self.tenants.rules.name(tenant), adopting)
        if (self.knobs.redis_write is RedisWrite.WRITE_THROUGH or self.knobs.redis_admit_after_hits
                or Tier.REDIS not in tiers):
            return tiers, []
        return tiers, list(self._spill.spilled(self, keys, tiers, parent, now + self.knobs.transfer_timeout_s))

    # --- settling what was in flight -----------------------------------------------------------

    def on_stored(self, tier: Tier, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> list[Command]:
        """`on_fact` for blocks clients put that are now stored in local tier `tier`, in order:
        a put's whole batch at once, with no `Stored` made per block (on_fact comes here too)."""
        incoming, redis = self._incoming[tier], self.tiers[Tier.REDIS]
        until = self._now + self.knobs.transfer_timeout_s  # facts carry no time: the latest decision's
        through = self.knobs.redis_write is RedisWrite.WRITE_THROUGH and not self.knobs.redis_admit_after_hits
        out: list[Command] = []
        for key, parent in zip(keys, parents):
            incoming.pop(key)
            spill = self._spill.stored(self, key, until)
            # As core/write_through.py `copy_for_fact` has it for such a fact.
            copy = Copy(self.pool, key, parent, tier, Tier.REDIS) if through and key not in redis else spill
            if copy is not None:
                out.append(copy)
        return out

    def on_fact(self, fact: Stored | Removed) -> list[Command]:
        """Settle what was in flight; finish write-backs: once the next tier stored a demoted
        block, drop it up here."""
        cause = fact.cause  # a Removed of any cause but EVICT is that command's failure
        if isinstance(fact, Stored) and cause == Cause.STORE and fact.tier in LOCAL:
            return self.on_stored(fact.tier, [fact.key], [fact.parent])
        if fact.tier in self._incoming and cause in (Cause.STORE, Cause.PROMOTE, Cause.DEMOTE):
            self._incoming[fact.tier].pop(fact.key)
            if isinstance(fact, Removed):
                self.forget_tenant(fact.key)
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
                return self._demoted(src, fact.tier, fact.key)
            self._unmark(src, fact.key)  # the demote failed: the block stays where it was and may be chosen again
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

    def _demoted(self, src: Tier, dst: Tier, key: BlockKey) -> list[Command]:
        """`dst` stored the block `src` is writing back there: evict it from `src`."""
        e = self.tiers[src].get(key)
        # Only a block still on its way out may go; a redelivered fact must not evict a block
        # that has since come back. And a child may have arrived meanwhile: then the parent stays
        # (tail first; also while a child sits in the other local tier and this copy would leave
        # the node) and the copy below is merely a spare.
        if e is None or not e.leaving:
            return []
        if self.children(src, key) or self.strands_children(src, key, dst) or e.pins > 1:
            self._unmark(src, key)
            return []
        if (src, key) in self._leaving:  # a full timeout for the last step
            self._leaving[(src, key)] += self.knobs.transfer_timeout_s
        return [Evict(self.pool, key, src, Reason.DEMOTED)]

    def _expected(self, key: BlockKey) -> bool:
        """Whether `key` is here or on its way: a failed promote (perhaps a late one) leaves the
        lease of such a block alone."""
        return key in self._wanted or any(self.tiers[t].get(key) is not None or key in self._incoming[t]
                                          for t in NODE)

    def revert(self, cmds: Iterable[Command]) -> None:
        """The commands were never published: undo what deciding them marked."""
        for c in cmds:
            dst = c.tier if isinstance(c, (Store, Evict)) else c.dst
            if dst in self._incoming and not isinstance(c, (Evict, Copy)):
                self._incoming[dst].pop(c.key)
                self.forget_tenant(c.key)  # a put's owner, unless the block is here after all
            if isinstance(c, (Demote, Evict)):
                self._unmark(c.src if isinstance(c, Demote) else c.tier, c.key)

    # --- after each batch ----------------------------------------------------------------------

    def pressure(self, now: float) -> list[Command]:
        """Promote prefetched blocks that now have room; shed blocks from every local tier
        above its high watermark (counting prefetched blocks still waiting for room)."""
        self._expire(now)
        out = self._promote_wanted(now)
        for t in NODE:
            out.extend(self._shed(t, now))
        return out

    def _expire(self, now: float) -> None:
        self._now = max(self._now, now)
        self._spill.expire(now)
        super()._expire(now)
