"""A pool opened in-process as the daemon opens it (kvtier/daemon/pools.py), with a client's
staging segment mapped to write the pool's arena, and the daemon's Coordinator adopting that
client's granted puts: for the tests of the grant book and of in-process adoption."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import structlog

from kvtier.bus.batch import Delivery
from kvtier.bus.streams import StreamNames
from kvtier.config import PolicyConfig, PoolConfig, RedisConfig
from kvtier.core.events import Envelope, Put
from kvtier.core.fence import CommandFence
from kvtier.daemon.coordinator import Coordinator
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.keys import BlockKey
from kvtier.logs import Log
from kvtier.shm.staging import StagingWriter
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.granted_puts import GrantedPuts
from kvtier.tiers.grants import GrantBook
from kvtier.tiers.pool import PoolRuntime

EPOCH = 7  # the daemon publisher's epoch in Streams' stamps


class Streams:
    """The daemon's publisher in process: what each flush published, its seqs, and a failure to
    raise on the next publish when set."""

    def __init__(self) -> None:
        self.seq = 0
        self.sent: list[tuple[str, object]] = []
        self.fail: Exception | None = None

    def stamp(self) -> tuple[int, int]:
        self.seq += 1
        return EPOCH, self.seq

    async def publish_many(self, items) -> None:
        self.seq += len(items)
        if self.fail is not None:
            e, self.fail = self.fail, None
            raise e
        self.sent.extend(items)


def adopting_coordinator(rt: PoolRuntime, staging: StagingSegments, w: StagingWriter, log: Log, grants: int,
                         streams: Streams, queued: Callable[[str, Iterable[BlockKey]], bool] = lambda pool, keys: False,
                         on_facts: Callable[[str, list], object] = lambda pool, facts: None
                         ) -> tuple[Coordinator, GrantBook, CommandFence]:
    """The daemon's Coordinator adopting granted puts in-process, its grant book (which grants
    `w`'s client up to `grants` slots at its next top-up) and the cpu worker's command fence.
    `queued`: whether the cpu worker has work queued for any of (pool, keys)."""
    book = GrantBook({"s": rt}, staging, grants, log)
    book.renew(sorted(staging.present()))
    book.want("s", w.seg.name)
    fence = CommandFence(4096)
    adopter = GrantedPuts(book, fence, queued, streams.stamp, log)
    coord = Coordinator({"s": rt}, staging, streams, StreamNames("granted"), log, on_facts=on_facts, grants=book,
                        granted_puts=adopter)
    return coord, book, fence


def put_delivery(put: Put, seq: int) -> Delivery:
    """A client's put as the coordinator gets it from the client stream."""
    return Delivery("client", b"%d-0" % seq, Envelope(event=put, producer="client", epoch=1, seq=seq))


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
