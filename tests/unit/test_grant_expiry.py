"""When the daemon takes a grant back (kvtier/tiers/grants.py): a real pool opened in-process (the
daemon's own open_pool), a real client staging segment and its ring, the clock passed in.

A grant still in the ring is never expired (the client may take it whenever it next puts); one
the client took is expired GRANT_EXPIRE_S after the daemon first saw it taken, which is after the
client's own use-by (GRANT_USE_S after it took it); a client that goes is forgotten whole.
"""

from __future__ import annotations

import asyncio

from kvtier.core.events import Tier
from kvtier.shm.grant_ring import GRANT_EXPIRE_S, GRANT_USE_S, RING
from kvtier.shm.slots import Flags
from kvtier.tiers.grants import GrantBook
from tests.support.grant_pool import grant_pool, no_room


def test_grants_expire_only_once_taken_and_after_the_clients_use_by() -> None:
    assert GRANT_EXPIRE_S > GRANT_USE_S + 10  # room for a write that started at the use-by
    with grant_pool("test-exp") as (rt, staging, w, log):
        idx = rt.placement.tiers[Tier.CPU]
        book = GrantBook({"s": rt}, staging, 4, log)
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(no_room)) == 4 and idx.granted == 4
        t0 = 1000.0
        assert book.expire(t0 + 10 * GRANT_EXPIRE_S) == 0  # all still in the ring: the client's to take
        keys = [bytes([i]) * 32 for i in range(2)]
        taken = w.take_slots(keys, None)  # the client takes all 4 from its ring, and uses 2
        assert [b.granted for b in taken] == [True, True]
        w.unstage(taken)  # given up: the daemon takes them back on expiry
        assert book.expire(t0) == 0  # seen taken now: their time starts
        assert book.expire(t0 + GRANT_EXPIRE_S - 1) == 0
        assert book.expire(t0 + GRANT_EXPIRE_S + 1) == 4
        assert idx.granted == 0 and rt.counters.grants_reclaimed == 4
        for b in taken:
            h = rt.cpu.table.header(b.slot)
            assert h.flags == Flags.EMPTY and h.gen % 2 == 0
        book.want("s", w.seg.name)  # granted again; then the client goes, and they come back
        assert asyncio.run(book.top_up(no_room)) == 4 and idx.granted == 4
        book.forget(w.seg.name)
        assert idx.granted == 0 and rt.counters.grants_reclaimed == 8


def test_a_slot_given_back_and_granted_anew_expires_on_its_new_grants_time_not_the_old_ones() -> None:
    """The sweep keeps queues of grants in ring order and in the order it saw them taken, and
    drops an entry whose grant went since (kvtier/tiers/grants.py `Held`): a slot given back and
    granted again must not inherit the old grant's clock."""
    with grant_pool("test-exp-again") as (rt, staging, w, log):
        idx = rt.placement.tiers[Tier.CPU]
        book = GrantBook({"s": rt}, staging, 4, log)
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(no_room)) == 4
        first = w.take_slots([bytes([i]) * 32 for i in range(4)], None)
        assert all(b.granted for b in first)
        t0 = 1000.0
        assert book.expire(t0) == 0  # all four seen taken at t0
        gone = first[:2]
        for b in gone:  # a put of a block already here hands its slot back
            assert book.give_back(rt, w.seg.name, b.slot)
        w.unstage(first)
        assert asyncio.run(book.top_up(no_room)) == 2 and idx.granted == 4
        again = w.take_slots([bytes([10 + i]) * 32 for i in range(2)], None)
        assert all(b.granted for b in again)
        assert {b.slot for b in again} == {b.slot for b in gone}  # the very slots, granted anew
        assert book.expire(t0 + GRANT_EXPIRE_S - 1) == 0  # the new two seen taken now
        assert book.expire(t0 + GRANT_EXPIRE_S + 1) == 2  # only the two left from t0
        assert idx.granted == 2
        assert book.expire(t0 + 2 * GRANT_EXPIRE_S - 2) == 0
        assert book.expire(t0 + 2 * GRANT_EXPIRE_S) == 2  # the new two, on their own clock
        assert idx.granted == 0


def test_a_client_whose_tail_lies_does_not_grow_the_sweeps_queue_without_bound() -> None:
    """The sweep goes by the client's tail, which is its word. A client that moves it up while
    the daemon tops up (so its ring has room) and back down while it sweeps never lets the sweep
    pass its grants; those handed back leave entries behind, and the queue is compacted to a few
    times what is held (kvtier/tiers/grants.py `Held.compact`)."""
    with grant_pool("test-exp-bound") as (rt, staging, w, log):
        book = GrantBook({"s": rt}, staging, 4, log)
        book.renew(sorted(staging.present()))
        words = w._ring._words  # the client's end of the ring: base head epoch tail
        for rounds in range(1, 301):
            words[3] = words[1]  # "taken all": room for the next top-up
            book.want("s", w.seg.name)
            assert asyncio.run(book.top_up(no_room)) == 4
            h = book._held[w.seg.name]
            for slot in list(h.slots):  # each comes back unused (a put of a block already here)
                assert book.give_back(rt, w.seg.name, slot)
            words[3] = 0  # "taken none" while the daemon looks
            assert book.expire(1000.0 + rounds) == 0
        assert 300 * 4 > 2 * (RING + 4)  # more pushed than the bound, so the bound is what held
        assert len(h.in_ring) <= 2 * (RING + len(h.slots)) and not h.slots
