"""The population chore in-process, on real shared memory: several threads at once (chunks
finish out of order, come into service in slot order), a warm restore through them, and a mount
that fills up mid-population (the arena stops growing and serves what it has: no SIGBUS)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import structlog

from kvtier.config import ArenaConfig, PolicyConfig, PoolConfig, RedisConfig
from kvtier.core.events import Tier
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.daemon.population import ArenaPopulation
from kvtier.keys import BlockKey
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import checksum
from tests.support.mounts import mounted, need_root

pytestmark = pytest.mark.integration

LOG = structlog.get_logger()


def pool(blocks: int) -> PoolConfig:  # 32 KiB blocks
    return PoolConfig(name="p", model="m", layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16",
                      device="cpu", gpu_blocks=0, cpu_blocks=blocks)


def write_blocks(rt, n: int, seed: int) -> dict[BlockKey, bytes]:
    """n blocks written through the same calls a tier worker makes (reserve, fill, finish)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        key = BlockKey(rng.bytes(32))
        e = rt.placement.reserve(Tier.CPU, key, None)
        assert e is not None, f"no slot in service for block {i}"
        data = rng.integers(0, 255, rt.cpu.block_bytes, dtype=np.uint8)
        rt.cpu.fill(e, data, checksum(data))
        rt.finish(rt.cpu, e)
        out[key] = data.tobytes()
    return out


def read(rt, key: BlockKey) -> bytes | None:
    out = np.empty(rt.cpu.block_bytes, dtype=np.uint8)
    return None if rt.cpu.read(key, out) is None else out.tobytes()


async def test_three_threads_bring_every_chunk_in_and_restore_a_warm_arena():
    node = f"popthreads-{os.getpid()}"
    arena = ArenaConfig(populate_threads=3, populate_chunk=1 << 20)  # 32 slots a chunk, 32 chunks
    rt = open_pool(pool(1024), node, PolicyConfig(), None, RedisConfig(), None, LOG, arena)
    name = rt.cpu.table.seg.name
    try:
        assert rt.cpu.index.capacity == 32 and len(rt.arena.chunks) == 31
        seen: list[int] = []
        orig = rt.placement.bring_into_service

        def watch(t, slots):
            seen.append(min(slots))
            return orig(t, slots)

        rt.placement.bring_into_service = watch  # a spy on the order only; the call goes through
        await ArenaPopulation(rt, arena, LOG).run()
        assert seen == sorted(seen) and len(seen) == 31, "chunks come into service in slot order"
        assert rt.arena.state == "populated" and rt.cpu.index.capacity == 1024
        blocks = write_blocks(rt, 1000, seed=1)
        close_pool(rt, persist_arena=True)

        rt = open_pool(pool(1024), node, PolicyConfig(), None, RedisConfig(), None, LOG, arena)
        first = rt.arena.kept
        assert rt.arena.warm and 0 < first < 1000  # the first chunk only, before READY
        restored: list = []
        await ArenaPopulation(rt, arena, LOG, on_restored=lambda _p, es: restored.extend(es)).run()
        assert rt.arena.kept == 1000 and rt.arena.discarded == 0
        assert len(restored) == 1000 - first, "every block restored after READY is announced"
        assert all(read(rt, k) == v for k, v in blocks.items()), "a restored block reads back wrong"
        assert rt.cpu.index.capacity == 1024 and rt.cpu.index.free == 24
    finally:
        close_pool(rt, persist_arena=False)
        ShmSegment.unlink_name(name)


