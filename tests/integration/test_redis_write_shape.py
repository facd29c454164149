"""The Redis tier's two pipeline shapes (store/redis_blocks.py): SETs go in pipelines of
`write_pipeline_bytes`, GETs in pipelines of `pipeline_bytes`, against a real redis-server; every
value written reads back verified. SETs moved fastest in deeper pipelines than GETs on this host
(docs/performance.md, "Sixteenth stop")."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import structlog

from kvtier.bus.connect import make_blocks_redis
from kvtier.config.loader import load_config
from kvtier.shm.slots import checksum
from kvtier.store.redis_blocks import BLK_HDR, RedisBlocks

pytestmark = pytest.mark.integration

BLOCK = 4096


async def test_writes_and_reads_go_in_their_own_pipeline_shapes(redis_url: str) -> None:
    value = BLK_HDR.size + BLOCK
    client = make_blocks_redis(redis_url, socket_timeout=5.0, connect_timeout=2.0, retries=0)
    try:
        blocks = RedisBlocks(client, "shape", b"\1" * 32, BLOCK, 0, structlog.get_logger(),
                             pipeline_bytes=2 * value, write_pipeline_bytes=5 * value, connections=2)
        sizes: list[tuple[int, int | None]] = []  # (commands, per_pipeline) of each batch run
        real = blocks.batches.run

        async def run(commands, **shape):
            sizes.append((len(commands), shape.get("per_pipeline")))
            return await real(commands, **shape)

        blocks.batches.run = run  # type: ignore[method-assign]  # recorded, then the real one
        rows = np.random.default_rng(3).integers(0, 256, (11, BLOCK), dtype=np.uint8)
        keys = [hashlib.sha256(bytes([i])).digest() for i in range(11)]
        items = []
        for k, row in zip(keys, rows):
            v, view = blocks.new_value()
            view[:] = row
            items.append((k, blocks.seal(v, k, checksum(row))))
        assert await blocks.put_many(items) == [None] * 11
        assert sizes == [(11, 5)], "the SETs, cut into pipelines of write_pipeline_bytes"
        sizes.clear()
        got = await blocks.get_many(keys)
        assert sorted(n for n, _ in sizes) == [1, 2, 2, 2, 2, 2], "the GETs, in pipelines of pipeline_bytes"
        for (payload, csum), row in zip(got, rows):  # type: ignore[misc]
            assert np.array_equal(payload, row) and csum == checksum(row)
    finally:
        await client.aclose()


def test_the_write_shape_is_a_setting_of_its_own(tmp_path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[redis]\npipeline_bytes = "4MiB"\nwrite_pipeline_bytes = "32MiB"\n')
    cfg = load_config(path)
    assert (cfg.redis.pipeline_bytes, cfg.redis.write_pipeline_bytes) == (4 << 20, 32 << 20)
    assert load_config(None).redis.write_pipeline_bytes == 16 << 20
