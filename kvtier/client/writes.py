"""The client's writes: put (from a tensor, or filled by the caller), and prefetch.

A put stages blocks in the client's own staging segment (shared memory) and publishes one event;
the daemon verifies and stores them. It never blocks on a busy daemon: what finds no staging slot
is dropped and counted, unless the caller allows a wait (`wait_s`) for the slots the daemon frees
as it stores. A mixin of Client, which provides the pools, the publisher and the copy threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.bus.codec import MAX_ITEMS, NAME_RE
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.publisher import Publisher
from kvtier.client.access import AccessReports
from kvtier.client.pools import ClientPool, host_rows
from kvtier.client.results import ClientStats, DropReason, Lookup, PutResult
from kvtier.core.events import Pin, Prefetch, Put, StagedBlock, TokenIds, staged_block
from kvtier.descriptor import Descriptor
from kvtier.errors import BadRequest, RedisUnavailable
from kvtier.keys import BlockKey, check_key, check_keys, encode_tokens
from kvtier.logs import LogThrottle
from kvtier.offload import SHARED_MIN_BLOCK, share_threads
from kvtier.processes import pid_alive
from kvtier.shm.staging import StagingWriter

MAX_PIN_TTL_S = 7 * 86400  # a pin longer than this is a mistake (the daemon cuts pins to its own max_ttl_s)

# A put of blocks under 256 KiB from a host tensor (filled in one share: offload.share_threads) is
# filled on the event loop up to this many bytes. The hand-off to a copy thread and back cost 44.5
# us of CPU for a no-op here; on puts of 64 blocks of 64 KiB the client's CPU a block fell from
# 10.0-11.5 to 8.6-9.4 us without it, and the put ran 11 % faster (docs/performance.md, the
# seventeenth stop). The loop is held for the copy: about 0.3-0.7 ms at this bound with the copy
# compiled, longer without it. A GPU tensor's rows are copied to the host first, on the loop, either way.
INLINE_PUT_BYTES = 8 << 20
STAGING_POLL_S = 0.002  # while a put waits for staging room (wait_s): the daemon frees slots as it stores
# A put's fill of a share of its taken slots, (i, slot) pairs, in a copy thread: the slots filled.
Fill = Callable[[Sequence[tuple[int, StagedBlock]]], list[StagedBlock]]
RESIDENT_POLL_S = 0.002  # wait_resident: a poll looks up only the keys not yet seen resident


class ClientWrites:
    _publisher: Publisher
    _client_stream: str
    _access: AccessReports
    desc: Descriptor
    stats: ClientStats
    _copy_threads: int
    quiet: LogThrottle
    inline_put_bytes = INLINE_PUT_BYTES  # (a test sets 0 on a client to send every fill to the copy threads)

    if TYPE_CHECKING:  # the other parts of Client (for the type checker only: see client/reads.py)
        def pool(self, name: str) -> ClientPool: ...
        def lookup(self, pool: str, keys: Sequence[bytes]) -> Lookup: ...
        def _start_copy(self, fn: Callable[[Sequence[Any]], list[Any]], items: Sequence[Any], nbytes: int,
                        threads: int | None = None, inline: bool = False) -> Coroutine[Any, Any, list[Any]]: ...

    async def put(self, pool: str, keys: Sequence[bytes], kv: torch.Tensor, *, parent: bytes | None = None,
                  token_ids: Sequence[int] | None = None, wait_s: float = 0.0, tenant: str = "") -> PutResult:
        """Hand new blocks to the daemon. `keys` is a chain: keys[0]'s parent is `parent` (None
        for the chain's first block). What cannot be staged at once is dropped and counted
        (`PutResult.reason` says why), unless `wait_s` > 0: then the put waits up to that long
        for staging slots. `token_ids` (block_tokens per block, in block order) are only passed
        on to routers, in the daemon's KV events (docs/integrations/events.md). `tenant` names
        whose blocks these are, for the node's fair share (docs/operations.md, "Tenants and fair
        share"); "" is the default tenant."""
        p = self.pool(pool)
        p.check_tensor(kv, len(keys), "kv")

        def writer(w: StagingWriter, n: int, off: int) -> Fill:
            rows = host_rows(kv[off:], n)  # only the staged blocks leave a GPU
            return lambda share: w.fill_rows(share, rows)

        return await self._put(p, keys, parent, writer, token_ids, wait_s, tenant,
                               self.inline_put_bytes if kv.device.type == "cpu" else 0)

    async def put_with(self, pool: str, keys: Sequence[bytes], fill: Callable[[int, npt.NDArray[np.uint8]], object],
                       *, parent: bytes | None = None, token_ids: Sequence[int] | None = None,
                       wait_s: float = 0.0, tenant: str = "") -> PutResult:
        """`put`, but `fill(i, dst)` writes block i's bytes straight into its staging slot (`dst`,
        a uint8 array of block_bytes), so a block gathered from scattered pages is copied once.
        `fill` may return the xxh3-64 of what it wrote (an int, hashed as it wrote: one pass over
        the bytes); otherwise dst is hashed after it. A wrong one costs the block (the daemon
        verifies), never wrong bytes. `fill` may run in the client's copy threads, several blocks
        side by side."""
        p = self.pool(pool)

        def writer(w: StagingWriter, n: int, off: int) -> Fill:
            def one(i: int, b: StagedBlock) -> StagedBlock:
                return w.fill_slot_with(b, lambda dst: fill(off + i, dst))
            return lambda share: [one(i, b) for i, b in share]

        return await self._put(p, keys, parent, writer, token_ids, wait_s, tenant)

    async def _put(self, p: ClientPool, keys: Sequence[bytes], parent: bytes | None,
                   writer: Callable[[StagingWriter, int, int], Fill],
                   token_ids: Sequence[int] | None, wait_s: float, tenant: str, inline_bytes: int = 0) -> PutResult:
        """Stage what fits, in as many rounds as `wait_s` allows; each round is filled by
        writer(staging, n_staged, offset)(share) in copy threads, a share of (i, slot) pairs a
        thread (on the loop where it is one share of at most `inline_bytes`), then published."""
        bkeys = check_keys(keys)
        bparent = None if parent is None else check_key(parent)
        _check_tenant(tenant)
        tokens = None
        if token_ids is not None:
            tokens = encode_tokens(token_ids).tobytes()  # BadRequest for ids outside [0, 2**32)
            want = len(bkeys) * p.layout.block_tokens
            if len(tokens) != 4 * want:
                raise BadRequest(f"token_ids: {len(bkeys)} blocks of {p.layout.block_tokens} tokens need {want} ids, "
                                 f"got {len(tokens) // 4}")
        if not bkeys:
            return PutResult(0, 0)
        deadline = time.monotonic() + max(0.0, wait_s)
        done, reason = 0, DropReason.NONE
        w = p.stager()
        while True:
            if not pid_alive(self.desc.pid):
                reason = DropReason.DAEMON_GONE  # nobody would drain the slots
                break
            n = await self._stage(p, w, bkeys[done:], bkeys[done - 1] if done else bparent, writer, done, tokens,
                                  tenant, inline_bytes)
            if n < 0:
                reason = DropReason.BUS_UNREACHABLE  # the event could not be published
                break
            done += n
            if done == len(bkeys):
                break
            if time.monotonic() >= deadline:
                reason = DropReason.STAGING_TIMEOUT if wait_s > 0 else DropReason.STAGING_FULL
                break
            await asyncio.sleep(STAGING_POLL_S)
        dropped = len(bkeys) - done
        if dropped:
            self.stats.put_dropped += dropped
            w.count_dropped(dropped)  # where the daemon collects it: the bus may be what failed
            self.quiet.info("client.put_dropped", per=reason, pool=p.name, dropped=dropped, reason=reason.value)
        return PutResult(done, dropped, reason)

    async def _stage(self, p: ClientPool, w: StagingWriter, bkeys: list[BlockKey], parent: BlockKey | None,
                     writer: Callable[[StagingWriter, int, int], Fill],
                     off: int, tokens: bytes | None, tenant: str, inline_bytes: int) -> int:
        """One round, for the put's blocks from `off` on: take the free slots for the leading
        keys, fill them (on the loop if in one share of at most `inline_bytes`), publish one
        `put`. How many were staged (0: no free slot), or -1 when publishing failed."""
        staged = w.take_slots(bkeys, parent)
        if not staged:
            return 0
        bt = 4 * p.layout.block_tokens
        part = None if tokens is None else TokenIds(tokens[off * bt:(off + len(staged)) * bt])
        epoch = w.grant_epoch if staged[0].granted else 0

        def event(blocks: Sequence[StagedBlock]) -> Put:
            return Put(p.name, w.seg.name, tuple(blocks), part, epoch, tenant)
        try:
            write = writer(w, len(staged), off)
            nbytes = len(staged) * p.block_bytes
            threads = share_threads(self._copy_threads, len(staged), nbytes)
            inline = threads == 1 and p.block_bytes < SHARED_MIN_BLOCK and nbytes <= inline_bytes
            with p.in_use():  # blocks under 256 KiB in one thread (offload.share_threads: two gained nothing)
                if inline:  # (through _start_copy all the same: one place where a put's fill starts)
                    staged = await self._start_copy(write, list(enumerate(staged)), nbytes, threads, inline=True)
                    fields = self._publisher.prepare(event(staged))
                else:
                    # Encoded while the copy threads fill the slots, off the put's serial path: what
                    # the event names, each slot as its fill leaves it (its gen one past the odd gen taken).
                    expected = [staged_block((b.key, b.parent, b.slot, b.gen + 1, b.granted)) for b in staged]
                    copying = self._start_copy(write, list(enumerate(staged)), nbytes, threads)
                    try:
                        fields = self._publisher.prepare(event(expected))
                    finally:
                        staged = await copying  # every share, even on a failure or a cancel
                    if staged != expected:  # (never, as the fills are written: the event names what they left)
                        fields = self._publisher.prepare(event(staged))
        except BaseException:
            w.unstage(staged)
            raise
        w.staged(staged)
        try:
            await self._publisher.publish_prepared(self._client_stream, fields)
        except REDIS_ERRORS as e:
            w.unstage(staged)
            self.stats.event_errors += 1
            self.quiet.warning("client.put_failed", pool=p.name, error=str(e))
            return -1
        except BaseException:
            # Cancelled mid-publish: free the slots. Safe even if the event did land, because
            # the daemon re-checks each slot's generation before trusting it.
            w.unstage(staged)
            raise
        return len(staged)

    async def prepare_puts(self, pool: str) -> None:
        """Ready this client to put into `pool`: its staging segment is made now and the daemon
        is asked to grant it cpu slots, so that its first put writes its blocks straight into
        their final slots (one pass) rather than staging them (two) or dropping what its staging
        slots cannot hold. For an engine worker at start: without it the daemon learns of the
        segment from the first put. The grants come as the daemon handles the request (a few
        milliseconds); an idle client keeps them until it puts, closes or dies. RedisUnavailable
        when the request cannot be sent."""
        p = self.pool(pool)
        w = p.stager()
        try:
            await self._publisher.publish_many([(self._client_stream, Put(p.name, w.seg.name, ()))])
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"prepare_puts for {pool!r} not sent: {type(e).__name__}: {e}") from e

    async def prefetch(self, pool: str, keys: Sequence[bytes], *, parent: bytes | None = None) -> None:
        """Ask the daemon to bring these blocks (a chain) into the cpu tier, e.g. from Redis.
        Read reports still pending go first, in the same round trip (AccessReports.take).
        RedisUnavailable when the event cannot be published."""
        self.pool(pool)
        bkeys = tuple(check_keys(keys))
        if bkeys:
            reads = await self._access.take_in_order()
            ask = Prefetch(pool, bkeys, None if parent is None else check_key(parent))
            try:
                await self._publisher.publish_many([*reads, (self._client_stream, ask)])
            except REDIS_ERRORS as e:
                if reads:
                    self._access.lost(e)
                raise RedisUnavailable(f"prefetch of {len(bkeys)} blocks not sent: {type(e).__name__}: {e}") from e

    async def pin(self, pool: str, keys: Sequence[bytes], ttl_s: int, *, tenant: str = "") -> None:
        """Keep this chain (head first) on the node for `ttl_s` seconds, e.g. an agent's context
        between tool calls; its Redis copies live at least as long. Pinning again extends a pin;
        `ttl_s` 0 lets this tenant's pins of the chain go. Charged to `tenant`'s pin budget: the
        daemon refuses what exceeds it, or its node-wide share, and counts and logs the refusal
        (docs/operations.md, "Session pins"). BadRequest for bad arguments; RedisUnavailable when
        the request cannot be sent."""
        self.pool(pool)
        if type(ttl_s) is not int or not 0 <= ttl_s <= MAX_PIN_TTL_S:
            raise BadRequest(f"ttl_s must be an int of seconds from 0 to {MAX_PIN_TTL_S}, got {ttl_s!r}")
        _check_tenant(tenant)
        bkeys = tuple(check_keys(keys))
        if len(bkeys) > MAX_ITEMS:
            raise BadRequest(f"a pin names at most {MAX_ITEMS} blocks, got {len(bkeys)}")
        if bkeys:
            try:
                await self._publisher.publish_many([(self._client_stream, Pin(pool, bkeys, ttl_s, tenant))])
            except REDIS_ERRORS as e:
                raise RedisUnavailable(f"pin of {len(bkeys)} blocks not sent: {type(e).__name__}: {e}") from e

    async def wait_resident(self, pool: str, keys: Sequence[bytes], timeout: float = 5.0) -> bool:
        """Wait until all `keys` are resident locally at once (e.g. after put or prefetch), or
        time out. Each poll looks up only the keys from the first one not yet seen resident (a
        long put's blocks become visible head first: polling all of them was a lookup of every
        key each millisecond), and all of them once more at the end, as one may have left since."""
        deadline = time.monotonic() + timeout
        seen = 0  # keys[:seen] were resident when last looked up
        while True:
            seen += self.lookup(pool, keys[seen:]).length
            if seen == len(keys):
                seen = self.lookup(pool, keys).length
                if seen == len(keys):
                    return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(RESIDENT_POLL_S)


def _check_tenant(tenant: str) -> None:
    if tenant and not (isinstance(tenant, str) and NAME_RE.fullmatch(tenant)):
        raise BadRequest(f"tenant must be empty or a name matching {NAME_RE.pattern}, got {tenant!r}")
