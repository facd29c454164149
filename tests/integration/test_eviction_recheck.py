"""An eviction that waited on Redis looks at its block again before dropping it
(kvtier/tiers/evicting.py): a real pool opened in-process as the daemon opens it, its Redis tier
on the test's own redis-server, and the daemon's Coordinator adopting a client's granted put of the
block's child while the evictor waits for Redis to answer whether it holds the block.

The pure rules alone (tests/unit/test_eviction.py) would drop the block: it was clean when chosen.
Dropped after its child arrived, the child's chain would have a hole where its parent was.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from kvtier.bus.connect import make_blocks_redis
from kvtier.core.events import Evict, Put, Reason, Tier
from kvtier.shm.slots import checksum
from kvtier.tiers.evicting import Evictions
from kvtier.tiers.facts import Facts
from tests.support.grant_pool import Streams, adopting_coordinator, grant_pool, no_room, put_delivery

pytestmark = pytest.mark.integration

PARENT, CHILD = b"\x01" * 32, b"\x02" * 32


class Node:
    """The pool, the daemon's coordinator adopting granted puts, and one client's staging writer."""

    def __init__(self, rt, staging, w, log) -> None:
        self.rt, self.w, self.log = rt, w, log
        self.coord, self.book, _ = adopting_coordinator(rt, staging, w, log, 4, Streams())
        self.seq = 0

    async def put(self, key: bytes, parent: bytes | None) -> np.ndarray:
        """A client's put of one block, written into a granted slot and adopted by the coordinator:
        the block's bytes."""
        [taken] = self.w.take_slots([key], parent)
        assert taken.granted
        self.seq += 1
        row = np.random.default_rng(self.seq).integers(0, 255, (1, self.rt.layout.block_bytes), dtype=np.uint8)
        [filled] = self.w.fill_rows([(0, taken)], row)
        await self.coord.handle(put_delivery(Put("s", self.w.seg.name, (filled,), None, self.book.epoch), self.seq))
        assert self.rt.cpu.index.get(key) is not None, "adopted: visible in the cpu tier"
        return row[0]


@asynccontextmanager
async def parent_in_cpu_and_redis(redis_url: str, prefix: str) -> AsyncIterator[Node]:
    """PARENT resident in the cpu tier and written to Redis (recorded there, as a write-through
    leaves it): the clean victim a full cpu tier would drop first."""
    client = make_blocks_redis(redis_url, socket_timeout=5.0, connect_timeout=2.0, retries=0)
    try:
        with grant_pool(prefix, redis_client=client) as (rt, staging, w, log):
            node = Node(rt, staging, w, log)
            assert await node.book.top_up(no_room) == 4
            row = await node.put(PARENT, None)
            value, view = rt.redis.new_value()
            view[:] = row
            assert await rt.redis.put_many([(PARENT, rt.redis.seal(value, PARENT, checksum(row)))]) == [None]
            rt.in_redis(PARENT, None)
            assert rt.placement.clean_victim(Tier.CPU) == PARENT
            yield node
    finally:
        await client.aclose()


def child_put_while_redis_answers(node: Node) -> list[list[bytes]]:
    """Redis's answer to the evictor's question comes back only after the coordinator has adopted
    a put of PARENT's child: the interleaving of a coordinator that ran while the evictor awaited
    Redis, made certain. The keys the evictor asked about, for the test to check."""
    asked: list[list[bytes]] = []
    exists = node.rt.redis.exists

    async def exists_then_child(keys):
        got = await exists(keys)  # the real server's answer: it holds PARENT
        asked.append(list(keys))
        await node.put(CHILD, PARENT)
        return got

    node.rt.redis.exists = exists_then_child
    return asked


async def test_making_room_keeps_a_block_that_got_a_child_while_redis_answered(redis_url) -> None:
    async with parent_in_cpu_and_redis(redis_url, "recheck-room") as node:
        rt = node.rt
        asked = child_put_while_redis_answers(node)
        fact = await Evictions(Tier.CPU, Facts(Tier.CPU, node.log), node.log).make_room(rt, rt.cpu)
        assert asked == [[PARENT]], "the evictor asked Redis about the block it chose"
        assert fact is None, "nothing else is clean: the child is in no tier below"
        assert rt.cpu.index.get(PARENT) is not None and rt.directory.get(PARENT)[1] >= 0, "still listed"
        assert rt.cpu.index.children(PARENT) == 1 and rt.cpu.index.get(CHILD) is not None


async def test_an_evict_command_keeps_a_block_that_got_a_child_while_redis_answered(redis_url) -> None:
    async with parent_in_cpu_and_redis(redis_url, "recheck-evict") as node:
        rt = node.rt
        assert rt.placement.tiers[Tier.CPU].mark_leaving(PARENT)  # chosen, as the policy's shedding marks it
        asked = child_put_while_redis_answers(node)
        evictions = Evictions(Tier.CPU, Facts(Tier.CPU, node.log), node.log)
        await evictions.evict(rt, Evict("s", PARENT, Tier.CPU, Reason.CLEAN))
        assert asked == [[PARENT]], "the evictor asked Redis about the block it was told to drop"
        e = rt.cpu.index.get(PARENT)
        assert e is not None and rt.directory.get(PARENT)[1] >= 0, "still listed"
        assert not e.leaving, "refused: it may be chosen again later, its child first"
        assert rt.counters.tiers["cpu"].evicted == 0
