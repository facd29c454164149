"""The redis tier's storage: `kvtier:blk:<pool>:<hex key>` -> fixed binary header + raw payload.

Header: magic 8s | version u16 | reserved u16 | layout fingerprint 32s | key 32s | length u64 |
checksum u64 (xxh3-64 of the payload). Nothing is pickled. Every value read back is verified
against the key asked for, the pool's layout and the checksum; a bad value is deleted, counted and
logged, and the read is a miss.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.errors import CorruptBlock
from kvtier.offload import map_shares
from kvtier.shm.slots import checksum
from kvtier.store.batches import batches_for

if TYPE_CHECKING:
    from kvtier.logs import Log

BLK_MAGIC = b"KVTBLK01"
BLK_VERSION = 1
BLK_HDR = struct.Struct("<8sHH32s32sQQ")
# A batch of values this big is verified in threads, off the event loop (xxh3 releases the GIL).
VERIFY_OFF_LOOP_BYTES = 256 << 10
VERIFY_THREADS = 2

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


def unpack_block(raw: bytes, fingerprint: bytes, key: bytes, block_bytes: int) -> Verified:
    """Verify a value read from Redis. Returns (payload view, checksum) or raises CorruptBlock."""
    if len(raw) != BLK_HDR.size + block_bytes:
        raise CorruptBlock(f"value is {len(raw)} bytes, expected {BLK_HDR.size + block_bytes}")
    magic, ver, _r, fp, k, length, csum = BLK_HDR.unpack_from(raw, 0)
    if magic != BLK_MAGIC or ver != BLK_VERSION:
        raise CorruptBlock("bad magic or version")
    if fp != fingerprint:
        raise CorruptBlock("value belongs to another layout")
    if k != key:
        raise CorruptBlock("value holds another key")
    if length != block_bytes:
        raise CorruptBlock(f"header length {length} != block size {block_bytes}")
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
                 ttl_s: int, log: Log) -> None:
        self.batches = batches_for(client)
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
        return ("EX", self.ttl_s) if self.ttl_s else ()

    async def put(self, key: bytes, payload: npt.NDArray[Any], csum: int) -> None:
        await self._one(("SET", self.name(key), pack_block(self.fingerprint, key, payload, csum), *self._ex()))

    async def put_many(self, items: list[tuple[bytes, memoryview]]) -> list[Exception | None]:
        """SET packed values (`seal`), pipelined; per item, None or the error Redis gave (on a
        cluster, a master that is down fails only the items it serves)."""
        replies = await self.batches.run([("SET", self.name(key), value, *self._ex()) for key, value in items])
        return [r if isinstance(r, Exception) else None for r in replies]

    def new_value(self) -> tuple[memoryview, npt.NDArray[np.uint8]]:
        """A value to fill in place, and a uint8 view of its payload part. Not zeroed (a
        bytearray would be: a wasted pass over 2 MiB); the caller fills all of it."""
        raw = np.empty(BLK_HDR.size + self.block_bytes, dtype=np.uint8)
        return raw.data, raw[BLK_HDR.size:]

    def seal(self, value: memoryview, key: bytes, csum: int) -> memoryview:
        """Write the header of a value filled through `new_value`."""
        return pack_header(value, self.fingerprint, key, self.block_bytes, csum)

    async def get_many(self, keys: list[bytes]) -> list[Verified | None | Exception]:
        """GET, pipelined; per key the verified (payload, checksum), None when absent or corrupt
        (then deleted), or the error Redis gave."""
        replies = await self.batches.run([("GET", self.name(k)) for k in keys])
        values = [(k, raw) for k, raw in zip(keys, replies) if isinstance(raw, bytes)]

        def check(share: Sequence[tuple[bytes, bytes]]) -> list[Verified | CorruptBlock]:
            # pure (header parse, xxh3), so it may run in threads
            out: list[Verified | CorruptBlock] = []
            for k, raw in share:
                try:
                    out.append(unpack_block(raw, self.fingerprint, k, self.block_bytes))
                except CorruptBlock as e:
                    out.append(e)
            return out

        if len(values) * self.block_bytes >= VERIFY_OFF_LOOP_BYTES:
            checked = await map_shares(None, check, values, VERIFY_THREADS)
        else:
            checked = check(values)
        verdicts = iter(checked)
        out: list[Verified | None | Exception] = []
        for k, raw in zip(keys, replies):
            if not isinstance(raw, bytes):
                out.append(raw)  # absent (None) or the error Redis gave
            elif isinstance(c := next(verdicts), CorruptBlock):
                await self._drop_corrupt(k, raw, c)
                out.append(None)
            else:
                out.append(c)
        return out

    async def get(self, key: bytes) -> Verified | None:
        """The verified payload and checksum, or None when absent or corrupt (then deleted)."""
        raw = await self._one(("GET", self.name(key)))
        if raw is None:
            return None
        return await self._verified(key, cast(bytes, raw))  # decode_responses=False: never str

    async def _verified(self, key: bytes, raw: bytes) -> Verified | None:
        try:
            return unpack_block(raw, self.fingerprint, key, self.block_bytes)
        except CorruptBlock as e:
            await self._drop_corrupt(key, raw, e)
            return None

    async def _drop_corrupt(self, key: bytes, raw: bytes, e: CorruptBlock) -> None:
        """Count and log a corrupt value, and delete it unless it has been rewritten since."""
        self.stats.corrupt += 1
        self.log.warning("redis.corrupt_block", key=key.hex(), reason=str(e))
        try:
            digest = hashlib.sha1(raw, usedforsecurity=False).hexdigest()
            await self._one(("EVAL", DELETE_IF_SAME, 1, self.name(key), digest))  # a rare path: no EVALSHA cache
        except REDIS_ERRORS as de:
            self.log.warning("redis.delete_failed", key=key.hex(), error=str(de))

    async def delete(self, key: bytes) -> bool:
        return bool(await self._one(("DEL", self.name(key))))

    async def exists(self, keys: list[bytes]) -> list[bool | Exception]:
        """Per key, whether Redis holds it, or the error that kept it from answering."""
        replies = await self.batches.run([("EXISTS", self.name(k)) for k in keys])
        return [r if isinstance(r, Exception) else bool(r) for r in replies]
