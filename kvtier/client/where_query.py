"""The cluster prefix index, read: one chain's answer (core/where.py) from the blocks Redis.

The router wants the nodes with the longest leading run, not every holder of every block (a
popular prompt's first blocks may have a thousand). Blocks leave a node leaf first, so what a
node holds of a chain is a prefix, and the deepest block anyone holds ends the longest runs:
1. HLEN of each block's index hash and EXISTS of the block itself, in chunks, up to the first
   block nobody holds (the candidates' run) and the first Redis lacks (Redis's run);
2. HGETALL of the deepest block held: its holders are the candidates;
3. HMGET of up to `limit` candidates' fields on every block of the run: their exact runs and
   tiers (a node with a gap gets the shorter run it has).
Three small replies per block, where reading every holder's field would move them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.core.where import TIER_RANK, Where, candidate_fields, holders, leading, verified_runs, where_key
from kvtier.keys import BlockKey
from kvtier.store.commands import Command, KeyBatches
from kvtier.store.redis_blocks import redis_block_key

WHERE_CHUNK = 256  # keys per pipeline
WHERE_LIMIT = 8  # candidates verified and named


async def _run(batches: KeyBatches, cmds: Sequence[Command]) -> list[Any]:
    got = await batches.run(cmds)
    err = next((a for a in got if isinstance(a, Exception)), None)
    if err is not None:
        raise err
    return got


async def query_where(batches: KeyBatches, pool: str, keys: Sequence[BlockKey], *, limit: int = WHERE_LIMIT,
                      chunk: int = WHERE_CHUNK, tries: int = 3) -> Where:
    """Redis errors raise. When the deepest block's holders leave between the reads (another
    node's HDEL landed meanwhile), the answer is asked again, up to `tries` times: the shorter
    runs other nodes still hold are the answer then, not an empty one."""
    for _ in range(tries - 1):
        answer, settled = await _query(batches, pool, keys, limit, chunk)
        if settled:
            return answer
    return (await _query(batches, pool, keys, limit, chunk))[0]


async def _query(batches: KeyBatches, pool: str, keys: Sequence[BlockKey], limit: int, chunk: int
                 ) -> tuple[Where, bool]:
    """One try, and whether it settled: False when the deepest block held had no holders left by
    the time it was read."""
    counts: list[Any] = []
    in_redis: list[Any] = []
    for at in range(0, len(keys), chunk):
        part = keys[at:at + chunk]
        got = await _run(batches, [("HLEN", where_key(pool, k)) for k in part]
                         + [("EXISTS", redis_block_key(pool, bytes(k))) for k in part])
        counts.extend(got[:len(part)])
        in_redis.extend(got[len(part):])
        if leading(counts) < len(counts) and leading(in_redis) < len(in_redis):
            break
    held = leading(counts)
    redis_length = leading(in_redis)
    if held == 0:
        return Where(0, (), redis_length), True
    deepest = await _run(batches, [("HGETALL", where_key(pool, keys[held - 1]))])
    held_by = holders(deepest[0])  # {node: best tier}: gpu holders first, then by name
    nodes = sorted(held_by, key=lambda n: (TIER_RANK[held_by[n]], n))[:limit]
    if not nodes:  # the deepest block's holders left between the two reads: ask again
        return Where(0, (), redis_length), False
    fields = candidate_fields(nodes)
    replies: list[Any] = []
    for at in range(0, held, chunk):
        part = keys[at:min(at + chunk, held)]
        replies.extend(await _run(batches, [("HMGET", where_key(pool, k), *fields) for k in part]))
    runs = verified_runs(nodes, replies)
    return Where(runs[0].length if runs else 0, tuple(runs), redis_length), True
