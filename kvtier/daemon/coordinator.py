"""The coordinator: turns client events and tier facts into tier commands, using the pure policy.

It consumes the node's client stream (access, put, prefetch, remote_read, pin) and facts stream (stored, removed),
asks each pool's Placement what to do, and publishes the resulting commands to the tier workers'
streams in one pipeline per batch. It never touches block bytes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvtier.bus.consumer import Delivery
from kvtier.bus.dedup import AppliedEntries
from kvtier.bus.streams import StreamNames
from kvtier.core.events import (
    Access,
    Cause,
    Copy,
    Demote,
    Evict,
    Pin,
    Prefetch,
    Promote,
    Put,
    RemoteRead,
    Removed,
    Retain,
    StagedBlock,
    Store,
    StoreBatch,
    Stored,
    StoredBatch,
    Tier,
)
from kvtier.core.residency import LOCAL
from kvtier.errors import MalformedEvent
from kvtier.keys import BlockKey
from kvtier.tiers.granted_puts import GrantedPuts, InProcessFact
from kvtier.tiers.grants import GrantBook
from kvtier.tiers.pool import PoolRuntime

Sent = Store | StoreBatch | Promote | Demote | Copy | Evict | Retain  # a command as it goes on the wire


def command_stream(names: StreamNames, cmd: Sent) -> str:
    if isinstance(cmd, (Promote, Demote, Copy)):
        return names.tier(cmd.dst)
    if isinstance(cmd, Retain):
        return names.tier(Tier.REDIS)
    return names.tier(cmd.tier)


class Coordinator:
    def __init__(self, pools: dict[str, PoolRuntime], staging, publisher, names: StreamNames, log,
                 on_facts: Callable[[str, list[Stored | Removed]], None] | None = None,
                 on_tokens: Callable[[str, list[BlockKey], bytes], None] | None = None,
                 grants: GrantBook | None = None, granted_puts: GrantedPuts | None = None) -> None:
        self.pools = pools
        self.grants = grants
        self.granted_puts = granted_puts  # adopts a put's granted blocks here (tiers/granted_puts.py)
        self.on_facts = on_facts  # the KV-event publisher (for routers), told once a batch is applied
        self.on_tokens = on_tokens  # ... and the token ids a put carried, which its events name
        self._facts: dict[str, list[Stored | Removed]] = {}
        self.staging = staging
        self.publisher = publisher
        self.names = names
        self.log = log.bind(worker="coordinator")
        self._cmds: list[Sent] = []
        # Commands, and the router's facts, that follow from facts applied in-process (granted
        # puts, the grants' evictions): no entry brings those back if the batch fails, so they
        # wait for the next flush. (The router's are in `_facts` too, in the order they came.)
        self._kept: list[Sent] = []
        self._own_facts: dict[str, list[Stored | Removed]] = {}
        self._touched: set[str] = set()
        self.applied = AppliedEntries()

    async def handle(self, d: Delivery) -> None:
        if self.applied.duplicate(d.envelope):  # a redelivery: counting it again would skew hits and LRU
            return
        ev = d.envelope.event
        rt = self.pools.get(getattr(ev, "pool", ""))
        if rt is None:
            raise MalformedEvent(f"unknown pool {getattr(ev, 'pool', None)!r}")
        if isinstance(ev, Put):
            cmds = self._put(rt, ev)
        elif isinstance(ev, Access):
            held = list(rt.placement.on_node(ev.keys))
            for t, n in Counter(t for _, t in held).items():
                rt.counters.tiers[t.label].hits += n
            rt.placement.tenants.hit_many(k for k, _ in held)
            rt.counters.hits += len(ev.keys)
            rt.counters.misses += ev.missed
            cmds = rt.placement.on_access(ev.keys, time.monotonic())
        elif isinstance(ev, Prefetch):
            cmds = rt.placement.on_prefetch(ev.keys, ev.head_parent, time.monotonic())
        elif isinstance(ev, Pin):
            verdict, retain = rt.placement.on_pin(ev.keys, ev.tenant, ev.ttl_s, time.monotonic())
            if verdict.refused:  # counted by the pins too; said here, once per request
                self.log.warning("coordinator.pin_refused", pool=rt.name, tenant=ev.tenant, blocks=len(ev.keys),
                                 refused=verdict.refused, reason=verdict.reason)
            cmds = [] if retain is None else [retain]
        elif isinstance(ev, RemoteRead):
            rt.counters.remote_reads += len(ev.keys)
            cmds = rt.placement.on_remote_read(ev.keys, ev.head_parent, time.monotonic())
        elif isinstance(ev, (Stored, StoredBatch, Removed)):
            cmds = self._fact(rt, ev)
        else:
            raise MalformedEvent(f"{ev.TYPE} does not belong on the client or facts stream")
        self._cmds.extend(cmds)
        self._touched.add(rt.name)
        self.applied.handled(d.envelope)
        if isinstance(ev, Put) and self.granted_puts is not None and (not ev.blocks or ev.blocks[0].granted):
            # The client's ring refilled now, not at the batch's end: a client puts ahead of the
            # daemon, and a batch of several puts would leave it to stage (copied twice) meanwhile.
            self._in_process(await self.granted_puts.top_up())

    def _fact(self, rt: PoolRuntime, ev: InProcessFact, own: bool = False) -> list[Sent]:
        """A tier's fact, read from the facts stream or (`own`) of work done here: its commands;
        its per-block facts noted for the router's KV events."""
        if isinstance(ev, StoredBatch) and ev.cause == Cause.STORE and ev.tier in LOCAL:
            # A put's blocks, stored (the common batch): settled at once, a Stored made per block only
            # for the KV events.
            if not len(ev.keys) == len(ev.parents) == len(ev.slots):
                raise MalformedEvent("a stored_batch's keys, parents and slots differ in length")
            if self.on_facts is not None:
                self._note(rt.name, ev.facts() or [], own)
            return rt.placement.on_stored(ev.tier, ev.keys, ev.parents)
        facts = [ev] if not isinstance(ev, StoredBatch) else ev.facts()
        if facts is None:
            raise MalformedEvent("a stored_batch's keys, parents and slots differ in length")
        if self.on_facts is not None:
            self._note(rt.name, facts, own)
        return [c for f in facts for c in rt.placement.on_fact(f)]

    def _note(self, pool: str, facts: list[Stored | Removed], own: bool) -> None:
        self._facts.setdefault(pool, []).extend(facts)
        if own:
            self._own_facts.setdefault(pool, []).extend(facts)

    def _in_process(self, facts: list[InProcessFact]) -> None:
        """Facts of work done here (granted puts, the grants' evictions), applied as the facts
        stream's would be; what follows from them is kept until a flush publishes it."""
        for f in facts:
            self._kept.extend(self._fact(self.pools[f.pool], f, own=True))
            self._touched.add(f.pool)

    async def flush(self) -> None:
        """After each batch, before its acks: refill the clients' grants, shed load where needed,
        publish all commands at once."""
        for name in self._touched:
            self._cmds.extend(self.pools[name].placement.pressure(time.monotonic()))
        self._touched.clear()
        cmds, self._cmds = self._cmds, []
        kept, self._kept = self._kept, []
        try:
            if self.granted_puts is not None:  # (a failure here is the batch's, as a publish's is)
                self._in_process(await self.granted_puts.top_up())
                kept, self._kept = kept + self._kept, []
            if cmds or kept:
                await self.publisher.publish_many([(command_stream(self.names, c), c) for c in (*kept, *cmds)])
        except BaseException:
            # Nothing was acked: the batch comes back. Forget the marks these commands made so
            # that the replay decides afresh (a mark left behind would pin a block or eat room).
            for c in cmds:  # (a pin stands: the replayed request extends it, charging nothing twice)
                if not isinstance(c, Retain):
                    self.pools[c.pool].placement.revert(c.stores() if isinstance(c, StoreBatch) else [c])
            self._kept = kept + self._kept  # what in-process facts called for: no replay brings it back
            self.applied.discard()
            # The batch comes back, and its facts with it; those of work done here do not.
            self._facts = {pool: list(fs) for pool, fs in self._own_facts.items()}
            raise
        self.applied.commit()
        self._own_facts.clear()
        if self._facts:
            facts, self._facts = self._facts, {}
            for pool, fs in facts.items():
                try:
                    self.on_facts(pool, fs)  # type: ignore[misc]  # set whenever facts were kept
                except Exception as e:  # routers' events must never stop the daemon's own work
                    self.log.warning("coordinator.kv_events_failed", pool=pool, error=f"{type(e).__name__}: {e}")
        if not cmds:
            return
        self.log.debug("coordinator.commands", n=len(cmds))

    def _put(self, rt: PoolRuntime, ev: Put) -> list[Sent]:
        if not ev.blocks:  # a client about to put (Client.prepare_puts): its segment is granted slots now
            if self.grants is not None:
                self.grants.want(rt.name, ev.segment)
            return []
        rt.counters.puts += len(ev.blocks)
        if ev.tokens is not None and self.on_tokens is not None:
            self.on_tokens(rt.name, [b.key for b in ev.blocks], ev.tokens)
        blocks = ev.blocks
        granted = sum(1 for b in blocks if b.granted)  # the chain's head: written into granted cpu slots
        if any(b.granted for b in blocks[granted:]):
            raise MalformedEvent("a put's granted blocks must lead its chain")
        if granted and (self.grants is None or ev.epoch != self.grants.epoch):
            # Granted by an earlier daemon: refused, and the slots left alone (this one never granted them).
            rt.counters.puts_dropped += granted
            self.log.warning("coordinator.stale_grants", pool=rt.name, segment=ev.segment, blocks=granted)
            blocks, granted = blocks[granted:], 0
        if not blocks:
            return []
        # Adopted here, unless the cpu worker has work queued for one of them: then it adopts them, in order.
        inline = granted > 0 and self.granted_puts is not None and self.granted_puts.can_adopt(rt, blocks[:granted])
        tiers, copies = rt.placement.on_put([b.key for b in blocks], blocks[0].parent, time.monotonic(), granted,
                                            ev.tenant, inline)
        runs: dict[Tier, list[StagedBlock]] = {}  # one store_batch per tier: one command, one fact
        adopt: list[StagedBlock] = []
        for b, tier in zip(blocks, tiers):
            if tier is None and b.granted:  # already cached here: the granted slot is freed
                assert self.grants is not None
                self.grants.give_back(rt, ev.segment, b.slot)
            elif tier is None:  # already cached here: hand the staging slot straight back
                self.staging.release(ev.segment, rt.layout.block_bytes, b.slot, b.gen)
            elif inline and b.granted:  # (admitted to the cpu tier, where its bytes are)
                adopt.append(b)
            else:
                runs.setdefault(tier, []).append(b)
        if adopt:
            self._in_process(self.granted_puts.adopt(rt, ev.segment, adopt))  # type: ignore[union-attr]  # inline
        return [*copies, *(StoreBatch(rt.name, tier, ev.segment, tuple(bs)) for tier, bs in runs.items())]
