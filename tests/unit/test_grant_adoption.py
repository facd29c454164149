"""A batch of granted stores adopted together (GrantBook.adopt_many, kvtier/shm/flips.py): a real
pool opened in-process (the daemon's own open_pool), a real client staging segment whose client
writes its granted slots as the Client does.

Each block of the batch gets the outcome `adopt` would give it alone: written whole, it becomes
VALID with the header the client wrote (gen two on), readable; a slot not granted, out of the
arena, or whose header does not bind its key to its checksum is refused, and the one granted is
emptied; a redelivery is reported where it is. Slots outside the batch are not touched.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvtier.core.events import Failure, Removed, Store, Stored, Tier
from kvtier.shm.slots import Flags
from kvtier.tiers.grants import GrantBook
from tests.support.grant_pool import grant_pool, no_room


def test_a_batch_of_granted_stores_is_adopted_block_by_block_in_one_pass() -> None:
    with grant_pool("test-adopt") as (rt, staging, w, log):
        bb, table = rt.layout.block_bytes, rt.cpu.table
        book = GrantBook({"s": rt}, staging, 5, log)  # the five the client takes: no other slot is granted
        assert book.client_cap(rt) == 5 and GrantBook({"s": rt}, staging, 5, log, 3 * bb).client_cap(rt) == 3
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(no_room)) == 5
        keys = [bytes([i + 1]) * 32 for i in range(5)]
        taken = w.take_slots(keys, None)
        assert [b.granted for b in taken] == [True] * 5
        rows = np.random.default_rng(3).integers(0, 255, (5, bb), dtype=np.uint8)
        filled = [w.fill_slot(b, rows[i]) for i, b in enumerate(taken)]
        # Block 3: another writer's key lands on a header whose checksum and tag are block 3's.
        table.headers(0, table.n)["key"][filled[3].slot] = np.frombuffer(bytes(31) + b"\x09", dtype="V32")[0]
        mixed = Store("s", Tier.CPU, bytes(31) + b"\x09", None, w.seg.name, filled[3].slot, filled[3].gen, True)
        before = table.headers(0, table.n).copy()
        # The put names parents; the first block's header says none: the put's word is kept, as the index's.
        stores = [Store("s", Tier.CPU, b.key, keys[i - 1] if i else b"\x07" * 32, w.seg.name, b.slot, b.gen, True)
                  for i, b in enumerate(filled[:3])]
        free = next(s for s in range(table.n) if s not in {b.slot for b in filled} and before["flags"][s] == 0)
        bad = [mixed,
               Store("s", Tier.CPU, keys[4], keys[3], w.seg.name, free, 2, True),  # never granted to it
               Store("s", Tier.CPU, keys[4], keys[3], w.seg.name, table.n + 5, 2, True)]  # outside the arena
        got = book.adopt_many(rt, [*stores, *bad])

        for (o, why), b in zip(got[:3], filled[:3]):
            assert isinstance(o.fact, Stored) and o.fact.slot == b.slot and why == ""
            h = table.header(b.slot)
            ev = stores[filled.index(b)]
            assert (h.flags, h.gen, h.key, h.parent_key) == (Flags.VALID, b.gen + 2, b.key, ev.parent)
            out = np.empty(bb, dtype=np.uint8)
            assert table.read_into(b.slot, b.key, out) is not None and np.array_equal(out, rows[filled.index(b)])
            assert rt.cpu.index.get(b.key) is not None
        assert [(type(o.fact), o.fact.why) for o, _ in got[3:] if isinstance(o.fact, Removed)] == \
            [(Removed, Failure.VERIFY), (Removed, Failure.BAD_STAGING), (Removed, Failure.BAD_STAGING)]
        assert table.header(filled[3].slot).flags == Flags.EMPTY  # the refused grant emptied, then freed
        after = table.headers(0, table.n)
        changed = {int(s) for s in np.flatnonzero(after != before)}
        assert changed == {b.slot for b in filled[:4]}
        assert rt.counters.granted_puts == 3

        again = book.adopt_many(rt, stores[:1])  # a redelivery: where it is, nothing moved
        assert isinstance(again[0][0].fact, Stored) and again[0][0].count is None and rt.counters.granted_puts == 3
        # A gen no write leaves (a forged command's): refused, its grant emptied, the batch goes on.
        last = filled[4]  # written whole, never named by a put yet
        forged = Store("s", Tier.CPU, last.key, keys[3], w.seg.name, last.slot, -2, True)
        [(o, _)] = book.adopt_many(rt, [forged])
        assert isinstance(o.fact, Removed) and o.fact.why is Failure.VERIFY
        assert table.header(last.slot).flags == Flags.EMPTY


def test_a_flip_that_fails_half_way_leaves_no_claimed_slot_behind(monkeypatch) -> None:
    """A fault injected into the flip itself (none happens on a healthy mapping): after the gens
    went odd, before any header was written. The batch raises (it is not acked, so it comes
    back), and the blocks it had claimed are emptied and their slots freed, not leaked as
    claimed-but-invisible; the redelivery finds them no longer granted and reports them failed."""
    import kvtier.tiers.grants as grants_mod

    with grant_pool("test-adopt-fault") as (rt, staging, w, log):
        bb, table = rt.layout.block_bytes, rt.cpu.table
        book = GrantBook({"s": rt}, staging, 3, log)
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(no_room)) == 3
        keys = [bytes([i + 1]) * 32 for i in range(3)]
        rows = np.random.default_rng(4).integers(0, 255, (3, bb), dtype=np.uint8)
        filled = [w.fill_slot(b, rows[i]) for i, b in enumerate(w.take_slots(keys, None))]
        stores = [Store("s", Tier.CPU, b.key, keys[i - 1] if i else None, w.seg.name, b.slot, b.gen, True)
                  for i, b in enumerate(filled)]
        free_before = rt.cpu.index.free

        def half_flip(headers, slots, checked) -> None:
            headers["gen"][slots] = headers["gen"][slots] + 1
            raise OSError("injected: the mapping failed mid-flip")

        monkeypatch.setattr(grants_mod, "flip_valid", half_flip)
        try:
            book.adopt_many(rt, stores)
            raise AssertionError("the flip's failure must reach the caller")
        except OSError:
            pass
        monkeypatch.undo()
        for b in filled:
            h = table.header(b.slot)
            assert h.flags == Flags.EMPTY and h.gen % 2 == 0, h
            assert rt.cpu.index.get(b.key) is None
        assert rt.cpu.index.free == free_before + 3  # back in the free list, not claimed for ever
        again = book.adopt_many(rt, stores)
        assert [o.fact.why for o, _ in again if isinstance(o.fact, Removed)] == [Failure.BAD_STAGING] * 3


@pytest.mark.parametrize("compiled", [True, False])
def test_a_puts_fill_of_granted_and_staging_slots_in_one_call(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """StagingWriter.fill_rows, a client put's fill: each table's copies in one call, then each
    header as fill_slot writes it, in share order (a copy thread's share is every k-th block).
    Its granted blocks are adopted by the daemon's checks; every block reads back READY and
    exact. Compiled (`copy_rows`) and not (numpy and python-xxhash: a host without the build)."""
    import kvtier.shm.onepass as onepass
    from kvtier.shm.onepass import checksum

    assert onepass._copy_hash is not None  # built by the install (tests/unit/test_copy_hash_compiled.py)
    if not compiled:
        monkeypatch.setattr(onepass, "_copy_hash", None)
    with grant_pool("test-fill-rows") as (rt, staging, w, log):
        bb = rt.layout.block_bytes
        book = GrantBook({"s": rt}, staging, 3, log)
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(no_room)) == 3
        keys = [bytes([i + 1]) * 32 for i in range(6)]
        taken = w.take_slots(keys, b"\x07" * 32)
        assert [b.granted for b in taken] == [True] * 3 + [False] * 3
        rows = np.random.default_rng(5).integers(0, 255, (6, bb), dtype=np.uint8)
        share = [(i, taken[i]) for i in (4, 0, 2, 5, 1, 3)]
        filled = w.fill_rows(share, rows)
        assert [b.key for b in filled] == [keys[i] for i, _ in share]
        for (i, before), b in zip(share, filled):
            table = rt.cpu.table if b.granted else w.table
            assert b.slot == before.slot and b.gen == before.gen + 1 and b.granted == before.granted
            h = table.header(b.slot)
            assert (h.flags, h.gen, h.key, h.length, h.checksum) == (Flags.READY, b.gen, keys[i], bb, checksum(rows[i]))
            assert h.parent_key == (keys[i - 1] if i else b"\x07" * 32)
            out = np.empty(bb, dtype=np.uint8)
            assert table.read_into(b.slot, b.key, out, Flags.READY) is not None and np.array_equal(out, rows[i])
        granted = sorted((b for b in filled if b.granted), key=lambda b: keys.index(b.key))
        stores = [Store("s", Tier.CPU, b.key, keys[keys.index(b.key) - 1] if keys.index(b.key) else b"\x07" * 32,
                        w.seg.name, b.slot, b.gen, True) for b in granted]
        assert all(isinstance(o.fact, Stored) for o, _ in book.adopt_many(rt, stores))
        # A fill that fails (rows narrower than a block) commits no header: the slots stay odd,
        # for the caller's unstage, and readers pass them by.
        more = w.take_slots([b"\x0b" * 32], None)
        with pytest.raises(ValueError):
            w.fill_rows([(0, more[0])], rows[:, :bb // 2])
        table = rt.cpu.table if more[0].granted else w.table
        assert table.header(more[0].slot).gen == more[0].gen and more[0].gen % 2 == 1
        w.unstage(more)
