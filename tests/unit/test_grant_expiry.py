"""When the daemon takes a grant back (kvtier/tiers/grants.py): a real pool opened in-process (the
daemon's own open_pool), a real client staging segment and its ring, the clock passed in.

A grant still in the ring is never expired (the client may take it whenever it next puts); one
the client took is expired GRANT_EXPIRE_S after the daemon first saw it taken, which is after the
client's own use-by (GRANT_USE_S after it took it); a client that goes is forgotten whole.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import structlog

from kvtier.config import PolicyConfig, PoolConfig, RedisConfig
from kvtier.core.events import Tier
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.shm.grant_ring import GRANT_EXPIRE_S, GRANT_USE_S
from kvtier.shm.slots import Flags
from kvtier.shm.staging import StagingWriter
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.grants import GrantBook


async def _no_room(rt) -> bool:
    return False


def test_grants_expire_only_once_taken_and_after_the_clients_use_by() -> None:
    assert GRANT_EXPIRE_S > GRANT_USE_S + 10  # room for a write that started at the use-by
    log = structlog.wrap_logger(structlog.PrintLogger(open(os.devnull, "w")))  # noqa: SIM115
    node = f"test-exp-{uuid.uuid4().hex[:6]}"
    cfg = PoolConfig(name="s", model="m", layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16",
                     device="cpu", gpu_blocks=0, cpu_blocks=512)
    rt = open_pool(cfg, node, PolicyConfig(), None, RedisConfig(), None, log)
    staging = StagingSegments(node, log)
    w = StagingWriter.create(node, 4, rt.layout.block_bytes, rt.layout.fingerprint, daemon_uid=os.geteuid(),
                             shm_gid=None, arena=rt.cpu.table)
    try:
        idx = rt.placement.tiers[Tier.CPU]
        book = GrantBook({"s": rt}, staging, 4, log)
        book.renew(sorted(staging.present()))
        book.want("s", w.seg.name)
        assert asyncio.run(book.top_up(_no_room)) == 4 and idx.granted == 4
        t0 = 1000.0
        assert book.expire(t0 + 10 * GRANT_EXPIRE_S) == 0  # all still in the ring: the client's to take
        keys = [bytes([i]) * 32 for i in range(2)]
        taken = w.take_slots(keys, None)  # the client takes all 4 from its ring, and uses 2
        assert [b.granted for b in taken] == [True, True]
        w.unstage(taken)  # given up: the daemon takes them back on expiry
        assert book.expire(t0) == 0  # seen taken now: their time starts
        assert book.expire(t0 + GRANT_EXPIRE_S - 1) == 0
        assert book.expire(t0 + GRANT_EXPIRE_S + 1) == 4
        assert idx.granted == 0 and rt.counters.grants_reclaimed == 4
        for b in taken:
            h = rt.cpu.table.header(b.slot)
            assert h.flags == Flags.EMPTY and h.gen % 2 == 0
        book.want("s", w.seg.name)  # granted again; then the client goes, and they come back
        assert asyncio.run(book.top_up(_no_room)) == 4 and idx.granted == 4
        book.forget(w.seg.name)
        assert idx.granted == 0 and rt.counters.grants_reclaimed == 8
    finally:
        w.close(leave_uncounted=False)
        staging.close()
        close_pool(rt, persist_arena=False)
