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


async def put_and_read_back(client: Client, salt: bytes, n: int, seed: int, timeout: float = 20.0):
    """Put an n-block chain, wait until it is resident locally, and get it back byte-exact.
    Returns (keys, kv)."""
    keys = client.block_keys("t", list(range(16 * n)), salt=salt)
    kv = make_kv(n, seed=seed)
    assert (await client.put("t", keys, kv)).staged == n
    assert await client.wait_resident("t", keys, timeout=timeout)
    out = torch.empty((n, *SHAPE), dtype=torch.float16)
    assert await client.get("t", keys, out) == n and same_bytes(out, kv)
    return keys, kv
