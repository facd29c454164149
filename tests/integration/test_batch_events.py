"""A put costs one command and one fact on the bus however many blocks it holds (core/events.py:
StoreBatch, StoredBatch), and none for its blocks written into granted cpu slots, which the
coordinator adopts in-process (kvtier/tiers/granted_puts.py). Read back from the real streams of
a real daemon: the events on the cpu worker's stream and on the facts stream, decoded as the
daemon decodes them."""

from __future__ import annotations

import pytest

from kvtier.bus.codec import decode_entry
from kvtier.client import Client
from kvtier.core.events import Store, StoreBatch, Stored, StoredBatch
from tests.support.blocks import make_kv
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

BLOCKS = 32


def events(r, stream: str) -> list:
    return [env.event for _id, fields in r.xrange(stream) for env in decode_entry(fields[b"e"])]


@pytest.mark.parametrize("grants", [0, 128], ids=["staging", "grants"])
async def test_a_put_is_one_store_batch_and_one_stored_batch_and_its_granted_blocks_none(
        daemon_factory, redis_server, grants):
    # 256 slots: the smallest arena that grants, 16 slots a client at a time, so that a put of 32
    # blocks is granted at its head and staged at its tail.
    d = daemon_factory(node="batchev", gpu=0, cpu=256, extra=f"grant_blocks = {grants}")
    r = redis_server.client()
    try:
        async with await Client.connect(d.runtime_dir, staging_blocks=64) as client:
            chains = []
            for i in range(3):  # the first put is staged; with grants on, the later ones use them
                keys = client.block_keys("t", list(range(i * 10**6, i * 10**6 + 16 * BLOCKS)))
                res = await client.put("t", keys, make_kv(BLOCKS, seed=i), wait_s=5)
                assert res.staged == BLOCKS, res
                assert await client.wait_resident("t", keys, timeout=10)
                chains.append(keys)
        cmds = events(r, f"kvtier:{{{d.node}}}:tier:cpu")
        facts = events(r, f"kvtier:{{{d.node}}}:facts")
        assert not any(isinstance(e, Store) for e in cmds), "no per-block store commands"
        assert not any(isinstance(e, Stored) for e in facts), "no per-block stored facts"
        assert not any(b.granted for c in cmds if isinstance(c, StoreBatch) for b in c.blocks), \
            "granted blocks never travel to the cpu worker"
        adopted = 0
        for keys in chains:
            mine = [c for c in cmds if isinstance(c, StoreBatch) and {b.key for b in c.blocks} & set(keys)]
            got = [f for f in facts if isinstance(f, StoredBatch) and set(f.keys) & set(keys)]
            assert len(mine) <= 1 and len(got) == len(mine), (len(mine), len(got))
            staged = [b.key for b in mine[0].blocks] if mine else []
            head = BLOCKS - len(staged)  # the put's granted head, adopted in-process
            assert staged == keys[head:], "one command for the put's staged tail"
            assert not mine or list(got[0].keys) == staged, "one fact for the put's staged blocks"
            adopted += head
        assert (adopted > 0) == (grants > 0), adopted
        # Each block the streams did not carry was adopted from its granted slot, none lost.
        wait_until(lambda: d.pool_stats().get("granted_puts") == adopted, timeout=10,
                   message=f"{adopted} granted puts in the daemon's stats")
    finally:
        r.close()