async def test_a_population_cut_short_is_finished_by_the_next_start():
    """What a kill -9 mid-population leaves: a file with holes. The next start allocates only the
    holes, restores what was written, and ends with every slot in service."""
    node = f"popholes-{os.getpid()}"
    arena = ArenaConfig(populate_threads=2, populate_chunk=1 << 20)
    rt = open_pool(pool(1024), node, PolicyConfig(), None, RedisConfig(), None, LOG, arena)
    name = rt.cpu.table.seg.name
    try:
        chunks = rt.arena.chunks
        for c in chunks[:5]:  # some of the population ran, then the daemon died
            rt.arena.apply_all(rt.arena.prepare(c), rt.placement)
        blocks = write_blocks(rt, 150, seed=3)
        close_pool(rt, persist_arena=True)  # nothing stops here that a kill would have run
        seg = ShmSegment.attach(name)
        held = (seg.size, os.stat(f"/dev/shm/{name}").st_blocks * 512)
        seg.close()
        assert held[1] < held[0] // 2, "the file has holes, as after a kill mid-population"

        rt = open_pool(pool(1024), node, PolicyConfig(), None, RedisConfig(), None, LOG, arena)
        assert rt.arena.warm and any(c.holes for c in rt.arena.chunks)
        assert not any(c.holes for c in rt.arena.chunks[:5]), "what was populated is not allocated again"
        await ArenaPopulation(rt, arena, LOG).run()
        assert rt.arena.state == "populated" and rt.arena.kept == 150
        assert rt.cpu.index.capacity == 1024 and os.stat(f"/dev/shm/{name}").st_blocks * 512 >= held[0] - 4096
        assert all(read(rt, k) == v for k, v in blocks.items())
    finally:
        close_pool(rt, persist_arena=False)
        ShmSegment.unlink_name(name)


async def test_a_mount_that_fills_up_mid_population_stops_it_cleanly(tmp_path: Path):
    need_root()
    with mounted("tmpfs", tmp_path / "small", "huge=within_size,size=64m") as small:
        arena = ArenaConfig(huge_pages="on", huge_pages_dir=str(small), populate_threads=2,
                            populate_chunk=4 << 20, numa_node="off")
        rt = open_pool(pool(1536), "popfull", PolicyConfig(), None, RedisConfig(), None, LOG, arena)  # 48 MiB
        try:
            first = rt.cpu.index.capacity
            assert 0 < first < 1536
            # Someone else takes most of the mount after the start's check passed.
            hog = small / "hog"
            with open(hog, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, 40 << 20)
            await ArenaPopulation(rt, arena, LOG).run()
            a = rt.arena.stats()
            assert a["state"] == "failed" and "No space left" in a["error"], a
            assert 0 < a["populated_bytes"] < a["bytes"] and a["in_service"] == rt.cpu.index.capacity < 1536
            # It serves with what it has: every slot in service takes a block and reads it back.
            blocks = write_blocks(rt, rt.cpu.index.capacity, seed=2)
            assert rt.placement.reserve(Tier.CPU, BlockKey(b"\1" * 32), None) is None, "no slot past the populated"
            assert all(read(rt, k) == v for k, v in blocks.items())
        finally:
            close_pool(rt, persist_arena=False)


async def test_population_goes_wide_only_while_the_daemon_is_idle():
    """populate_threads chunks at once while bus events flow, populate_threads_idle once none has
    come for the quiet time: the arena is whole sooner after a boot, and serving keeps its CPU."""
    from kvtier.daemon.population import Activity

    arena = ArenaConfig(populate_threads=1, populate_threads_idle=3, populate_chunk=1 << 20)
    for busy in (True, False):
        rt = open_pool(pool(1024), f"popwide-{os.getpid()}-{busy}", PolicyConfig(), None, RedisConfig(), None, LOG,
                       arena)
        name = rt.cpu.table.seg.name
        try:
            # busy: a new event each time the population looks; idle: never one
            count = iter(range(1 << 20)).__next__ if busy else (lambda: 0)
            pop = ArenaPopulation(rt, arena, LOG, activity=Activity(count))
            await pop.run()
            assert rt.arena.state == "populated" and rt.cpu.index.capacity == 1024
            assert pop.widest == (1 if busy else 3), pop.widest
        finally:
            close_pool(rt, persist_arena=False)
            ShmSegment.unlink_name(name)
