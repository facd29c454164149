"""A tier worker's facts as few events as they can be: each run of blocks stored in one place for
one cause as one StoredBatch, so that a put of 64 blocks costs one fact on the wire, not 64."""

from __future__ import annotations

from itertools import groupby

from kvtier.core.events import Removed, Stored, StoredBatch
from kvtier.keys import BlockKey

MAX_RUN = 4096  # facts in one StoredBatch: about 300 KB on the wire, well inside an entry's 4 MiB


def batched(facts: list[Stored | StoredBatch | Removed]) -> list[Stored | StoredBatch | Removed]:
    """The facts with each run of consecutive `Stored` and `StoredBatch` of one pool, tier and
    cause as one StoredBatch (of at most MAX_RUN; a run of one block as a `Stored`); the order of
    everything else kept."""
    out: list[Stored | StoredBatch | Removed] = []
    for key, group in groupby(facts, lambda f: None if isinstance(f, Removed) else (f.pool, f.tier, f.cause)):
        if key is None:  # removed facts, each as it is
            out.extend(group)
            continue
        keys: list[BlockKey] = []
        parents: list[BlockKey | None] = []
        slots: list[int] = []
        for f in group:
            if isinstance(f, Stored):
                keys.append(f.key)
                parents.append(f.parent)
                slots.append(f.slot)
            elif isinstance(f, StoredBatch):  # reported whole (a put's adopted blocks: kvtier/tiers/facts.py)
                keys.extend(f.keys)
                parents.extend(f.parents)
                slots.extend(f.slots)
        pool, tier, cause = key
        for i in range(0, len(keys), MAX_RUN):
            j = i + MAX_RUN
            out.append(Stored(pool, keys[i], parents[i], tier, slots[i], cause) if len(keys) - i == 1 else
                       StoredBatch(pool, tier, cause, tuple(keys[i:j]), tuple(parents[i:j]), tuple(slots[i:j])))
    return out
