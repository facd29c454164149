"""Tenants and fair share of the node's tiers. Pure: no I/O, no clock.

A tenant is a name a put carries ("" for the default tenant): what the engine's key already
separates (a cache salt, a LoRA), named by the integration or the caller, and optionally renamed
by the operator (`aliases`, in `[tenants]`). Each block on the node belongs to the tenant that
put it first.

Per node tier, a tenant's **share** of the slots is its weight over the summed weights of the
tenants holding blocks there (and its own). While any tenant is over its share in a tier, that
tier's evictions come only from tenants over theirs, each by the tier's existing prefix-aware
order and no further than its excess; so a tenant below its share is never evicted to make room
for one above it. With nobody over, the tier sheds by plain LRU. An optional **cap** (blocks per
node tier, from `cap_bytes`) bounds a tenant outright: its puts beyond the cap go to the next
tier instead.

`Residency` (core/residency.py) keeps a `TenantUsage` up to date as the tier workers report, and
the shedding and make-room rules (core/shedding.py, core/room.py) ask it whom they may take from.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from kvtier.core.events import Tier
from kvtier.keys import BlockKey

# Tenants whose hits and evictions are counted by name; any more add up under "other" (a salt per
# user would otherwise grow the counters without bound).
COUNTED = 1024


@dataclass(frozen=True, slots=True)
class TenantRules:
    """The operator's word on tenants: weights (default `default_weight`), caps in blocks per node
    tier, and aliases (a tenant name a client sends -> the name it is known by here)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    caps: Mapping[str, int] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default_weight <= 0 or any(w <= 0 for w in self.weights.values()):
            raise ValueError("tenant weights must be positive")
        if any(c < 0 for c in self.caps.values()):
            raise ValueError("tenant caps must be >= 0")

    def name(self, tenant: str) -> str:
        return self.aliases.get(tenant, tenant)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)


class TenantUsage:
    """Each node block's tenant, blocks per tenant in each node tier, and hits and evictions per
    tenant since the start. Bounded by what is on the node (and in flight to it): a tenant
    holding nothing is forgotten, counters aside (`counters`)."""

    def __init__(self, rules: TenantRules | None = None) -> None:
        self.rules = rules or TenantRules()
        self._owner: dict[BlockKey, str] = {}  # non-default tenants only
        self.blocks: dict[Tier, Counter[str]] = {}
        self.hits: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: BlockKey) -> str:
        return self._owner.get(key, "")

    def claim(self, key: BlockKey, tenant: str) -> None:
        """A put of `key` by `tenant` was placed on the node: it is theirs unless someone's already."""
        if tenant and key not in self._owner:
            self._owner[key] = tenant

    def forget(self, key: BlockKey) -> None:
        """`key` is on the node no more (and not on its way): its next put may be someone else's."""
        self._owner.pop(key, None)

    def added(self, t: Tier, key: BlockKey) -> None:
        self.added_many(t, (key,))

    def added_many(self, t: Tier, keys: Iterable[BlockKey]) -> None:
        """`added` for a batch of keys (Counter.update counts them in C)."""
        counts = self.blocks.get(t)
        if counts is None:  # (not setdefault: it would build a Counter on every call)
            counts = self.blocks[t] = Counter()
        owner = self._owner.get
        counts.update([owner(k, "") for k in keys])

    def removed(self, t: Tier, key: BlockKey, evicted: bool) -> None:
        counts = self.blocks.get(t)
        who = self.owner(key)
        if counts is None or counts[who] <= 0:
            return
        counts[who] -= 1
        if not counts[who]:
            del counts[who]
        if evicted:
            self._count(self.evicted, who)

    def hit(self, key: BlockKey) -> None:
        self._count(self.hits, self.owner(key))

    def hit_many(self, keys: Iterable[BlockKey]) -> None:
        """`hit` for each of `keys`: the owners tallied in C first (a get of thousands of blocks
        is one report), then counted as `hit` counts them, each owner as of its first key."""
        owner = self._owner.get
        for who, n in Counter(owner(k, "") for k in keys).items():
            self._count(self.hits, who, n)

    @staticmethod
    def _count(counter: Counter[str], who: str, n: int = 1) -> None:
        counter[who if who in counter or len(counter) < COUNTED else "other"] += n

    def share(self, t: Tier, tenant: str, capacity: int) -> float:
        """`tenant`'s fair share of tier `t`'s `capacity` slots, in blocks."""
        active = set(self.blocks.get(t, ())) | {tenant}
        return capacity * self.rules.weight(tenant) / sum(self.rules.weight(a) for a in active)

    def excess(self, t: Tier, capacity: int) -> dict[str, int]:
        """Tenants over their share of `t` (or over their cap), with how many blocks over."""
        counts = self.blocks.get(t, Counter())
        total = sum(self.rules.weight(a) for a in counts)
        out = {}
        for who, n in counts.items():
            cap = self.rules.caps.get(who)
            over = max(n - capacity * self.rules.weight(who) / total, n - cap if cap is not None else 0)
            if over > 0:
                out[who] = math.ceil(over)  # a part block over counts as one
        return out

    def allowance(self, t: Tier, tenant: str) -> int | None:
        """How many more blocks `tenant` may put in `t` under its cap (None: no cap)."""
        cap = self.rules.caps.get(tenant)
        return None if cap is None else max(0, cap - self.blocks.get(t, Counter())[tenant])

    def evictable(self, t: Tier, capacity: int) -> set[str] | None:
        """Whose blocks `t` may drop to make room now: the tenants over their share, or None
        (anyone's) when nobody is."""
        over = self.excess(t, capacity)
        return set(over) if over else None

    def shed_order(self, t: Tier, candidates: Iterable[BlockKey], capacity: int,
                   leaving: Iterable[BlockKey] = ()) -> Iterator[BlockKey]:
        """`candidates` (coldest first) in the order `t` may shed them: while any tenant is over
        its share, only theirs, each up to its excess less its blocks already `leaving` `t` (still
        counted until they go); with nobody over, all of them."""
        over = self.excess(t, capacity)
        if not over:
            yield from candidates
            return
        for key in leaving:
            if (who := self.owner(key)) in over:
                over[who] -= 1
        for key in candidates:
            who = self.owner(key)
            if over.get(who, 0) > 0:
                over[who] -= 1
                yield key

    def counters(self, block_bytes: int) -> dict[str, dict[str, int]]:
        """Per tenant: bytes in each node tier, hits and evictions (every tenant seen)."""
        out: dict[str, dict[str, int]] = {}
        for t, counts in self.blocks.items():
            for who, n in counts.items():
                out.setdefault(who, {})[f"{t.label}_bytes"] = n * block_bytes
        for name, counter in (("hits", self.hits), ("evicted", self.evicted)):
            for who, n in counter.items():
                out.setdefault(who, {})[name] = n
        return out
