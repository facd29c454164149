"""A pool opened in-process as the daemon opens it (kvtier/daemon/pools.py), with a client's
staging segment mapped to write the pool's arena: for the unit tests of the grant book."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from kvtier.config import PolicyConfig, PoolConfig, RedisConfig
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.logs import Log
from kvtier.shm.staging import StagingWriter
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.pool import PoolRuntime


async def no_room(rt: PoolRuntime) -> bool:
    """A top-up's make_room that frees nothing."""
    return False


@contextmanager
def grant_pool(prefix: str, policy: PolicyConfig | None = None, redis_client=None
               ) -> Iterator[tuple[PoolRuntime, StagingSegments, StagingWriter, Log]]:
    """Pool "s" (512 cpu slots of 4 KiB), the daemon's view of staging, one client's 4-slot
    staging writer, and a log to nowhere; all closed after. `policy`: the pool's (default: the
    defaults). `redis_client`: where the pool's Redis tier keeps its blocks (a real server's
    client, for the integration tests; the caller closes it)."""
    log = structlog.wrap_logger(structlog.PrintLogger(open(os.devnull, "w")))  # noqa: SIM115
    node = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cfg = PoolConfig(name="s", model="m", layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16",
                     device="cpu", gpu_blocks=0, cpu_blocks=512)
    rt = open_pool(cfg, node, policy or PolicyConfig(), redis_client, RedisConfig(), None, log)
    staging = StagingSegments(node, log)
    w = StagingWriter.create(node, 4, rt.layout.block_bytes, rt.layout.fingerprint, daemon_uid=os.geteuid(),
                             shm_gid=None, arena=rt.cpu.table)
    try:
        yield rt, staging, w, log
    finally:
        w.close(leave_uncounted=False)
        staging.close()
        close_pool(rt, persist_arena=False)
