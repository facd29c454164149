"""put_with / get_with: blocks gathered from and read into memory of the caller's own layout (what
the vLLM connector does with per-layer pages), verified like any other read."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.client import Client, checksum, checksum_stream
from kvtier.shm.slots import checksum_parts
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration
BLOCK_BYTES = 8192  # the test pool: 2 layers x 2 x 2 heads x 16 tokens x 32 dims x float16
LAYERS = 4  # the caller's own split of a block: four pages of 2 KiB, in separate arrays


def pages(blocks: int, seed: int | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    make = (lambda: rng.integers(0, 256, (blocks, BLOCK_BYTES // LAYERS), dtype=np.uint8)) if seed is not None \
        else (lambda: np.zeros((blocks, BLOCK_BYTES // LAYERS), dtype=np.uint8))
    return [make() for _ in range(LAYERS)]


async def test_scattered_blocks_round_trip_and_a_bad_digest_ends_the_prefix(daemon_factory):
    d = daemon_factory()
    src = pages(6, seed=5)
    step = BLOCK_BYTES // LAYERS
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 5)), salt=b"scattered")

        def fill(i: int, dst: np.ndarray) -> None:  # block i is row i + 1 of every page array
            for layer, p in enumerate(src):
                dst[layer * step:(layer + 1) * step] = p[i + 1]

        res = await client.put_with("t", keys, fill)
        assert (res.staged, res.dropped) == (5, 0)
        assert await client.wait_resident("t", keys, timeout=10)

        dst = pages(6)
        rows = [5, 0, 3, 1, 2]  # where block i lands: any order, as vLLM's block ids are

        def copy_out(i: int, blk: np.ndarray) -> None:
            for layer, p in enumerate(dst):
                p[rows[i]] = blk[layer * step:(layer + 1) * step]

        def digest(i: int) -> int:
            return checksum_parts(p[rows[i]] for p in dst)

        assert await client.get_with("t", keys, copy_out, digest) == 5
        for i in range(5):
            assert all(np.array_equal(dst[layer][rows[i]], src[layer][i + 1]) for layer in range(LAYERS))

        # A destination that does not hold what was copied (here: hashed from the wrong row)
        # fails verification, and the prefix ends there.
        def wrong_digest(i: int) -> int:
            return checksum_parts(p[rows[i] if i != 2 else 4] for p in dst)

        assert await client.get_with("t", keys, copy_out, wrong_digest) == 2


async def test_a_fill_that_returns_its_own_checksum(daemon_factory):
    """`fill` may hand back the xxh3 of what it wrote, hashed piece by piece as it wrote (what the
    vLLM connector does): the slot is stored under that checksum without a second hash pass. The
    daemon still verifies the slot, so a fill that returns a wrong checksum costs its block, a
    dropped put counted by the daemon, and never bytes that do not match."""
    d = daemon_factory()
    src = pages(4, seed=9)
    step = BLOCK_BYTES // LAYERS
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 3)), salt=b"one-pass")

        def fill(i: int, dst: np.ndarray) -> int:
            h = checksum_stream()
            for layer, p in enumerate(src):
                piece = dst[layer * step:(layer + 1) * step]
                piece[:] = p[i]
                h.update(piece)
            return h.intdigest() if i != 1 else h.intdigest() ^ 1  # block 1 lies about its bytes

        res = await client.put_with("t", keys, fill)
        assert (res.staged, res.dropped) == (3, 0)
        assert await client.wait_resident("t", keys[:1], timeout=10)
        await async_wait_until(lambda: d.pool_stats().get("puts_dropped", 0) >= 1, message="the lying block dropped")
        out = np.zeros((3, BLOCK_BYTES), np.uint8)

        def copy_out(i: int, blk: np.ndarray) -> None:
            out[i] = blk

        assert await client.get_with("t", keys, copy_out, lambda i: checksum(out[i])) == 1
        assert np.array_equal(out[0], np.concatenate([p[0] for p in src]))
        assert client.lookup("t", keys).length == 1  # block 1 never became visible, so nor did 2's prefix
