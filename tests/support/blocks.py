"""Blocks for the integration tests: the test pool's shape, deterministic block bytes, and a put
that waits until the daemon has stored it (test modules share these; none imports another)."""

from __future__ import annotations

import torch

from kvtier.client import Client
from tests.support.waiting import async_wait_until

SHAPE = (2, 2, 2, 16, 32)  # the test pool's block shape (8 KiB of float16)


def make_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-30000, 30000, (n, *SHAPE), generator=g, dtype=torch.int16).view(torch.float16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def stored_somewhere(client: Client, keys) -> bool:
    """Every key is resident locally or in Redis (a put lands in Redis when no local tier has room)."""
    for k in keys:
        found = await client.locate("t", [k])
        if found.length + found.redis_length == 0:
            return False
    return True


async def put_chain(client: Client, keys, kv) -> None:
    """Put a chain and wait until the daemon has stored all of it."""
    res = await client.put("t", keys, kv)
    assert res.dropped == 0
    await async_wait_until(lambda: stored_somewhere(client, keys), timeout=10, message="put stored")
