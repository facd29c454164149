"""The pure per-tier index: which block sits in which slot, in LRU order, with pins and prefix links.

Synchronous and I/O-free. One TierIndex covers one tier of one pool, and the pool's Placement
(kvtier/core/policy.py) owns it: the tier workers change it only through Placement's methods
(a warm restart fills the fresh cpu index before that Placement exists). "Cannot satisfy" is a
None return that changes nothing.

Prefix awareness: an entry counts its children resident in the same tier. Only entries with no
resident children are eviction candidates, so a chain's tail always leaves before its head (as
in vLLM and SGLang). Pinned entries (being read or transferred) are never candidates.

Slots come into service over time: a big cpu arena is populated in the background, and only a
slot whose pages are populated may be handed out. `slots` is the tier's size, `capacity` what is
in service now (the figure placement decides by); `bring_into_service` adds slots as their pages
arrive. A warm restart may restore a block into a slot not yet in service (its pages hold the
block, so they exist): that slot counts towards `capacity` from then on.

Grants: a slot handed to a client ahead of its put (kvtier/tiers/grants.py), so the client
writes the block into it itself. A granted slot is under no key and not free (not `used` either:
the watermarks count blocks), and is either `claim`ed by the put that fills it (it becomes that
key's PENDING entry) or `ungrant`ed.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Iterator, KeysView
from dataclasses import dataclass

from kvtier.keys import BlockKey


class State(enum.Enum):
    PENDING = "pending"  # slot reserved, bytes in flight; not visible
    READY = "ready"  # visible to readers


@dataclass(slots=True)
class Entry:
    key: BlockKey
    parent: BlockKey | None
    slot: int
    state: State = State.PENDING
    pins: int = 0
    hits: int = 0
    leaving: bool = False  # chosen to leave this tier (demote or evict under way); pinned meanwhile


class TierIndex:
    """Slots, LRU order and prefix links of one tier. `capacity` None means unbounded (Redis).
    `in_service`: the slots usable now (default: all of them)."""

    def __init__(self, capacity: int | None, in_service: Iterable[int] | None = None) -> None:
        self.slots = capacity
        # Free slots in service, as an insertion-ordered set: O(1) to take a given slot (a warm
        # restart restores a million), and popitem() hands out the lowest slot first.
        self._free: dict[int, None] = {}
        self._serving = bytearray(capacity or 0)  # 1 = slot in service
        self._early: set[int] = set()  # restored before their slot came into service
        self._granted: set[int] = set()  # handed to a client ahead of a put, under no key yet
        self.capacity = capacity
        if capacity:
            self.capacity = 0
            self.bring_into_service(range(capacity) if in_service is None else in_service)
        self._entries: dict[BlockKey, Entry] = {}
        # slot -> the key of its entry (PENDING or READY), 8 bytes a slot: lets a sweep walk a
        # stretch of slots (`ready_in_slots`) where a walk of the LRU visits every block (core/resync.py).
        self._by_slot: list[BlockKey | None] = [None] * (capacity or 0)
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # READY entries, coldest first
        # READY children per parent key, whether or not the parent is here yet, so a parent that
        # arrives after its child is still protected.
        self._kids: dict[BlockKey, int] = {}
        self.leaving = 0  # entries marked leaving

    # --- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        e = self._entries.get(key) if isinstance(key, bytes) else None  # type: ignore[call-overload]
        return e is not None and e.state is State.READY

    def get(self, key: BlockKey) -> Entry | None:
        return self._entries.get(key)

    def absent(self, keys: KeysView[BlockKey]) -> int:
        """How many of `keys` this index holds no entry for: it runs on every put, over every
        block in flight (`present`, not a difference, which walks the whole index)."""
        return len(keys) - len(self.present(keys))

    def present(self, keys: KeysView[BlockKey]) -> set[BlockKey]:
        """Which of `keys` this index holds an entry for (in any state): an intersection of the
        two views, which walks the smaller in C, not a call a key."""
        return keys & self._entries.keys()

    @property
    def used(self) -> int:
        return len(self._entries)

    @property
    def granted(self) -> int:
        return len(self._granted)

    @property
    def free(self) -> int:
        return len(self._free) if self.capacity is not None else 1 << 62

    @property
    def fully_in_service(self) -> bool:
        return self.slots is None or self.capacity == self.slots

    def ready(self) -> Iterator[Entry]:
        for key in self._lru:
            yield self._entries[key]

    def ready_in_slots(self, start: int, end: int) -> list[tuple[int, BlockKey]]:
        """(slot, key) of each READY entry in slots [start, end), in slot order: a stretch of a
        sweep over the tier, its cost that of the stretch, not of the tier."""
        entries, ready = self._entries, State.READY
        return [(s, k) for s, k in enumerate(self._by_slot[start:end], start)
                if k is not None and entries[k].state is ready]

    def candidates(self) -> Iterator[BlockKey]:
        """Eviction candidates, coldest first: READY, unpinned, no resident children."""
        for key in self._lru:
            e = self._entries[key]
            if e.pins == 0 and not self._kids.get(key):
                yield key

    def children(self, key: BlockKey) -> int:
        return self._kids.get(key, 0)

    # --- transitions ---------------------------------------------------------------------------

    def reserve(self, key: BlockKey, parent: BlockKey | None, slot: int | None = None) -> Entry | None:
        """Take a free slot (or the given one) for `key`, PENDING. None if present or full."""
        if key in self._entries:
            return None
        if self.capacity is None:
            slot = -1
        elif slot is None:
            if not self._free:
                return None
            slot = self._free.popitem()[0]
        elif slot in self._free:
            del self._free[slot]
        elif 0 <= slot < len(self._serving) and not self._serving[slot] and slot not in self._early:
            self._early.add(slot)  # restored ahead of its slot's population: it counts from now
            assert self.capacity is not None
            self.capacity += 1
        else:
            return None  # taken, or no such slot
        e = Entry(key=key, parent=parent, slot=slot)
        self._entries[key] = e
        if slot >= 0:
            self._by_slot[slot] = key
        return e

    def grant(self, n: int) -> list[int]:
        """Up to `n` free slots, taken out of the free set under no key (never by evicting)."""
        if self.capacity is None:
            return []
        out: list[int] = []
        while self._free and len(out) < n:
            out.append(self._free.popitem()[0])
        self._granted.update(out)
        return out

    def claim(self, slot: int, key: BlockKey, parent: BlockKey | None) -> Entry | None:
        """The granted `slot` holds `key` now: its PENDING entry. None (nothing changes) if the
        slot is not granted or `key` is here already."""
        return self.claim_many(((slot, key, parent),))[0]

    def claim_many(self, claims: Iterable[tuple[int, BlockKey, BlockKey | None]]) -> list[Entry | None]:
        """`claim` for each (slot, key, parent) of a batch, in order: one call, not one a block."""
        granted, entries, by_slot = self._granted, self._entries, self._by_slot
        out: list[Entry | None] = []
        for slot, key, parent in claims:
            if slot not in granted or key in entries:
                out.append(None)
                continue
            granted.discard(slot)
            e = entries[key] = Entry(key, parent, slot)
            by_slot[slot] = key
            out.append(e)
        return out

    def ungrant(self, slot: int) -> bool:
        """A granted slot comes back unused: free again. False if it was not granted."""
        if slot not in self._granted:
            return False
        self._granted.discard(slot)
        if self._serving[slot]:
            self._free[slot] = None
        return True

    def commit(self, key: BlockKey) -> Entry | None:
        """PENDING -> READY: visible, most recently used, counted as its parent's child."""
        e = self._entries.get(key)
        if e is not None:
            self.commit_many((e,))
        return e

    def commit_many(self, entries: Iterable[Entry]) -> None:
        """`commit` for this index's entries of a batch just filled, in order (one call, not one a
        block: a put of small blocks adopts thousands a second)."""
        lru, kids, ready = self._lru, self._kids, State.READY
        for e in entries:
            if e.state is not ready:
                e.state = ready
                lru[e.key] = None
                if e.parent is not None:
                    kids[e.parent] = kids.get(e.parent, 0) + 1

    def add(self, key: BlockKey, parent: BlockKey | None, slot: int | None = None) -> Entry | None:
        """reserve + commit in one step (used when rebuilding from slot headers)."""
        e = self.reserve(key, parent, slot)
        return None if e is None else self.commit(key)

    def remove(self, key: BlockKey) -> Entry | None:
        """Forget `key` and free its slot. Returns the removed entry, or None if absent."""
        e = self._entries.pop(key, None)
        if e is None:
            return None
        if e.leaving:
            self.leaving -= 1
        if e.state is State.READY:
            del self._lru[key]
            if e.parent is not None:
                n = self._kids[e.parent] - 1
                if n:
                    self._kids[e.parent] = n
                else:
                    del self._kids[e.parent]
        if self.capacity is not None:
            self._by_slot[e.slot] = None
            if self._serving[e.slot]:
                self._free[e.slot] = None
            else:  # an early slot goes back to waiting for its population
                self._early.discard(e.slot)
                self.capacity -= 1
        return e

    def bring_into_service(self, slots: Iterable[int]) -> int:
        """Their pages are populated: the slots may be handed out. Slots already in service, or
        out of range, are ignored. Returns how many came into service."""
        if self.capacity is None:
            return 0
        serving, early, new = self._serving, self._early, []
        n = len(serving)
        for s in slots:
            if 0 <= s < n and not serving[s]:
                serving[s] = 1
                if s in early:
                    early.discard(s)  # counted already, and taken
                else:
                    new.append(s)
        # Reversed, so that popitem() hands out the lowest of them first.
        self._free.update(dict.fromkeys(reversed(new)))
        self.capacity += len(new)
        return len(new)

    def retire(self) -> list[Entry]:
        """Take the whole tier out of service for good (its device failed): every entry is
        forgotten and returned, and no slot is handed out again, nor brought back into service."""
        gone = list(self._entries.values())
        self._entries.clear()
        self._lru.clear()
        self._kids.clear()
        self._free.clear()
        self._early.clear()
        self._granted.clear()
        self._serving = bytearray()
        self._by_slot = []
        self.slots = self.capacity = 0
        self.leaving = 0
        return gone

    def touch(self, key: BlockKey) -> Entry | None:
        e = self._entries.get(key)
        if e is not None and e.state is State.READY:
            self._lru.move_to_end(key)
            e.hits += 1
        return e

    def pin(self, key: BlockKey) -> bool:
        e = self._entries.get(key)
        if e is None:
            return False
        e.pins += 1
        return True

    def unpin(self, key: BlockKey) -> None:
        e = self._entries.get(key)
        if e is not None and e.pins > 0:
            e.pins -= 1

    def mark_leaving(self, key: BlockKey) -> bool:
        """Chosen for demotion or eviction: pinned (still readable) and not chosen again."""
        e = self._entries.get(key)
        if e is None or e.leaving:
            return False
        e.leaving = True
        e.pins += 1
        self.leaving += 1
        return True

    def clear_leaving(self, key: BlockKey) -> None:
        """The move failed or was refused: the block stays and may be chosen again later."""
        e = self._entries.get(key)
        if e is not None and e.leaving:
            e.leaving = False
            e.pins = max(0, e.pins - 1)
            self.leaving -= 1
