"""A graceful stop (SIGTERM) keeps what clients were told (issue 25, items 4f and 4g).

- Staged puts are stored before the daemon exits: the coordinator handles the puts sent before
  the stop, then the tier workers carry out their stores. Before, the stores still queued at the
  stop ran at the next start, by when a client that had exited meanwhile had taken its staging
  segment (and the bytes) with it: `tier.transfer_failed why=bad_staging`, after `staged`.
- A clean restart reports no discarded slots: slots freed by evictions are empty, not lost
  blocks. Before, each freed slot counted as "discarded".
"""

from __future__ import annotations

import pytest
import torch

from kvtier.client import Client
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

CHAINS, BLOCKS = 16, 24


async def _stored(c: Client, keys) -> bool:
    return all(await c.present("t", keys))


def _events(d, event: str) -> list[dict]:
    return [x for x in d.log_events() if x.get("event") == event]


async def test_puts_staged_before_a_graceful_stop_are_stored_though_the_client_exits_at_once(daemon_factory):
    # Room for all of it below the high watermark: nothing is shed, before or after the restart.
    d = daemon_factory(node="drain", gpu=0, cpu=2 * CHAINS * BLOCKS, persist_arena=True)
    client = await Client.connect(d.runtime_dir, staging_blocks=CHAINS * BLOCKS)
    chains = []
    for i in range(CHAINS):
        keys = client.block_keys("t", list(range(i * 10**5, i * 10**5 + 16 * BLOCKS)))
        kv = make_kv(BLOCKS, seed=i)
        assert (await client.put("t", keys, kv)).staged == BLOCKS
        chains.append((keys, kv))
    d.proc.send_signal(15)  # at once: most of these puts are still in the streams
    assert d.proc.wait(30) == 0
    await client.close()  # the client's staging segment goes with it
    d.start()
    async with await Client.connect(d.runtime_dir) as c:
        out = torch.empty((BLOCKS, *SHAPE), dtype=torch.float16)
        for i, (keys, kv) in enumerate(chains):
            assert await c.get("t", keys, out) == BLOCKS and same_bytes(out, kv), f"chain {i} lost at the stop"
    assert _events(d, "arena.reattached")[-1]["kept"] == CHAINS * BLOCKS
    assert not [e for e in _events(d, "tier.transfer_failed") if e.get("why") == "bad_staging"]
    assert not _events(d, "daemon.drain_incomplete")


async def test_a_clean_restart_discards_nothing_though_evictions_freed_slots(daemon_factory):
    d = daemon_factory(node="freed", gpu=0, cpu=32, persist_arena=True)
    async with await Client.connect(d.runtime_dir) as c:
        for i in range(6):  # 96 blocks through 32 slots: the tier sheds to Redis, freeing slots
            keys = c.block_keys("t", list(range(i * 10**5, i * 10**5 + 16 * 16)))
            assert (await c.put("t", keys, make_kv(16, seed=i))).staged == 16
            await async_wait_until(lambda keys=keys: _stored(c, keys), timeout=10, message=f"chain {i} stored")
    await async_wait_until(lambda: d.pool_stats().get("tiers", {}).get("cpu", {}).get("evicted", 0) > 0,
                           timeout=10, message="evictions (freed slots) in the stats")
    assert d.stop() == 0
    held = d.stats()["pools"]["t"]["tiers"]["cpu"]["blocks"]
    d.start()
    reattached = _events(d, "arena.reattached")[-1]
    assert reattached["discarded"] == 0 and reattached["torn"] == 0, reattached
    assert reattached["kept"] == held
