"""Session pins: blocks a caller keeps on the node for a while, e.g. an agent's prefix between two
tool calls. Pure: no I/O; time is passed in.

- A pin names a chain (head first), a time to live and a tenant (the budget it is charged to).
  It holds until it expires; pinning a pinned block again extends it (never shortens it), and a
  time to live of 0 lets the caller's own pins go at once. A time to live above `max_ttl_s` is
  cut to it.
- A pinned block never leaves the node: shedding and the make-room rule pass it over (it may
  still move down between node tiers, gpu to cpu or disk), and a move off the node decided before
  the pin is called off (core/shedding.py, core/room.py, core/eviction.py). Its Redis copy, where
  there is one, lives at least as long as the pin (`Placement.on_pin` sends a `Retain`).
- Budgets: each tenant may pin `budget_bytes` (a named tenant: its own figure), and all pins
  together at most `node_share` of the node's local slots, so pins cannot freeze a tier. A block
  is charged once, to the tenant that pinned it first; another tenant's pin of it extends it for
  free. Blocks are pinned head first and the first that does not fit ends the pin: a tail
  without its head is of no use. What was refused is counted and returned, never dropped unseen.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.keys import BlockKey


@dataclass(frozen=True, slots=True)
class PinRules:
    budget_bytes: int = 1 << 30  # per tenant not named in `budgets`; 0 = such tenants may not pin
    budgets: Mapping[str, int] = field(default_factory=dict)  # tenant -> its own budget in bytes
    max_ttl_s: int = 3600
    node_share: float = 0.5  # of the node's local slots (gpu + cpu + disk)

    def budget(self, tenant: str) -> int:
        return self.budgets.get(tenant, self.budget_bytes)


@dataclass(frozen=True, slots=True)
class PinVerdict:
    pinned: tuple[BlockKey, ...]  # pinned now (new or extended), head first
    ttl_s: int  # the time to live they got (after the cut to max_ttl_s)
    refused: int  # blocks not pinned
    reason: str = ""  # why: "budget" (the tenant's) or "node" (node_share); "" when none was refused


@dataclass(slots=True)
class PinCounts:
    pinned: int = 0  # blocks newly pinned
    extended: int = 0  # blocks pinned again before they expired
    refused_budget: int = 0
    refused_node: int = 0
    released: int = 0  # let go early (time to live 0)
    expired: int = 0


@dataclass(slots=True)
class _Pin:
    until: float
    tenant: str  # charged to


class Pins:
    """The pins of one pool. `node_slots()` is the node's local slots now (they come into
    service over time)."""

    def __init__(self, rules: PinRules, block_bytes: int, node_slots: Callable[[], int]) -> None:
        self.rules = rules
        self.block_bytes = block_bytes
        self._node_slots = node_slots
        self._pins: dict[BlockKey, _Pin] = {}
        self._held: dict[str, int] = {}  # tenant -> blocks charged to it
        self._heap: list[tuple[float, BlockKey]] = []  # (until, key), stale entries skipped
        self.counts = PinCounts()

    def __contains__(self, key: object) -> bool:
        return key in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def until(self, key: BlockKey) -> float | None:
        p = self._pins.get(key)
        return None if p is None else p.until

    def held(self) -> dict[str, int]:
        """Blocks charged to each tenant that holds any."""
        return dict(self._held)

    def pin(self, keys: Sequence[BlockKey], tenant: str, ttl_s: int, now: float) -> PinVerdict:
        if ttl_s <= 0:
            self.release(keys, tenant)
            return PinVerdict((), 0, 0)
        ttl = min(ttl_s, self.rules.max_ttl_s)
        until = now + ttl
        budget = self.rules.budget(tenant) // self.block_bytes  # in blocks
        cap = math.floor(self.rules.node_share * self._node_slots())
        done: list[BlockKey] = []
        reason = ""
        for key in keys:
            p = self._pins.get(key)
            if p is not None:
                if until > p.until:
                    p.until = until
                    heapq.heappush(self._heap, (until, key))
                self.counts.extended += 1
            elif self._held.get(tenant, 0) >= budget:
                reason = "budget"
            elif len(self._pins) >= cap:
                reason = "node"
            else:
                self._pins[key] = _Pin(until, tenant)
                self._held[tenant] = self._held.get(tenant, 0) + 1
                heapq.heappush(self._heap, (until, key))
                self.counts.pinned += 1
            if reason:
                break
            done.append(key)
        refused = len(keys) - len(done)
        if reason == "budget":
            self.counts.refused_budget += refused
        elif reason == "node":
            self.counts.refused_node += refused
        return PinVerdict(tuple(done), ttl, refused, reason)

    def release(self, keys: Sequence[BlockKey], tenant: str) -> int:
        """Let go of `tenant`'s pins of `keys` now (another tenant's stay). Returns how many."""
        n = 0
        for key in keys:
            p = self._pins.get(key)
            if p is not None and p.tenant == tenant:
                self._drop(key, p)
                n += 1
        self.counts.released += n
        return n

    def expire(self, now: float) -> list[BlockKey]:
        """Let go of the pins whose time is up; returns their keys."""
        gone: list[BlockKey] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, key = heapq.heappop(heap)
            p = self._pins.get(key)
            if p is not None and p.until == until:  # else extended (a later entry stands) or let go
                self._drop(key, p)
                gone.append(key)
        self.counts.expired += len(gone)
        if len(heap) > 2 * len(self._pins) + 64:  # many extensions: drop the stale entries
            self._heap = [(p.until, k) for k, p in self._pins.items()]
            heapq.heapify(self._heap)
        return gone

    def _drop(self, key: BlockKey, p: _Pin) -> None:
        del self._pins[key]
        n = self._held[p.tenant] - 1
        if n:
            self._held[p.tenant] = n
        else:
            del self._held[p.tenant]
