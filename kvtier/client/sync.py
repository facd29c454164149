"""A blocking wrapper for engines that are not async: the Client runs on a private event loop thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import uvloop

from kvtier.client.client import Client
from kvtier.client.pools import ClientPool
from kvtier.client.results import ClientStats, Lookup, PutResult, ReadCounts
from kvtier.core.manifest import ManifestEntry
from kvtier.core.where import Where
from kvtier.errors import CallTimeout
from kvtier.keys import BlockKey
from kvtier.processes import pid_alive

T = TypeVar("T")


LOOP_GRACE_S = 5.0  # past a call's own deadline: how long a caller waits for a loop that stopped answering
CLOSE_S = 5.0  # how long closing waits for what still runs on the loop, and for the client's own close


async def _bounded(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """`coro` within `timeout`: CallTimeout when that deadline passed (a TimeoutError raised
    inside, e.g. by a socket, passes as it is)."""
    try:
        async with asyncio.timeout(timeout) as cm:
            return await coro
    except TimeoutError as e:
        if cm.expired():
            raise CallTimeout(f"the call took longer than {timeout:g} s and was cancelled") from e
        raise


class SyncClient:
    def __init__(self, runtime_dir: str | os.PathLike[str] | None = None, *, staging_blocks: int = 32,
                 timeout: float = 30.0, socket_timeout: float = 2.0, remote_timeout: float | None = None,
                 blocks_url: str | None = None) -> None:
        # uvloop, as the daemon's: a put's hops (the Redis round trip, the copy threads' hand-off)
        # cost the client less CPU on it than on Python's own loop (docs/performance.md, the
        # fourteenth stop).
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-client", daemon=True)
        self._thread.start()
        self._timeout = timeout
        try:
            self._client: Client = self._call(Client.connect(runtime_dir, staging_blocks=staging_blocks,
                                                               socket_timeout=socket_timeout,
                                                               remote_timeout=remote_timeout,
                                                               blocks_url=blocks_url))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        # The deadline is kept on the loop, not here: a call that times out is cancelled there and
        # this returns only once it has unwound, so no copy it started can still be writing into
        # the caller's memory (a tensor, an engine's page) after CallTimeout. The wait here has a
        # bound of its own only for a loop that stopped answering altogether.
        t = self._timeout if timeout is None else timeout
        fut = asyncio.run_coroutine_threadsafe(_bounded(coro, t), self._loop)
        try:
            return fut.result(t + LOOP_GRACE_S)
        except concurrent.futures.TimeoutError as e:
            if fut.done():
                raise  # the call's own (CallTimeout: its deadline passed, and it has unwound)
            fut.cancel()  # the wait here ran out: the loop is not answering
            raise CallTimeout(f"the client's loop did not answer within {t + LOOP_GRACE_S:g} s") from e
        except BaseException:
            fut.cancel()  # interrupted (Ctrl-C): do not leave the call running behind our back
            raise

    def submit(self, job: Callable[[Client], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Run `job(client)` on this client's loop thread and return at once, for callers that
        overlap work (an engine's scheduler polling its transfers). The future is the caller's to
        poll or wait on; `cancel()` on it cancels the job, whose copies finish before it ends
        (kvtier/offload.py). The job keeps its own deadline: SyncClient's `timeout` does not
        apply."""
        return asyncio.run_coroutine_threadsafe(job(self._client), self._loop)

    def block_keys(self, pool: str, token_ids: Sequence[int], *, salt: bytes | None = None,
                   lora_id: str | None = None) -> list[BlockKey]:
        return self._client.block_keys(pool, token_ids, salt=salt, lora_id=lora_id)

    def lookup(self, pool: str, keys: Sequence[bytes]) -> Lookup:
        return self._client.lookup(pool, keys)

    def resident(self, pool: str, keys: Sequence[bytes]) -> list[bool]:
        return self._client.resident(pool, keys)

    # `timeout` bounds one call (default: the constructor's); TimeoutError cancels the call.
    def present(self, pool: str, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Client.present: per key, on this node or in Redis."""
        return self._call(self._client.present(pool, keys), timeout)

    def locate(self, pool: str, keys: Sequence[bytes], *, timeout: float | None = None) -> Lookup:
        return self._call(self._client.locate(pool, keys), timeout)

    def get(self, pool: str, keys: Sequence[bytes], out: torch.Tensor, *, remote: bool = False,
            counts: ReadCounts | None = None, timeout: float | None = None) -> int:
        """Client.get; `remote=True` reads each block of the leading run from wherever it is."""
        return self._call(self._client.get(pool, keys, out, remote=remote, counts=counts), timeout)

    def get_with(self, pool: str, keys: Sequence[bytes], copy_out: Callable[[int, npt.NDArray[np.uint8]], object],
                 digest: Callable[[int], int], *, remote: bool = False,
                 land: Callable[[int], npt.NDArray[np.uint8] | None] | None = None,
                 counts: ReadCounts | None = None, timeout: float | None = None) -> int:
        """Client.get_with."""
        return self._call(self._client.get_with(pool, keys, copy_out, digest, remote=remote, land=land,
                                                counts=counts), timeout)

    def put(self, pool: str, keys: Sequence[bytes], kv: torch.Tensor, *, parent: bytes | None = None,
            token_ids: Sequence[int] | None = None, wait_s: float = 0.0, tenant: str = "",
            timeout: float | None = None) -> PutResult:
        """Client.put; `timeout` must exceed `wait_s`."""
        return self._call(self._client.put(pool, keys, kv, parent=parent, token_ids=token_ids, wait_s=wait_s,
                                           tenant=tenant), timeout)

    def put_with(self, pool: str, keys: Sequence[bytes], fill: Callable[[int, npt.NDArray[np.uint8]], object], *,
                 parent: bytes | None = None, token_ids: Sequence[int] | None = None, wait_s: float = 0.0,
                 tenant: str = "", timeout: float | None = None) -> PutResult:
        """Client.put_with; `timeout` must exceed `wait_s`."""
        return self._call(self._client.put_with(pool, keys, fill, parent=parent, token_ids=token_ids,
                                                wait_s=wait_s, tenant=tenant), timeout)

    def prepare_puts(self, pool: str, *, timeout: float | None = None) -> None:
        """Client.prepare_puts."""
        self._call(self._client.prepare_puts(pool), timeout)

    def prefetch(self, pool: str, keys: Sequence[bytes], *, parent: bytes | None = None,
                 timeout: float | None = None) -> None:
        self._call(self._client.prefetch(pool, keys, parent=parent), timeout)

    def pin(self, pool: str, keys: Sequence[bytes], ttl_s: int, *, tenant: str = "",
            timeout: float | None = None) -> None:
        """Client.pin."""
        self._call(self._client.pin(pool, keys, ttl_s, tenant=tenant), timeout)

    def where(self, pool: str, keys: Sequence[bytes], *, timeout: float | None = None) -> Where:
        """Client.where: which nodes hold the longest leading run of `keys`, in which tier."""
        return self._call(self._client.where(pool, keys), timeout)

    def epoch(self, pool: str, name: str, *, bump: bool = False, timeout: float | None = None) -> int:
        """Client.epoch."""
        return self._call(self._client.epoch(pool, name, bump=bump), timeout)

    def register_namespace(self, pool: str, entry: ManifestEntry, *, timeout: float | None = None) -> None:
        """Client.register_namespace: NamespaceConflict when the namespace is another page's."""
        self._call(self._client.register_namespace(pool, entry), timeout)

    def count_stored(self, pool: str, namespace: str, blocks: int, nbytes: int, *,
                     timeout: float | None = None) -> None:
        """Client.count_stored."""
        self._call(self._client.count_stored(pool, namespace, blocks, nbytes), timeout)

    @property
    def stats(self) -> ClientStats:
        """What this client counted (reads, misses, drops, Redis errors)."""
        return self._client.stats

    @property
    def node(self) -> str:
        """The node id of the daemon this client follows."""
        return self._client.node

    @property
    def prefix_index(self) -> bool:
        """Whether the daemon this client follows writes the cluster prefix index ([prefix_index])."""
        return self._client.prefix_index

    def daemon_alive(self) -> bool:
        """Whether the daemon this client follows (the descriptor's pid) is running."""
        self._client._follow_restarts()
        return pid_alive(self._client.desc.pid)

    def mapped(self, name: str) -> ClientPool | None:
        """The pool as mapped now, or None: no I/O, and no look for a restarted daemon (for an
        engine's hot path; `pool` follows restarts)."""
        return self._client.pools.get(name)

    def pool(self, name: str) -> ClientPool:
        """The mapped pool (its layout, block shape and dtype); UnknownPool if not served."""
        return self._client.pool(name)

    def wait_resident(self, pool: str, keys: Sequence[bytes], timeout: float = 5.0) -> bool:
        return self._call(self._client.wait_resident(pool, keys, timeout))

    def close(self) -> None:
        """Cancel what still runs on the client's loop (calls of other threads and `submit`ted
        jobs end with CancelledError, once their copies have finished), close the client, stop
        the loop. Idempotent."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CLOSE_S + LOOP_GRACE_S)
        except Exception:  # noqa: BLE001 - the loop stops below whatever happened
            pass
        finally:
            self._stop_loop()

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for t in others:
            t.cancel(msg="the kvtier client is closing")
        if others:
            await asyncio.wait(others, timeout=CLOSE_S)
        if hasattr(self, "_client"):
            async with asyncio.timeout(CLOSE_S):
                await self._client.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_S)
        if not self._thread.is_alive():  # a loop still running cannot be closed: left to the process
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
