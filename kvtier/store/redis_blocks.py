"""The redis tier's storage: `kvtier:blk:<pool>:<hex key>` -> fixed binary header + raw payload.

Header: magic 8s | version u16 | reserved u16 | layout fingerprint 32s | key 32s | length u64 |
checksum u64 (xxh3-64 of the payload). Nothing is pickled. Every value read back is verified
against the key asked for, the pool's layout and the checksum; a bad value is deleted, counted and
logged, and the read is a miss.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.errors import CorruptBlock
from kvtier.offload import run_off_loop
from kvtier.shm.slots import checksum
from kvtier.store.batches import batches_for
from kvtier.store.bulk_reads import Landing, WrongLength
from kvtier.store.commands import bounded_gather, pipelines
from kvtier.store.ops import EX, GT, Op

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kvtier.logs import Log

BLK_MAGIC = b"KVTBLK01"
BLK_VERSION = 1
BLK_HDR = struct.Struct("<8sHH32s32sQQ")
# A pipeline of values this big is verified in a thread, off the event loop (xxh3 releases the GIL).
VERIFY_OFF_LOOP_BYTES = 256 << 10
PIPELINE_BYTES = 8 << 20  # the most payload bytes in one pipeline
WRITE_PIPELINE_BYTES = 16 << 20  # ... of SETs: writes move fastest in deeper pipelines than reads
CONNECTIONS = 4  # pipelines of one batch in flight at once

_Out = TypeVar("_Out", bytearray, memoryview)
Verified: TypeAlias = tuple[npt.NDArray[np.uint8], int]  # a value's payload (a view of it) and checksum


def redis_block_key(pool: str, key: bytes) -> str:
    # No hash tag: blocks spread across Redis Cluster slots.
    return f"kvtier:blk:{pool}:{key.hex()}"


def pack_header(out: _Out, fingerprint: bytes, key: bytes, length: int, csum: int) -> _Out:
    BLK_HDR.pack_into(out, 0, BLK_MAGIC, BLK_VERSION, 0, fingerprint, key, length, csum)
    return out


def pack_block(fingerprint: bytes, key: bytes, payload: npt.NDArray[Any], csum: int) -> bytearray:
    out = bytearray(BLK_HDR.size + payload.nbytes)
    out[BLK_HDR.size:] = payload.reshape(-1).view(np.uint8).data
    return pack_header(out, fingerprint, key, payload.nbytes, csum)


def check_header(head: Any, fingerprint: bytes, key: bytes, block_bytes: int) -> int:
    """The checksum a value's header promises, once the header is shown to be this block's:
    raises CorruptBlock otherwise."""
    magic, ver, _r, fp, k, length, csum = BLK_HDR.unpack_from(head, 0)
    if magic != BLK_MAGIC or ver != BLK_VERSION:
        raise CorruptBlock("bad magic or version")
    if fp != fingerprint:
        raise CorruptBlock("value belongs to another layout")
    if k != key:
        raise CorruptBlock("value holds another key")
    if length != block_bytes:
        raise CorruptBlock(f"header length {length} != block size {block_bytes}")
    return int(csum)


def unpack_block(raw: bytes, fingerprint: bytes, key: bytes, block_bytes: int) -> Verified:
    """Verify a value read from Redis. Returns (payload view, checksum) or raises CorruptBlock."""
    if len(raw) != BLK_HDR.size + block_bytes:
        raise CorruptBlock(f"value is {len(raw)} bytes, expected {BLK_HDR.size + block_bytes}")
    csum = check_header(raw, fingerprint, key, block_bytes)
    payload = np.frombuffer(raw, dtype=np.uint8, count=block_bytes, offset=BLK_HDR.size)
    if checksum(payload) != csum:
        raise CorruptBlock("checksum mismatch")
    return payload, csum


@dataclass(slots=True)
class RedisBlockStats:
    corrupt: int = 0
    errors: int = 0


# Delete only the value we judged corrupt: another node may have written a good one since.
DELETE_IF_SAME = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisBlocks:
    """One pool's blocks in Redis (one server or a cluster: store/batches.py). Batched calls give
    each key its own outcome; errors from Redis are returned or raised, and the worker turns them
    into misses."""

    def __init__(self, client: AsyncRedis, pool: str, fingerprint: bytes, block_bytes: int,
                 ttl_s: int, log: Log, *, pipeline_bytes: int = PIPELINE_BYTES, connections: int = CONNECTIONS,
                 write_pipeline_bytes: int = WRITE_PIPELINE_BYTES) -> None:
        self.batches = batches_for(client)
        # Values per pipeline, and pipelines in flight (store/batches.py: shallow pipelines over a
        # few connections move big values fastest; SETs in deeper ones than GETs).
        self.per_pipeline = max(1, pipeline_bytes // (BLK_HDR.size + block_bytes))
        self.per_write_pipeline = max(1, write_pipeline_bytes // (BLK_HDR.size + block_bytes))
        self.connections = connections
        self.pool = pool
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.log = log.bind(pool=pool, tier="redis")
        self.stats = RedisBlockStats()

    def name(self, key: bytes) -> str:
        return redis_block_key(self.pool, key)

    async def _one(self, command: tuple[Any, ...]) -> Any:
        """One command through the batches too (on a cluster: its redirects and its master's
        health), its reply or the error raised."""
        (reply,) = await self.batches.run([command])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _ex(self) -> tuple[Any, ...]:
        return (EX, self.ttl_s) if self.ttl_s else ()

    async def put(self, key: bytes, payload: npt.NDArray[Any], csum: int) -> None:
        await self._one((Op.SET, self.name(key), pack_block(self.fingerprint, key, payload, csum), *self._ex()))

    async def put_many(self, items: list[tuple[bytes, memoryview]]) -> list[Exception | None]:
        """SET packed values (`seal`), pipelined; per item, None or the error Redis gave (on a
        cluster, a master that is down fails only the items it serves)."""
        replies = await self.batches.run([(Op.SET, self.name(key), value, *self._ex()) for key, value in items],
                                         per_pipeline=self.per_write_pipeline, width=self.connections)
        return [r if isinstance(r, Exception) else None for r in replies]

    async def retain(self, keys: Sequence[bytes], ttl_s: int) -> list[Exception | None]:
        """Keep the values of `keys` for at least `ttl_s` more seconds (EXPIRE GT: a longer time to
        live stays, an absent key stays absent); per key, None or the error Redis gave."""
        replies = await self.batches.run([(Op.EXPIRE, self.name(k), ttl_s, GT) for k in keys],
                                         per_pipeline=1024, width=self.connections)
        return [r if isinstance(r, Exception) else None for r in replies]

    def new_value(self) -> tuple[memoryview, npt.NDArray[np.uint8]]:
        """A value to fill in place, and a uint8 view of its payload part. Not zeroed (a
        bytearray would be: a wasted pass over 2 MiB); the caller fills all of it."""
        raw = np.empty(BLK_HDR.size + self.block_bytes, dtype=np.uint8)
        return raw.data, raw[BLK_HDR.size:]

    def seal(self, value: memoryview, key: bytes, csum: int) -> memoryview:
        """Write the header of a value filled through `new_value`."""
        return pack_header(value, self.fingerprint, key, self.block_bytes, csum)

    async def get_many(self, keys: Sequence[bytes]) -> list[Verified | None | Exception]:
        """GET, pipelined; per key the verified (payload, checksum), None when absent or corrupt
        (then deleted), or the error Redis gave."""
        return await self.fetch(keys)

    async def fetch(self, keys: Sequence[bytes], into: Callable[[int], npt.NDArray[np.uint8]] | None = None,
                    then: Callable[[int, Verified], object] | None = None,
                    executor: Executor | None = None) -> list[Verified | None | Exception]:
        """GET `keys` in pipelines of `per_pipeline`, `connections` at once. Each value's payload
        lands in `into(i)` (a writable uint8 array of block_bytes; a new one when None) straight
        from the socket (store/bulk_reads.py), and each pipeline's values are verified (header,
        key, layout, xxh3) as soon as it has landed, while the others are still on the wire; then
        `then(i, verified)` runs on the same thread (of `executor`; None: the loop's default),
        while the bytes are hot. A cancelled fetch returns only once those threads are done.
        Per key the verified (payload, checksum), None when absent or corrupt (then deleted and
        counted), or the error Redis gave. Only those verified may be used: what landed for any
        other is garbage."""
        out: list[Verified | None | Exception] = [None] * len(keys)
        heads = np.empty((len(keys), BLK_HDR.size), dtype=np.uint8)
        bodies = [into(i) if into is not None else np.empty(self.block_bytes, dtype=np.uint8) for i in range(len(keys))]

        async def part(idx: Sequence[int]) -> None:
            landed = await self.batches.run(
                [(Op.GET_INTO, self.name(keys[i]), Landing(heads[i].data, bodies[i].data)) for i in idx])
            found = []
            for i, got in zip(idx, landed):
                if got is True:
                    found.append(i)
                elif isinstance(got, WrongLength):
                    want = BLK_HDR.size + self.block_bytes
                    await self._drop_corrupt(keys[i], None, CorruptBlock(f"{got}, expected {want}"))
                else:
                    out[i] = got  # absent (None) or the error Redis gave

            def check() -> list[tuple[int, Verified | CorruptBlock]]:
                # pure (header parse, xxh3) and the caller's `then`: it may run in a thread
                done: list[tuple[int, Verified | CorruptBlock]] = []
                for i in found:
                    try:
                        csum = check_header(heads[i], self.fingerprint, keys[i], self.block_bytes)
                        if checksum(bodies[i]) != csum:
                            raise CorruptBlock("checksum mismatch")
                    except CorruptBlock as e:
                        done.append((i, e))
                        continue
                    if then is not None:
                        then(i, (bodies[i], csum))
                    done.append((i, (bodies[i], csum)))
                return done

            big = len(found) * self.block_bytes >= VERIFY_OFF_LOOP_BYTES
            for i, verdict in (await run_off_loop(executor, check) if big else check()):
                if isinstance(verdict, CorruptBlock):
                    await self._drop_corrupt(keys[i], bytes(heads[i]) + bytes(bodies[i]), verdict)
                else:
                    out[i] = verdict

        await bounded_gather(self.connections, [part(idx) for idx in pipelines(range(len(keys)), self.per_pipeline)])
        return out

    async def get(self, key: bytes) -> Verified | None:
        """The verified payload and checksum, or None when absent or corrupt (then deleted)."""
        raw = await self._one((Op.GET, self.name(key)))
        if raw is None:
            return None
        return await self._verified(key, cast(bytes, raw))  # decode_responses=False: never str

    async def _verified(self, key: bytes, raw: bytes) -> Verified | None:
        try:
            return unpack_block(raw, self.fingerprint, key, self.block_bytes)
        except CorruptBlock as e:
            await self._drop_corrupt(key, raw, e)
            return None

    async def _drop_corrupt(self, key: bytes, raw: bytes | None, e: CorruptBlock) -> None:
        """Count and log a corrupt value, and delete it unless it has been rewritten since (the
        value judged is `raw`, or when it was not kept, read again)."""
        self.stats.corrupt += 1
        self.log.warning("redis.corrupt_block", key=key.hex(), reason=str(e))
        try:
            if raw is None:
                again = await self._one((Op.GET, self.name(key)))
                if not isinstance(again, bytes) or len(again) == BLK_HDR.size + self.block_bytes:
                    return  # gone, or rewritten to the right size meanwhile: judged on its next read
                raw = again
            digest = hashlib.sha1(raw, usedforsecurity=False).hexdigest()
            await self._one((Op.EVAL, DELETE_IF_SAME, 1, self.name(key), digest))  # a rare path: no EVALSHA cache
        except REDIS_ERRORS as de:
            self.log.warning("redis.delete_failed", key=key.hex(), error=str(de))

    async def aclose(self) -> None:
        """Close the bulk-read connections; the Redis client is its owner's."""
        await self.batches.aclose()

    async def delete(self, key: bytes) -> bool:
        return bool(await self._one((Op.DEL, self.name(key))))

    async def exists(self, keys: list[bytes]) -> list[bool | Exception]:
        """Per key, whether Redis holds it, or the error that kept it from answering."""
        replies = await self.batches.run([(Op.EXISTS, self.name(k)) for k in keys])
        return [r if isinstance(r, Exception) else bool(r) for r in replies]
