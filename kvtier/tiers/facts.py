"""The facts a tier worker reports in a batch, with the counters and log lines that go with them.

What a command's outcome is (its fact, its counter, what it means for Redis's copy) is decided by
the pure rules in kvtier/core/outcomes.py; here it is applied: counted, told to the pool, logged,
and queued for the batch's publish.
"""

from __future__ import annotations

import time

from structlog.typing import FilteringBoundLogger

from kvtier.core.events import Cause, Removed, StagedBlock, Store, StoreBatch, Stored, StoredBatch, Tier
from kvtier.core.outcomes import MOVED_IN, Count, Fact, Outcome, Received
from kvtier.logs import LogThrottle
from kvtier.tiers.pool import PoolRuntime

__all__ = ["Fact", "Facts", "Received"]


class Facts:
    def __init__(self, tier: Tier, log: FilteringBoundLogger) -> None:
        self.tier = tier
        self.log = log
        # During an outage every transfer of a batch fails the same way: a line per reason every
        # few seconds, with a count; `failed` per tier counts every one (metrics).
        self.quiet = LogThrottle(log)
        self._facts: list[Fact | StoredBatch] = []

    def report(self, rt: PoolRuntime, fact: Fact | None, t0: float) -> None:
        """Queue a command's outcome for the batch's publish; time it when it stored a block."""
        if isinstance(fact, Stored):
            rt.counters.tiers[self.tier.label].timed(time.perf_counter() - t0)
        if fact is not None:
            self._facts.append(fact)

    def report_adopted(self, rt: PoolRuntime, batch: StoreBatch, blocks: list[StagedBlock],
                       got: list[tuple[Outcome, str] | None], t0: float) -> None:
        """A put's granted `blocks` (of `batch`) as GrantBook.adopt_blocks left them. Those adopted
        (None), the common case, are counted and timed at once and reported as stored_batch
        facts, with no outcome or fact made a block; the rest as `report` has them."""
        done = [b for b, r in zip(blocks, got) if r is None]
        if done:  # one fact, cut to MAX_RUN when published (core/fact_batches.py)
            self._facts.append(StoredBatch(rt.name, self.tier, Cause.STORE, tuple(b.key for b in done),
                                           tuple(b.parent for b in done), tuple(b.slot for b in done)))
            c = rt.counters.tiers[self.tier.label]
            c.add(Count.STORED, len(done))
            c.bytes_in += len(done) * rt.layout.block_bytes
            c.timed(time.perf_counter() - t0, len(done))
        for b, r in zip(blocks, got):
            if r is not None:
                self.report(rt, self.settle(rt, r[0], batch.store(b), r[1]), t0)

    def add(self, fact: Fact) -> None:
        """A fact besides the command's own (an eviction to make room for it)."""
        self._facts.append(fact)

    def take(self) -> list[Fact | StoredBatch]:
        facts, self._facts = self._facts, []
        return facts

    def settle(self, rt: PoolRuntime, o: Outcome, ev: Received | None = None, detail: str = "") -> Fact | None:
        """Apply an outcome in this tier: count it, tell the pool what Redis holds now, log it
        (`ev`: the command, `detail`: what the I/O met). Its fact, for `report`."""
        c = rt.counters.tiers[self.tier.label]
        if o.count is not None:
            c.add(o.count)
            if o.count in MOVED_IN:
                c.bytes_in += rt.layout.block_bytes
        if o.dropped:
            rt.counters.puts_dropped += 1
        if o.redis_error:
            rt.redis.stats.errors += 1
        fact = o.fact
        if isinstance(fact, Stored) and o.in_redis:
            rt.in_redis(fact.key, fact.parent)
        elif fact is not None and o.in_redis is False:
            rt.not_in_redis(fact.key)
        if isinstance(fact, Removed) and o.count is Count.FAILED:
            line = {"pool": rt.name, "op": fact.cause.value, "key": fact.key.hex()[:16], "why": fact.why.value,
                    "detail": detail}
            self.log.debug("tier.transfer_failed", **line)  # every one, at debug
            self.quiet.warning("tier.transfer_failed", per=(rt.name, fact.cause.value, fact.why), **line)
        elif ev is not None and o.count in MOVED_IN and not isinstance(ev, Store):
            self.log.debug("tier.transfer", pool=rt.name, op=ev.TYPE, src=ev.src.label, key=ev.key.hex()[:16])
        return fact
