"""A put's granted blocks adopted while the coordinator handles the put (kvtier/tiers/granted_puts.py):
a real pool opened in-process (the daemon's own open_pool), a real client staging segment whose
client writes its granted slots as the Client does, and the daemon's Coordinator.

What must hold: the blocks are visible (index, directory, VALID headers) once the put is handled,
with no command or fact on any stream; each is fenced with a stamp newer than every command
published before it; a block the cpu worker has queued work for leaves the whole put to the
worker, untouched here; and what the adoption's facts call for (write-through copies, the
router's facts) is published by a later flush when the flush that carried it fails.
"""

from __future__ import annotations

import asyncio

import numpy as np

from kvtier.config import PolicyConfig
from kvtier.core.events import Copy, Put, StoreBatch, Stored, Tier
from kvtier.daemon.coordinator import Coordinator
from kvtier.shm.slots import Flags
from kvtier.tiers.grants import GrantBook
from tests.support.grant_pool import EPOCH, Streams, adopting_coordinator, grant_pool, no_room, put_delivery


def granted_put(rt, staging, w, log, n: int, queued=lambda pool, keys: False, policy_streams: Streams | None = None):
    """A coordinator with granted puts on, and a put of `n` blocks the client wrote into granted slots."""
    streams = policy_streams or Streams()
    facts: list = []
    coord, book, fence = adopting_coordinator(rt, staging, w, log, n, streams, queued,
                                              on_facts=lambda pool, fs: facts.extend(fs))
    assert asyncio.run(book.top_up(no_room)) == n
    keys = [bytes([i + 1]) * 32 for i in range(n)]
    taken = w.take_slots(keys, None)
    assert [b.granted for b in taken] == [True] * n
    rows = np.random.default_rng(5).integers(0, 255, (n, rt.layout.block_bytes), dtype=np.uint8)
    filled = w.fill_rows(list(enumerate(taken)), rows)
    return coord, streams, fence, facts, keys, filled, rows, book


def deliver(coord: Coordinator, put: Put, seq: int) -> None:
    asyncio.run(coord.handle(put_delivery(put, seq)))


def test_a_puts_granted_blocks_are_visible_once_handled_with_nothing_on_a_stream() -> None:
    with grant_pool("granted-put") as (rt, staging, w, log):
        streams = Streams()
        streams.seq = 100  # commands published before the put
        coord, streams, fence, facts, keys, filled, rows, book = granted_put(rt, staging, w, log, 4,
                                                                              policy_streams=streams)
        deliver(coord, Put("s", w.seg.name, tuple(filled), None, book.epoch), 1)
        table, bb = rt.cpu.table, rt.layout.block_bytes
        for i, b in enumerate(filled):
            e = rt.cpu.index.get(b.key)
            assert e is not None and e.slot == b.slot and b.key in rt.cpu.index  # READY: visible
            assert rt.directory.get(b.key)[1] == b.slot  # listed for clients, in the cpu column
            assert table.header(b.slot).flags == Flags.VALID
            out = np.empty(bb, dtype=np.uint8)
            assert table.read_into(b.slot, b.key, out) is not None and np.array_equal(out, rows[i])
            # Fenced after every command published before it (seq 100), before every later one.
            assert fence.stale("s", b.key, (EPOCH, 100)) and not fence.stale("s", b.key, (EPOCH, 10**6))
        assert rt.counters.granted_puts == 4 and rt.counters.tiers["cpu"].stored == 4
        assert rt.placement.incoming(Tier.CPU) == 0, "never in flight: nothing to give up on later"
        asyncio.run(coord.flush())
        assert not [c for _, c in streams.sent if isinstance(c, StoreBatch)], "no command for the granted blocks"
        assert [f.key for f in facts if isinstance(f, Stored)] == keys, "the router hears of each block"


