"""The cluster prefix index (issue 16): `where` names the node and tier holding the longest
leading run, as blocks move between nodes, tiers and Redis; a dead node's entries expire."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.client import Client
from kvtier.core.where import where_key
from tests.support.blocks import make_kv, stored_somewhere
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

INDEX = '[prefix_index]\nenabled = true\nttl_s = 10\nrefresh_s = 2.0\n'
THROUGH = '[policy]\nredis_write = "write-through"\n'


async def test_where_follows_blocks_across_nodes_tiers_and_redis(daemon_factory) -> None:
    a = daemon_factory(node="wa", gpu=0, cpu=16, extra=INDEX + THROUGH)
    b = daemon_factory(node="wb", gpu=0, cpu=64, extra=INDEX)
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        tokens = list(range(16 * 8))
        keys = ca.block_keys("t", tokens, salt=b"where")
        assert (await ca.put("t", keys, make_kv(8, seed=1))).staged == 8

        async def answer(pred):
            return await async_wait_until(lambda: _check(cb.where("t", keys), pred), 15)

        w = await answer(lambda w: w.best is not None and w.best.length == 8 and w.redis_length == 8)
        assert w.best.node == a.node and set(w.best.tiers) == {"cpu"}
        # node B computes the first three blocks itself: the longest run is still A's alone, and
        # for those three blocks both nodes are named
        assert (await cb.put("t", keys[:3], make_kv(8, seed=1)[:3])).staged == 3
        await async_wait_until(lambda: _check(cb.where("t", keys[:3]), lambda w: {r.node: r.length for r in w.nodes}
                                              == {a.node: 3, b.node: 3}), 15)
        w = await cb.where("t", keys)
        assert [(r.node, r.length) for r in w.nodes] == [(a.node, 8)]
        # Newer chains push the old one out of A's 16-block cpu tier (it stays in Redis)
        for r in range(12):
            more = ca.block_keys("t", list(range(16 * 8)), salt=b"push%d" % r)
            await ca.put("t", more, make_kv(8, seed=2 + r))
            # Stored, locally or (when shedding has not yet made room: admit's rule) in Redis.
            await async_wait_until(lambda more=more: stored_somewhere(ca, more), 10)
            if ca.lookup("t", keys[:1]).length == 0:  # leaf first: one block of the old chain per round
                break
        assert ca.lookup("t", keys[:1]).length == 0, "the old chain never left A's cpu tier"
        # (An answer can be empty for an instant: a node's index write, or the query's own Redis
        # round trip, late under load, reads as "nobody". Wait for B to be named.)
        w = await answer(lambda w: a.node not in {r.node for r in w.nodes} and b.node in {r.node for r in w.nodes})
        assert w.redis_length == 8 and w.best is not None and w.best.node == b.node and w.best.length == 3


async def _check(coro, pred):
    w = await coro
    return w if pred(w) else None


async def test_a_dead_nodes_entries_expire_within_ttl(daemon_factory) -> None:
    a = daemon_factory(node="wd", gpu=0, extra=INDEX)
    b = daemon_factory(node="we", gpu=0, extra=INDEX)
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys = ca.block_keys("t", list(range(16 * 4)), salt=b"dead")
        assert (await ca.put("t", keys, make_kv(4, seed=3))).staged == 4
        await async_wait_until(lambda: _check(cb.where("t", keys), lambda w: w.length == 4), 10)
        a.kill()  # no HDEL will come: the TTL (10 s) is the bound
        w = await async_wait_until(lambda: _check(cb.where("t", keys), lambda w: w.length == 0), 20,
                                   message="a dead node's entries expire")
        assert w.nodes == ()


async def test_kvtier_where_cli(daemon_factory) -> None:
    a = daemon_factory(node="wc", gpu=0, extra=INDEX)
    async with await Client.connect(a.runtime_dir) as ca:
        tokens = list(range(16 * 3 + 5))  # 3 full blocks and a partial one
        keys = ca.block_keys("t", tokens)
        assert (await ca.put("t", keys, make_kv(3, seed=4))).staged == 3
        await async_wait_until(lambda: _check(ca.where("t", keys), lambda w: w.length == 3), 10)
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "where", "--pool", "t", "--json",
                          "--runtime-dir", str(a.runtime_dir), "--tokens", json.dumps(tokens)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["blocks"] == 3 and got["length"] == 3
    assert got["nodes"] == [{"node": a.node, "length": 3, "tiers": ["cpu", "cpu", "cpu"]}]
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "where", "--pool", "t", "--runtime-dir",
                          str(a.runtime_dir), "--tokens", "1,x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read the token ids" in bad.stderr


class _HdelBeforeHgetall:
    """The blocks Redis, with another node's HDEL landing between `where`'s HLEN and HGETALL
    reads, once: the race a router meets while a node evicts the deepest blocks."""

    def __init__(self, batches, r, pool: str, key: bytes, field: str) -> None:
        self._batches, self._r, self._hash, self._field, self.raced = batches, r, where_key(pool, key), field, False

    async def run(self, commands, **kw):
        if commands and commands[0][0] == "HGETALL" and not self.raced:
            self.raced = True
            self._r.hdel(self._hash, self._field)
        return await self._batches.run(commands, **kw)


async def test_where_asks_again_when_the_deepest_holder_leaves_between_its_reads(redis_server, redis_url) -> None:
    """Node a holds 5 blocks of a chain, node b the first 3; a drops its 5th block between the
    reads. Before, the answer was empty (no node at all) though a still held 4 and b 3; now it asks
    again and names a's run of 4."""
    from kvtier.bus.connect import make_redis
    from kvtier.client.where_query import query_where
    from kvtier.store.batches import batches_for

    keys = [bytes([i]) * 32 for i in range(1, 6)]
    r = redis_server.client()
    for i, k in enumerate(keys):
        r.hset(where_key("t", k), mapping={"a|cpu": 1, **({"b|gpu": 1} if i < 3 else {})})
    client = make_redis(redis_url, socket_timeout=2.0, connect_timeout=2.0, retries=1)
    try:
        racy = _HdelBeforeHgetall(batches_for(client), r, "t", keys[4], "a|cpu")
        w = await query_where(racy, "t", keys)
        assert racy.raced
        assert [(n.node, n.length) for n in w.nodes] == [("a", 4)], w  # the holders of the longest run
        assert w.redis_length == 0
    finally:
        await client.aclose()
        r.close()
