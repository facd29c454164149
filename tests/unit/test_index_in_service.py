"""Slots coming into service (kvtier/core/index.py): a big arena's index hands out only the slots
whose pages are populated, and a warm restart's restores keep the count right."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.index import TierIndex


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_only_slots_in_service_are_handed_out_lowest_first():
    idx = TierIndex(10, in_service=range(3))
    assert (idx.slots, idx.capacity, idx.free) == (10, 3, 3) and not idx.fully_in_service
    assert [idx.reserve(k(i), None).slot for i in range(3)] == [0, 1, 2]
    assert idx.reserve(k(3), None) is None, "no slot in service is free: the index is full for now"
    assert idx.bring_into_service(range(3, 6)) == 3
    assert idx.capacity == 6 and idx.reserve(k(3), None).slot == 3
    assert idx.bring_into_service(range(0, 6)) == 0, "slots already in service are not counted twice"
    assert idx.bring_into_service([6, 7, 8, 9, 10, -1]) == 4, "out-of-range slots are ignored"
    assert idx.fully_in_service and idx.capacity == 10


def test_a_block_restored_before_its_slot_is_in_service_counts_once():
    idx = TierIndex(8, in_service=())
    assert idx.capacity == 0
    e = idx.add(k(1), None, slot=5)  # a warm arena's block, found before its chunk came in
    assert e is not None and e.slot == 5 and idx.capacity == 1 and idx.free == 0
    assert idx.add(k(2), None, slot=5) is None, "a slot holds one block"
    assert idx.bring_into_service(range(4, 8)) == 3  # slot 5 was counted already
    assert idx.capacity == 4 and idx.free == 3
    assert 5 not in {idx.reserve(k(10 + i), None).slot for i in range(3)}


def test_an_early_slot_freed_before_its_chunk_waits_for_it():
    idx = TierIndex(8, in_service=range(2))
    idx.add(k(1), None, slot=6)
    assert idx.capacity == 3
    idx.remove(k(1))
    assert idx.capacity == 2 and idx.free == 2, "slot 6 is not populated: it must not be handed out"
    assert {idx.reserve(k(i), None).slot for i in (2, 3)} == {0, 1}
    assert idx.reserve(k(4), None) is None
    assert idx.bring_into_service([6]) == 1 and idx.reserve(k(4), None).slot == 6


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "restore", "remove", "serve"]), st.integers(0, 15)),
                max_size=60))
def test_in_service_invariants(ops):
    """Whatever the order: a handed-out slot is in service or restored; capacity = slots in
    service + restored early; free slots are in service and unused."""
    n = 16
    idx = TierIndex(n, in_service=range(4))
    served = set(range(4))
    held: dict[bytes, int] = {}
    for op, x in ops:
        if op == "reserve":
            e = idx.reserve(k(100 + x), None)
            if e is not None:
                assert e.slot in served, f"slot {e.slot} handed out before it came into service"
                held[e.key] = e.slot
        elif op == "restore":
            e = idx.add(k(200 + x), None, slot=x)
            if e is not None:
                assert x not in held.values()
                held[e.key] = x
        elif op == "remove" and held:
            key = sorted(held)[x % len(held)]
            idx.remove(key)
            del held[key]
        elif op == "serve":
            idx.bring_into_service(range(x, min(n, x + 3)))
            served |= set(range(x, min(n, x + 3)))
        early = {s for s in held.values() if s not in served}
        assert idx.capacity == len(served) + len(early)
        assert set(idx._free) == served - set(held.values())
        assert len(set(held.values())) == len(held)


def test_the_slot_walk_follows_restores_early_slots_removes_and_retire():
    """`ready_in_slots` (the resync sweep's walk) on the paths the state machine does not take:
    a warm restart's restores into given slots, some not in service yet, their removal, and a
    tier retired."""
    idx = TierIndex(8, in_service=range(4))
    assert idx.add(k(1), None, slot=2) is not None  # in service
    assert idx.add(k(2), None, slot=6) is not None  # early: its pages hold it before service
    assert idx.reserve(k(3), None, slot=5) is not None  # early, PENDING: not listed
    assert idx.ready_in_slots(0, 8) == [(2, k(1)), (6, k(2))]
    assert idx.ready_in_slots(3, 7) == [(6, k(2))]
    idx.remove(k(2))
    assert idx.ready_in_slots(0, 8) == [(2, k(1))]
    idx.commit(k(3))
    assert idx.ready_in_slots(0, 8) == [(2, k(1)), (5, k(3))]
    assert {e.key for e in idx.retire()} == {k(1), k(3)}
    assert idx.ready_in_slots(0, 8) == []