def test_a_put_whose_block_the_cpu_worker_has_queued_work_for_is_left_to_the_worker() -> None:
    with grant_pool("granted-queued") as (rt, staging, w, log):
        busy: set[bytes] = set()
        coord, streams, fence, facts, keys, filled, rows, book = granted_put(
            rt, staging, w, log, 3, queued=lambda pool, keys: bool(busy & set(keys)))
        busy.add(keys[1])
        before = rt.cpu.table.headers(0, rt.cpu.table.n).copy()
        deliver(coord, Put("s", w.seg.name, tuple(filled), None, book.epoch), 1)
        assert all(rt.cpu.index.get(k) is None for k in keys) and rt.counters.granted_puts == 0
        assert rt.placement.incoming(Tier.CPU) == 3, "on their way in, until the worker's fact"
        assert np.array_equal(rt.cpu.table.headers(0, rt.cpu.table.n), before), "no header touched here"
        asyncio.run(coord.flush())
        [cmd] = [c for _, c in streams.sent if isinstance(c, StoreBatch)]
        assert cmd.tier == Tier.CPU and [b.key for b in cmd.blocks] == keys and all(b.granted for b in cmd.blocks)
        assert all(book.take("s", w.seg.name, b.slot) for b in filled), "still granted: the worker adopts them"


def test_what_an_adoption_calls_for_is_published_by_a_later_flush_when_its_own_fails() -> None:
    with grant_pool("granted-flush", PolicyConfig(redis_write="write-through")) as (rt, staging, w, log):
        coord, streams, fence, facts, keys, filled, rows, book = granted_put(rt, staging, w, log, 3)
        deliver(coord, Put("s", w.seg.name, tuple(filled), None, book.epoch), 1)
        streams.fail = ConnectionError("redis went away")
        try:
            asyncio.run(coord.flush())
        except ConnectionError:
            pass
        else:
            raise AssertionError("the flush did not fail")
        assert not streams.sent and not facts
        # The put comes back (nothing was acked): a duplicate now, it adopts nothing again.
        deliver(coord, Put("s", w.seg.name, tuple(filled), None, book.epoch), 1)
        asyncio.run(coord.flush())
        copies = [c for _, c in streams.sent if isinstance(c, Copy)]
        assert [c.key for c in copies] == keys and all(c.dst == Tier.REDIS for c in copies), \
            "the write-through copies the adoption called for"
        assert [f.key for f in facts if isinstance(f, Stored)] == keys
        assert rt.counters.granted_puts == 3


def test_two_top_ups_at_once_never_grant_a_client_past_its_cap() -> None:
    """The coordinator tops a client up after each granted put, the cpu worker at each flush; a
    top-up that waits in make_room (asking Redis) must not let the other grant the same room."""
    with grant_pool("granted-topups") as (rt, staging, w, log):
        book = GrantBook({"s": rt}, staging, 32, log)
        book.renew(sorted(staging.present()))
        cap = book.client_cap(rt)
        full = [bytes([1, i % 256, i // 256]) * 10 + b"xx" for i in range(rt.placement.tiers[Tier.CPU].free)]
        for key in full:  # every free slot held, so each top-up must make room, one slot at a time
            assert rt.placement.reserve(Tier.CPU, key, None) is not None

        async def make_room(_rt) -> bool:
            await asyncio.sleep(0)  # waits, as on Redis: the other top-up runs meanwhile
            if not full:
                return False
            rt.placement.unreserve(Tier.CPU, full.pop())
            return True

        async def both() -> list[int]:
            book.want("s", w.seg.name)
            first = asyncio.ensure_future(book.top_up(make_room))
            await asyncio.sleep(0)  # the first is in make_room now
            book.want("s", w.seg.name)  # wanted again meanwhile (a put's adoption, the sweep)
            return list(await asyncio.gather(first, book.top_up(make_room)))

        granted = asyncio.run(both())
        assert sum(granted) == cap, (granted, cap)
        taken = w.take_slots([bytes([9, i]) * 16 for i in range(2 * cap)], None)
        assert sum(b.granted for b in taken) == cap, "the client's ring holds its cap, no more"
        w.unstage(taken)
