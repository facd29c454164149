"""SGLang's hybrid sliding-window (SWA) models: the SWA pool's pages beside the KV pages, through
HiCache's v2 calls (SGLang 0.5.23's HybridCacheController).

SGLang keeps the KV pages on the v1 calls and sends only the sidecar pools through v2; its
exists call for a span with an SWA window is `batch_exists_v2`, which must check the KV pages
too. What the backend does:
- An SWA page is stored under its KV page's hash tagged with the pool (`<hash>.swa`), in the KV
  namespace (weights, ranks, layout, epoch: a clear() retires both), in the kvtier pool named by
  `swa_pool` (its blocks are the SWA pool's pages, which are sized by the SWA layers alone).
- A prefix of p pages is restorable when the KV pages [0, p) are held and the SWA pages of its
  window, [p - N, p) with N = len(transfer.keys), are too (SWA backups have holes: a node's
  window evicted before its backup). exists answers every restorable p, as SGLang intersects
  them across ranks, and the longest as the hit.
- Other sidecar pools (Mamba state, DSA indexers, MTP draft windows) are not stored: a span that
  needs one is a miss, never a load without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

from kvtier.client import SyncClient
from kvtier.integrations.counters import Counters, LogThrottle
from kvtier.integrations.pool_spec import PoolSpec
from kvtier.integrations.sglang import hicache_pages as pages
from kvtier.integrations.sglang.hicache_config import HiCacheSettings
from kvtier.integrations.sglang.hicache_namespace import PageNamespace
from kvtier.integrations.sglang.hicache_pool import page_spec

T = TypeVar("T")

SIDECARS = frozenset({"swa"})  # the sidecar pools kvtier stores


def restorable_lengths(kv_pages: int, window: int, present: Sequence[bool]) -> list[int]:
    """Prefix lengths p in 1..kv_pages whose last `window` SWA pages (those of [0, p)) are all
    present. Pure."""
    missing = [0, *accumulate(not p for p in present[:kv_pages])]
    if len(missing) <= kv_pages:
        return []
    return [p for p in range(1, kv_pages + 1) if missing[p] == missing[max(0, p - window)]]


class SidecarCalls:
    """The v2 half of KvtierHiCacheStorage (a mixin: the backend provides what is declared)."""

    settings: HiCacheSettings
    counters: Counters
    warn: LogThrottle
    ns: PageNamespace
    writer: bool
    registered_pools: dict[Any, Any]
    _sidecar_spec: dict[str, PoolSpec]

    def _guard(self, op: str, miss: T, fn: Callable[[SyncClient], T]) -> T:
        raise NotImplementedError

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        raise NotImplementedError

    def _read(self, client: SyncClient, kk: list[bytes], dst: list[pages.U8], pool: str | None = None) -> int:
        raise NotImplementedError

    def _write(self, client: SyncClient, kk: list[bytes], fill: Callable[[int, pages.U8], object],
               parent: bytes | None, pool: str | None = None) -> int:
        raise NotImplementedError

    def _host_views(self, keys: Sequence[str], host_indices: torch.Tensor, host: Any = None) -> list[pages.U8]:
        raise NotImplementedError

    def _register_sidecar(self, host_pool: Any, name: str) -> None:
        if name == "kv":
            return  # the KV pool again (SGLang registers it through both calls)
        if name not in SIDECARS:
            self.warn.warning("sglang_hicache.sidecar_pool_not_stored", pool_name=name,
                              detail="kvtier stores KV and SWA pages only: this model's prefixes get no L3 hits")
            return
        if self.settings.swa_pool is None:
            self.warn.warning("sglang_hicache.sidecar_pool_not_stored", pool_name=name,
                              detail="no 'swa_pool' in the extra config: this model's prefixes get no L3 hits")
            return
        self._sidecar_spec[name] = page_spec(self.settings.swa_pool, int(host_pool.page_size),
                                             pages.host_page_bytes(host_pool))

    def _sidecar_pool(self, client: SyncClient, name: str) -> str:
        """The kvtier pool of a stored sidecar, checked against SGLang's pages (PoolMismatch: a miss)."""
        spec = self._sidecar_spec[name]
        spec.check(client)
        return str(spec.name)

    def _sidecar_keys(self, client: SyncClient, name: str, keys: Sequence[object]) -> list[bytes]:
        return self.ns.keys(client, [f"{k}.{name}" for k in keys])

    def _stored(self, transfers: Sequence[Any]) -> bool:
        return bool(transfers) and all(str(t.name) in self._sidecar_spec for t in transfers)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        transfers = list(pool_transfers or [])
        if not transfers:
            return PoolTransferResult(self.batch_exists(keys, extra_info), {})
        if not self._stored(transfers):
            return PoolTransferResult(0, {str(t.name): 0 for t in transfers}, [])
        kv = self.batch_exists(keys, extra_info)

        def run(client: SyncClient) -> list[int]:
            lengths = list(range(1, kv + 1))
            for t in transfers:
                name = str(t.name)
                pool = self._sidecar_pool(client, name)
                kk = self._sidecar_keys(client, name, keys[:kv])
                if self.settings.remote:
                    present = client.present(pool, kk, timeout=self.settings.call_timeout_s)
                else:
                    present = client.resident(pool, kk)
                ok = set(restorable_lengths(kv, len(t.keys or []), present))
                lengths = [p for p in lengths if p in ok]
            return lengths

        lengths = self._guard("batch_exists_v2", [], run) if kv else []
        hit = max(lengths, default=0)
        return PoolTransferResult(hit, {"kv": kv, **{str(t.name): hit for t in transfers}}, lengths)

    def _each(self, op: str, transfers: Sequence[Any],
              move: Callable[[SyncClient, str, list[bytes], list[pages.U8]], int]) -> dict[str, list[bool]]:
        """Each stored sidecar transfer's pages through `move(client, kvtier pool, keys, host
        views)`, which returns how many leading pages it moved; other transfers are all False."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            out[name] = [False] * len(keys)
            if name not in self._sidecar_spec or not keys:
                continue

            def run(client: SyncClient, name: str = name, keys: list[str] = keys, t: Any = t) -> list[bool]:
                pool = self._sidecar_pool(client, name)
                views = self._host_views(keys, t.host_indices, self.registered_pools[name])
                n = move(client, pool, self._sidecar_keys(client, name, keys), views)
                return [i < n for i in range(len(keys))]

            out[name] = self._guard(op, out[name], run)
        return out

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return self._each("batch_get_v2", transfers, lambda c, pool, kk, views: self._read(c, kk, views, pool))

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        if not self.writer:  # MLA: another rank writes these pages
            return {str(t.name): [str(t.name) in self._sidecar_spec] * len(t.keys or []) for t in transfers}
        # A window, not a chain from the first page: no parent.
        return self._each("batch_set_v2", transfers, lambda c, pool, kk, views: self._write(
            c, kk, lambda i, dst: pages.copy_out(dst, views[i]), None, pool))
