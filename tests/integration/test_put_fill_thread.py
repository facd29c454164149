"""Where a put's fill runs: a put from a host tensor in one share of at most
`Client.inline_put_bytes` fills its slots on the event loop (no hand-off to a copy thread and
back); a bigger one, a fill the caller supplies (`put_with`) and a client told to keep every fill
off the loop use the copy threads. Either way the bytes put come back; a fill that fails on the
loop leaves its slots empty and publishes nothing. A real daemon."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.client import Client
from kvtier.client.writes import INLINE_PUT_BYTES
from kvtier.shm.slots import Flags
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

BLOCKS = 64  # 512 KiB of 8 KiB blocks: past the 256 KiB a copy of any other kind leaves the loop at


def fills_seen(client: Client) -> list[str]:
    """The names of the threads the put's fills ran in, from now on."""
    w = client.pool("t").stager()
    seen: list[str] = []
    for name in ("fill_rows", "fill_slot_with"):
        inner = getattr(w, name)

        def recorded(*a, inner=inner):
            seen.append(threading.current_thread().name)
            return inner(*a)
        setattr(w, name, recorded)
    return seen


@pytest.mark.parametrize("case", ["inline", "over-the-bound", "told-off-loop", "put_with"])
async def test_a_small_put_fills_on_the_loop_and_the_rest_in_copy_threads(daemon_factory, case):
    d = daemon_factory(node=f"fill-{case}", gpu=0, cpu=1024)
    async with await Client.connect(d.runtime_dir, staging_blocks=BLOCKS) as client:
        assert client.inline_put_bytes == INLINE_PUT_BYTES
        if case == "over-the-bound":
            client.inline_put_bytes = BLOCKS * client.pool("t").block_bytes - 1
        elif case == "told-off-loop":
            client.inline_put_bytes = 0
        seen = fills_seen(client)
        keys = client.block_keys("t", list(range(16 * BLOCKS)), salt=case.encode())
        kv = make_kv(BLOCKS, seed=7)
        loop_thread = threading.current_thread().name
        if case == "put_with":
            host = kv.contiguous().view(torch.uint8).reshape(BLOCKS, -1).numpy()

            def fill(i, dst):
                dst[:] = host[i]
            res = await client.put_with("t", keys, fill)
        else:
            res = await client.put("t", keys, kv)
        assert res.staged == BLOCKS and res.dropped == 0, res
        assert seen, "the put filled its slots"
        if case == "inline":
            assert set(seen) == {loop_thread}, f"filled in {seen}, not on the loop ({loop_thread})"
        else:
            assert loop_thread not in seen and all(t.startswith("kvtier-copy") for t in seen), seen
        assert await client.wait_resident("t", keys, timeout=10)
        out = make_kv(BLOCKS, seed=8)
        assert await client.get("t", keys, out) == BLOCKS
        assert same_bytes(out, kv), "the blocks read back are the blocks put"
        assert out.shape == (BLOCKS, *SHAPE)


async def test_a_fill_that_fails_on_the_loop_empties_its_slots_and_publishes_nothing(daemon_factory):
    d = daemon_factory(node="fill-fails", gpu=0, cpu=1024, extra="grant_blocks = 128")
    async with await Client.connect(d.runtime_dir, staging_blocks=BLOCKS) as client:
        await client.prepare_puts("t")
        w = client.pool("t").stager()
        await async_wait_until(lambda: w.grants_waiting() >= BLOCKS, timeout=10,
                               message="the daemon granted the client slots")
        taken = []
        inner = w.fill_rows

        def half_then_fail(share, rows):  # half the slots written READY, then the fill fails
            taken.extend(b for _, b in share)
            inner(share[: len(share) // 2], rows)
            raise RuntimeError("the fill failed")
        w.fill_rows = half_then_fail
        keys = client.block_keys("t", list(range(16 * BLOCKS)), salt=b"fails")
        with pytest.raises(RuntimeError, match="the fill failed"):
            await client.put("t", keys, make_kv(BLOCKS, seed=3))
        w.fill_rows = inner
        assert len(taken) == BLOCKS and all(b.granted for b in taken), "the put was filling granted slots"
        for b in taken:
            h = w.arena.header(b.slot)
            assert h.flags == Flags.EMPTY and h.gen % 2 == 0, (b.slot, h)
        # The client stream is in order: once a later put is resident, the failed one would
        # have been handled too, had it been sent.
        other = client.block_keys("t", list(range(16 * BLOCKS)), salt=b"after")
        res = await client.put("t", other, kv := make_kv(BLOCKS, seed=4))
        assert res.staged == BLOCKS and res.dropped == 0
        assert await client.wait_resident("t", other, timeout=10)
        wait_until(lambda: d.pool_stats().get("puts", 0) >= BLOCKS, timeout=10, message="the daemon counted the put")
        assert d.pool_stats()["puts"] == BLOCKS, "only the second put reached the daemon"
        assert client.lookup("t", keys).length == 0
        out = make_kv(BLOCKS, seed=5)
        assert await client.get("t", other, out) == BLOCKS and same_bytes(out, kv)
