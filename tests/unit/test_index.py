"""The pure per-tier index (kvtier/core/index.py): slots, LRU order, pins and prefix links."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvtier.core.index import State, TierIndex


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def filled(capacity: int | None, chain: list[int], parent_of_first: int | None = None) -> TierIndex:
    """An index holding a chain k(chain[0]) <- k(chain[1]) <- ..., all READY, oldest first."""
    idx = TierIndex(capacity)
    parent = None if parent_of_first is None else k(parent_of_first)
    for i in chain:
        assert idx.add(k(i), parent) is not None
        parent = k(i)
    return idx


def snapshot(idx: TierIndex) -> tuple:
    entries = {key: (e.parent, e.slot, e.state, e.pins, e.hits, e.leaving) for key, e in idx._entries.items()}
    return entries, list(idx._lru), dict(idx._kids), sorted(idx._free), idx.leaving


# --- basic transitions ---------------------------------------------------------------------------


def test_reserve_is_pending_and_invisible_until_commit() -> None:
    idx = TierIndex(4)
    e = idx.reserve(k(1), None)
    assert e is not None and e.state is State.PENDING and e.slot == 0
    assert k(1) not in idx and idx.get(k(1)) is e
    assert idx.used == 1 and idx.free == 3 and len(idx) == 1
    assert list(idx.candidates()) == [] and list(idx.ready()) == []
    assert idx.commit(k(1)) is e and e.state is State.READY
    assert k(1) in idx and list(idx.candidates()) == [k(1)]
    assert idx.commit(k(1)) is e  # idempotent
    assert idx.commit(k(9)) is None


def test_reserve_twice_and_explicit_slots() -> None:
    idx = TierIndex(4)
    assert idx.reserve(k(1), None, slot=2).slot == 2
    assert idx.reserve(k(1), None) is None  # already present
    assert idx.reserve(k(2), None, slot=2) is None  # slot taken
    assert idx.reserve(k(3), None, slot=4) is None  # slot out of range
    assert sorted(e.slot for e in (idx.reserve(k(i), None) for i in (4, 5, 6))) == [0, 1, 3]
    assert idx.free == 0


def test_remove_frees_slot_and_returns_entry() -> None:
    idx = filled(3, [1, 2])
    pending = idx.reserve(k(3), k(2))
    assert idx.remove(k(3)) is pending
    assert idx.remove(k(3)) is None
    assert idx.remove(k(2)).slot == 1
    assert idx.used == 1 and idx.free == 2 and k(2) not in idx
    assert idx.children(k(1)) == 0


def test_capacity_exhaustion_returns_none_and_changes_nothing() -> None:
    idx = filled(3, [1, 2, 3])
    idx.touch(k(1))
    before = snapshot(idx)
    assert idx.reserve(k(4), k(3)) is None
    assert idx.add(k(5), None) is None
    assert snapshot(idx) == before and idx.free == 0 and idx.used == 3


def test_slots_are_recycled() -> None:
    idx = TierIndex(2)
    a, b = idx.add(k(1), None), idx.add(k(2), None)
    assert {a.slot, b.slot} == {0, 1}
    idx.remove(k(1))
    assert idx.add(k(3), None).slot == a.slot
    idx.remove(k(2))
    idx.remove(k(3))
    assert {idx.add(k(i), None).slot for i in (4, 5)} == {0, 1}


def test_unbounded_index() -> None:
    idx = TierIndex(None)
    for i in range(1000):
        e = idx.add(k(i), None if i == 0 else k(i - 1))
        assert e is not None and e.slot == -1
    assert idx.used == 1000 and idx.free >= 2**62
    assert list(idx.candidates()) == [k(999)]  # only the chain's tail
    assert idx.reserve(k(5), None) is None


def test_touch_moves_to_mru_and_counts_hits_only_when_ready() -> None:
    idx = TierIndex(None)
    for i in (1, 2, 3):
        idx.add(k(i), None)
    assert list(idx.candidates()) == [k(1), k(2), k(3)]
    idx.touch(k(1))
    idx.touch(k(2))
    idx.touch(k(1))
    assert list(idx.candidates()) == [k(3), k(2), k(1)]
    assert idx.get(k(1)).hits == 2 and idx.get(k(3)).hits == 0
    pending = idx.reserve(k(4), None)
    assert idx.touch(k(4)) is pending and pending.hits == 0
    assert idx.touch(k(99)) is None


# --- candidates: pins and prefix links ------------------------------------------------------------


def test_pinned_entries_are_never_candidates() -> None:
    idx = TierIndex(4)
    for i in (1, 2):
        idx.add(k(i), None)
    assert idx.pin(k(1)) and idx.pin(k(1))
    assert not idx.pin(k(9))
    assert list(idx.candidates()) == [k(2)]
    idx.unpin(k(1))
    assert list(idx.candidates()) == [k(2)]
    idx.unpin(k(1))
    assert list(idx.candidates()) == [k(1), k(2)]
    idx.unpin(k(1))  # never below zero
    assert idx.get(k(1)).pins == 0


def test_chain_tail_leaves_first() -> None:
    idx = filled(8, [1, 2, 3, 4])
    assert list(idx.candidates()) == [k(4)]
    assert [idx.children(k(i)) for i in (1, 2, 3, 4)] == [1, 1, 1, 0]
    order = []
    while (c := next(idx.candidates(), None)) is not None:
        order.append(c)
        idx.remove(c)
    assert order == [k(4), k(3), k(2), k(1)]


def test_parent_added_after_child_is_protected() -> None:
    idx = TierIndex(4)
    idx.add(k(2), k(1))  # the child arrives first
    assert idx.children(k(1)) == 1
    idx.add(k(1), None)
    assert list(idx.candidates()) == [k(2)]
    idx.remove(k(2))
    assert list(idx.candidates()) == [k(1)]


def test_pending_child_does_not_protect_parent() -> None:
    idx = filled(4, [1])
    idx.reserve(k(2), k(1))
    assert list(idx.candidates()) == [k(1)]
    idx.commit(k(2))
    assert list(idx.candidates()) == [k(2)]


def test_mark_leaving_and_clear_leaving() -> None:
    idx = filled(4, [1, 2])
    idx.add(k(3), None)
    assert idx.mark_leaving(k(3)) and idx.leaving == 1
    assert not idx.mark_leaving(k(3)) and idx.leaving == 1
    assert not idx.mark_leaving(k(9))
    e = idx.get(k(3))
    assert e.leaving and e.pins == 1 and k(3) in idx  # still readable
    assert list(idx.candidates()) == [k(2)]
    idx.clear_leaving(k(3))
    assert not e.leaving and e.pins == 0 and idx.leaving == 0
    idx.clear_leaving(k(3))  # no-op when not leaving
    assert idx.leaving == 0 and e.pins == 0
    assert list(idx.candidates()) == [k(2), k(3)]
    idx.mark_leaving(k(2))
    idx.mark_leaving(k(3))
    assert idx.leaving == 2
    idx.remove(k(2))
    assert idx.leaving == 1
    assert list(idx.candidates()) == [k(1)]


# --- stateful: the index against a dict model ------------------------------------------------------

CAPACITY = 6


class IndexMachine(RuleBasedStateMachine):
    keys = Bundle("keys")

    @initialize()
    def setup(self) -> None:
        self.idx = TierIndex(CAPACITY)
        self.model: dict[bytes, dict] = {}  # key -> {"parent", "pins", "ready", "leaving"}
        self.lru: list[bytes] = []  # READY keys, coldest first
        self.counter = 0
        self.granted: set[int] = set()  # slots handed to clients ahead of their puts, under no key

    @rule(target=keys, parent=st.none() | st.integers(900, 903), commit=st.booleans())
    def reserve(self, parent: int | None, commit: bool) -> bytes:
        """A chain head, or a child of a parent that is not here (yet)."""
        return self._reserve(None if parent is None else k(parent), commit)

    @rule(target=keys, parent=keys, commit=st.booleans())
    def reserve_child(self, parent: bytes, commit: bool) -> bytes:
        return self._reserve(parent, commit)

    def _reserve(self, p: bytes | None, commit: bool) -> bytes:
        self.counter += 1
        key = k(self.counter)
        e = self.idx.reserve(key, p)
        if len(self.model) + len(self.granted) >= CAPACITY:
            assert e is None
            return key
        assert e is not None and e.state is State.PENDING
        self.model[key] = {"parent": p, "pins": 0, "ready": False, "leaving": False}
        if commit:
            self.commit(key)
        return key

    @rule(n=st.integers(0, 3))
    def grant(self, n: int) -> None:
        got = self.idx.grant(n)
        assert len(got) == min(n, CAPACITY - len(self.model) - len(self.granted))
        assert not set(got) & self.granted
        self.granted.update(got)

    @rule(data=st.data(), parent=st.none() | st.integers(900, 903), commit=st.booleans())
    def claim(self, data: st.DataObject, parent: int | None, commit: bool) -> None:
        """A client's put lands in a granted slot (or names one that is not granted: refused)."""
        slot = data.draw(st.sampled_from(sorted(self.granted)) if self.granted and data.draw(st.booleans())
                         else st.integers(0, CAPACITY - 1))
        self.counter += 1
        key = k(self.counter)
        e = self.idx.claim(slot, key, None if parent is None else k(parent))
        if slot not in self.granted:
            assert e is None
            return
        assert e is not None and e.slot == slot and e.state is State.PENDING
        self.granted.discard(slot)
        self.model[key] = {"parent": None if parent is None else k(parent), "pins": 0, "ready": False,
                           "leaving": False}
        if commit:
            self.commit(key)

    @rule(data=st.data())
    def ungrant(self, data: st.DataObject) -> None:
        slot = data.draw(st.integers(0, CAPACITY - 1))
        assert self.idx.ungrant(slot) == (slot in self.granted)
        self.granted.discard(slot)

    @rule(key=keys)
    def commit(self, key: bytes) -> None:
        e = self.idx.commit(key)
        m = self.model.get(key)
        if m is None:
            assert e is None
            return
        if not m["ready"]:
            m["ready"] = True
            self.lru.append(key)
        assert e.state is State.READY

    @rule(key=consumes(keys))
    def remove(self, key: bytes) -> None:
        e = self.idx.remove(key)
        m = self.model.pop(key, None)
        assert (e is None) == (m is None)
        if m and m["ready"]:
            self.lru.remove(key)

    @rule(key=keys)
    def touch(self, key: bytes) -> None:
        self.idx.touch(key)
        if key in self.lru:
            self.lru.remove(key)
            self.lru.append(key)

    @rule(key=keys)
    def pin(self, key: bytes) -> None:
        assert self.idx.pin(key) == (key in self.model)
        if key in self.model:
            self.model[key]["pins"] += 1

    @rule(key=keys)
    def unpin(self, key: bytes) -> None:
        """Readers unpin only what they pinned (a leaving pin is not theirs to drop)."""
        m = self.model.get(key)
        if m is None or m["pins"] - m["leaving"] > 0:
            self.idx.unpin(key)
            if m is not None:
                m["pins"] -= 1

    @rule(key=keys)
    def mark_leaving(self, key: bytes) -> None:
        m = self.model.get(key)
        assert self.idx.mark_leaving(key) == (m is not None and not m["leaving"])
        if m is not None and not m["leaving"]:
            m["leaving"] = True
            m["pins"] += 1

    @rule(key=keys)
    def clear_leaving(self, key: bytes) -> None:
        self.idx.clear_leaving(key)
        m = self.model.get(key)
        if m is not None and m["leaving"]:
            m["leaving"] = False
            m["pins"] -= 1

    @invariant()
    def matches_model(self) -> None:
        idx = self.idx
        assert idx.used == len(self.model) and idx.granted == len(self.granted)
        assert idx.free + idx.used + idx.granted == CAPACITY
        slots = [idx.get(key).slot for key in self.model]
        assert len(set(slots)) == len(slots) and all(0 <= s < CAPACITY for s in slots)
        assert not set(slots) & set(idx._free) and not set(slots) & self.granted  # a slot has one owner
        assert not self.granted & set(idx._free)
        assert [e.key for e in idx.ready()] == self.lru
        # The slot walk (core/resync.py's sweep) lists exactly the READY entries, by slot, from a
        # map of every entry's slot, PENDING ones included.
        assert idx.ready_in_slots(0, CAPACITY) == sorted((idx.get(key).slot, key) for key in self.lru)
        assert {s: key for s, key in enumerate(idx._by_slot) if key is not None} == \
            {idx.get(key).slot: key for key in self.model}
        for key, m in self.model.items():
            e = idx.get(key)
            assert e.pins == m["pins"] >= 0 and e.leaving == m["leaving"]
            assert (e.state is State.READY) == m["ready"] and (key in idx) == m["ready"]
        assert idx.leaving == sum(m["leaving"] for m in self.model.values())
        kids = Counter(m["parent"] for m in self.model.values() if m["ready"] and m["parent"] is not None)
        for key in set(kids) | set(self.model) | {k(i) for i in range(900, 904)}:
            assert idx.children(key) == kids[key]
        with_kids = set(kids)
        expected = [key for key in self.lru if self.model[key]["pins"] == 0 and key not in with_kids]
        assert list(idx.candidates()) == expected
        for key in idx.candidates():
            e = idx.get(key)
            assert e.state is State.READY and e.pins == 0 and idx.children(key) == 0


IndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestIndexMachine = IndexMachine.TestCase


@pytest.mark.parametrize("capacity", [0, 1])
def test_tiny_capacities(capacity: int) -> None:
    idx = TierIndex(capacity)
    assert idx.free == capacity
    assert (idx.add(k(1), None) is None) == (capacity == 0)
    assert idx.add(k(2), None) is None
