"""The client's reads: `get` into a tensor and `get_with` into the caller's own memory, from this
node's shared memory and, with `remote=True`, from Redis (client/remote.py).

Every block is verified where it lands (seqlock, key and xxh3 for shared memory; header, key,
layout and xxh3 for Redis); the answer is the leading run of verified blocks. A mixin of Client,
which provides the pools, the copy threads, the read reports and the read-through.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvtier.client.access import AccessReports
from kvtier.client.pools import ClientPool
from kvtier.client.remote import RemoteReads, Through
from kvtier.client.results import ClientStats, Lookup, ReadCounts
from kvtier.errors import RedisUnavailable
from kvtier.keys import BlockKey, check_keys
from kvtier.logs import LogThrottle
from kvtier.offload import SHARED_MIN_BLOCK, SHARED_MIN_BLOCK_BATCHED, CopyThreads, share_threads
from kvtier.shm.onepass import COMPILED

T = TypeVar("T")  # what a copy works through (block indexes, staged blocks)
R = TypeVar("R")  # what it answers per item
CopyOut = Callable[[int, npt.NDArray[np.uint8]], object]  # copy_out(i, src): block i from src into the caller's memory


class ClientReads:
    _copier: CopyThreads | None
    _copy_threads: int
    off_loop_bytes: int
    _access: AccessReports
    _remote: RemoteReads
    stats: ClientStats
    quiet: LogThrottle

    if TYPE_CHECKING:  # the other parts of Client (declared for the type checker only: a stub
        # here would shadow the real method in the Client's method order)
        def pool(self, name: str) -> ClientPool: ...
        def lookup(self, pool: str, keys: Sequence[bytes]) -> Lookup: ...
        async def prefetch(self, pool: str, keys: Sequence[bytes], *, parent: bytes | None = None) -> None: ...
        async def wait_resident(self, pool: str, keys: Sequence[bytes], timeout: float = 5.0) -> bool: ...

    async def get(self, pool: str, keys: Sequence[bytes], out: torch.Tensor, *, remote: bool = False,
                  counts: ReadCounts | None = None) -> int:
        """Copy the leading blocks of `keys` into out[0..n) (CPU or CUDA tensor [>=len(keys), *block_shape]).
        Returns n, the number of leading blocks read and verified. Only out[:n] is meaningful:
        rows from n on may hold bytes of copies that failed verification or came after a miss.

        `remote=True` (read-through, client/remote.py): each block of the leading run comes from
        wherever it is, this node's shared memory or Redis (straight into `out`), verified; a
        block found in neither ends the run. The daemon hears of the Redis reads and may bring
        those blocks up. It never waits for room in a local tier, and a Redis outage costs at
        most `remote_timeout` seconds."""
        p = self.pool(pool)
        p.check_tensor(out, len(keys), "out")
        return await self._read(p, check_keys(keys), TensorRows(self, p, out), remote, counts)

    async def get_with(self, pool: str, keys: Sequence[bytes], copy_out: CopyOut, digest: Callable[[int], int], *,
                       remote: bool = False, land: Callable[[int], npt.NDArray[np.uint8] | None] | None = None,
                       counts: ReadCounts | None = None) -> int:
        """`get` into host memory of the caller's own layout: `copy_out(i, src)` copies block i
        from its slot (`src`, uint8, block_bytes) and `digest(i)` returns the xxh3-64 of what it
        wrote, in block order; a block whose digest or seqlock does not check out ends the prefix.
        With `remote=True` blocks not on this node come from Redis: straight into `land(i)` when
        it gives a contiguous uint8 array of block_bytes (the caller's page: verified where it
        landed), else through a buffer and `copy_out`, checked by `digest`. Returns n as get
        does; what was written for blocks from n on must not be used. `counts`, when given, gets
        this call's own figures (local and Redis reads)."""
        p = self.pool(pool)
        return await self._read(p, check_keys(keys), CallerRows(self, p, copy_out, digest, land), remote,
                                counts)

    async def _read(self, p: ClientPool, bkeys: list[BlockKey], rows: Rows, remote: bool,
                    counts: ReadCounts | None = None) -> int:
        ok = await rows.read(range(len(bkeys)), bkeys)
        n = len(ok) if all(ok) else ok.index(False)  # the leading run of hits (in C: thousands of blocks)
        from_redis = 0
        if remote and n < len(bkeys):
            if self._remote.denied:
                n += await self._pull(p, bkeys, rows, n)
            else:
                got = await self._remote.read(p, bkeys, n, self._copier_for(len(bkeys) - n, p), rows)
                for first, last in _runs(got.remote):  # each run read from Redis, with its parent
                    self._access.note_remote(p.name, bkeys[first:last + 1], bkeys[first - 1] if first else None)
                if not got.n and self._remote.denied:
                    got = Through(await self._pull(p, bkeys, rows, n), [])
                from_redis = len(got.remote)
                n += got.n
        self.stats.reads += n
        self.stats.read_misses += len(bkeys) - n
        self._access.note(p.name, bkeys[:n], len(bkeys) - n)
        if counts is not None:
            counts.local, counts.remote = n - from_redis, from_redis
        return n

    async def _pull(self, p: ClientPool, bkeys: list[BlockKey], rows: Rows, start: int) -> int:
        """Read-through for credentials that may not read blocks: the daemon pulls them up
        (prefetch), then a local read, within remote_timeout."""
        try:
            await self.prefetch(p.name, bkeys[start:], parent=bkeys[start - 1] if start else None)
        except RedisUnavailable as e:
            self.stats.event_errors += 1
            self.quiet.warning("client.pull_failed", pool=p.name, error=str(e))
            return 0
        await self.wait_resident(p.name, bkeys, timeout=self._remote.timeout)
        ok = await rows.read(range(start, len(bkeys)), bkeys)
        return next((i for i, hit in enumerate(ok) if not hit), len(ok))

    def _copier_for(self, blocks: int, p: ClientPool) -> CopyThreads | None:
        """The copy threads for a read-through's verification, once it is big enough for them."""
        if blocks * p.block_bytes < self.off_loop_bytes:
            return None
        if self._copier is None:
            self._copier = CopyThreads(self._copy_threads)
        return self._copier

    async def _copy(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], nbytes: int,
                    threads: int | None = None) -> list[R]:
        """fn over items: inline when small, else in this client's copy threads, off the caller's
        event loop. A GPU destination uses one thread (its pinned bounce buffer is per pool)."""
        return await self._start_copy(fn, items, nbytes, threads)

    def _start_copy(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], nbytes: int,
                    threads: int | None = None, inline: bool = False) -> Coroutine[Any, Any, list[R]]:
        """`_copy`, started now (an inline copy is done when this returns): the caller may work
        meanwhile, and must then await what this returns, which waits for every share. `inline`:
        on the loop whatever its size (the caller bounds it)."""
        if inline or nbytes < self.off_loop_bytes or not items:
            return _ready(fn(items))
        if self._copier is None:
            self._copier = CopyThreads(self._copy_threads)
        return self._copier.start_shares(fn, items, threads or self._copy_threads)


