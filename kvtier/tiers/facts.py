"""The facts a tier worker reports in a batch, with the counters and log lines that go with them."""

from __future__ import annotations

import time

from structlog.typing import FilteringBoundLogger

from kvtier.core.events import Cause, Copy, Demote, Failure, Promote, Removed, Store, Stored, Tier
from kvtier.logs import LogThrottle
from kvtier.tiers.pool import PoolRuntime

Fact = Stored | Removed
Received = Store | Promote | Demote | Copy  # a command that brings a block into a tier


class Facts:
    def __init__(self, tier: Tier, log: FilteringBoundLogger) -> None:
        self.tier = tier
        self.log = log
        # During an outage every transfer of a batch fails the same way: a line per reason every
        # few seconds, with a count; `failed` per tier counts every one (metrics).
        self.quiet = LogThrottle(log)
        self._facts: list[Fact] = []

    def report(self, rt: PoolRuntime, fact: Fact | None, t0: float) -> None:
        """Queue a command's outcome for the batch's publish; time it when it stored a block."""
        if isinstance(fact, Stored):
            rt.counters.tiers[self.tier.label].timed(time.perf_counter() - t0)
        if fact is not None:
            self._facts.append(fact)

    def add(self, fact: Fact) -> None:
        """A fact besides the command's own (an eviction to make room for it)."""
        self._facts.append(fact)

    def take(self) -> list[Fact]:
        facts, self._facts = self._facts, []
        return facts

    def stored(self, rt: PoolRuntime, ev: Received, slot: int) -> Stored:
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
        return Stored(rt.name, ev.key, ev.parent, self.tier, slot, Cause(ev.TYPE))

    def failed(self, rt: PoolRuntime, ev: Received, why: Failure, detail: str, dropped: bool = False) -> Removed:
        """Count a store or transfer into this tier that did not complete (`dropped`: a client's
        put is lost with it) and make its fact."""
        rt.counters.tiers[self.tier.label].failed += 1
        if dropped:
            rt.counters.puts_dropped += 1
        line = {"pool": rt.name, "op": ev.TYPE, "key": ev.key.hex()[:16], "why": why.value, "detail": detail}
        self.log.debug("tier.transfer_failed", **line)  # every one, at debug
        self.quiet.warning("tier.transfer_failed", per=(rt.name, ev.TYPE, why), **line)
        return Removed(rt.name, ev.key, self.tier, Cause(ev.TYPE), why)
