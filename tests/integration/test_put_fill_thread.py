"""Where a put's fill runs: a put from a host tensor in one share of at most
`Client.inline_put_bytes` fills its slots on the event loop (no hand-off to a copy thread and
back); a bigger one, a fill the caller supplies (`put_with`) and a client told to keep every fill
off the loop use the copy threads. Either way the bytes put come back. A real daemon."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.client import Client
from kvtier.client.writes import INLINE_PUT_BYTES
from tests.support.blocks import SHAPE, make_kv, same_bytes

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