class Rows:
    """Where a read's blocks go, row by row (the read-through's destination: client/remote.py)."""

    def __init__(self, client: ClientReads, p: ClientPool) -> None:
        self._client, self._p = client, p

    def listed(self, key: BlockKey) -> bool:
        """This node's directory names a slot for `key` (a hint: the read verifies)."""
        return self._p.locate(key) is not None

    async def read(self, rows: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        """Verified copies of keys[i] from shared memory into row i, for i in rows."""
        raise NotImplementedError

    def landing(self, row: int) -> npt.NDArray[np.uint8] | None:
        """A contiguous uint8 array of block_bytes where a Redis value for `row` may land and be
        verified in place, or None (it lands in a buffer and `deliver` copies it)."""
        raise NotImplementedError

    def deliver(self, row: int, payload: npt.NDArray[np.uint8], checksum: int) -> bool:
        """A verified Redis value for `row` (its payload, where it landed): whether it is now in
        the row intact. Runs in the read-through's verification thread."""
        raise NotImplementedError


class TensorRows(Rows):
    """The rows of a caller's tensor (host or CUDA)."""

    def __init__(self, client: ClientReads, p: ClientPool, out: torch.Tensor) -> None:
        super().__init__(client, p)
        self._out = out

    async def read(self, rows: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        p, out = self._p, self._out
        host = out.detach().view(torch.uint8).reshape(len(out), -1).numpy() if out.device.type == "cpu" else None

        def read(share: Sequence[int]) -> list[bool]:
            if host is not None:  # the batch path: per-block work vectorised (ClientPool.read_rows)
                return p.read_rows([keys[i] for i in share], host, share)
            return [p.read(keys[i], out[i]) for i in share]

        nbytes = len(rows) * p.block_bytes
        # Small blocks in one thread unless the copy is compiled (offload.share_threads: else the
        # batch path's per-block Python holds the GIL); a GPU destination in one (its pinned
        # bounce buffer is per pool).
        small = SHARED_MIN_BLOCK_BATCHED if COMPILED else SHARED_MIN_BLOCK
        threads = share_threads(self._client._copy_threads, len(rows), nbytes, small) if host is not None else 1
        with p.in_use():
            return await self._client._copy(read, rows, nbytes, threads=threads)

    def landing(self, row: int) -> npt.NDArray[np.uint8] | None:
        if self._out.device.type != "cpu":
            return None  # lands in host memory, copied over once verified
        return self._out[row].view(torch.uint8).reshape(-1).numpy()

    def deliver(self, row: int, payload: npt.NDArray[np.uint8], checksum: int) -> bool:
        if self._out.device.type != "cpu":
            self._out[row].view(torch.uint8).reshape(-1).copy_(torch.from_numpy(payload))
        return True


class CallerRows(Rows):
    """Blocks in the caller's own layout (`get_with`): copied out by the caller, checked by its digest."""

    def __init__(self, client: ClientReads, p: ClientPool, copy_out: CopyOut, digest: Callable[[int], int],
                 land: Callable[[int], npt.NDArray[np.uint8] | None] | None) -> None:
        super().__init__(client, p)
        self._copy_out, self._digest, self._land = copy_out, digest, land
        self._landed: set[int] = set()

    async def read(self, rows: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]:
        p, copy_out, digest = self._p, self._copy_out, self._digest

        def read_one(i: int) -> bool:
            return p.read_with(keys[i], lambda src: copy_out(i, src), lambda: digest(i))

        def read(share: Sequence[int]) -> list[bool]:
            return [read_one(i) for i in share]

        with p.in_use():
            return await self._client._copy(read, rows, len(rows) * p.block_bytes)

    def landing(self, row: int) -> npt.NDArray[np.uint8] | None:
        dst = self._land(row) if self._land is not None else None
        if dst is None or dst.dtype != np.uint8 or dst.nbytes != self._p.block_bytes or not dst.flags.c_contiguous \
                or not dst.flags.writeable:
            return None
        self._landed.add(row)
        return dst

    def deliver(self, row: int, payload: npt.NDArray[np.uint8], checksum: int) -> bool:
        if row in self._landed:
            return True  # verified where it landed, in the caller's memory
        self._copy_out(row, payload)
        return self._digest(row) == checksum


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs of consecutive ones: [(first, last), ...]."""
    runs: list[tuple[int, int]] = []
    for i in rows:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


async def _ready(value: R) -> R:
    """An awaitable of what is already there (awaited, it does not yield to the loop)."""
    return value
