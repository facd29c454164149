"""KvtierHiCacheStorage: kvtier as SGLang's HiCache L3 storage (SGLang 0.5.23's HiCacheStorage).

SGLang builds it through `StorageBackendFactory.create_backend("dynamic", config, host_pool)`,
which calls `KvtierHiCacheStorage(storage_config, kwargs)`, then `register_mem_pool_host`. One
SGLang page is one kvtier block of the configured pool: its flat bytes (hicache_pages.py), under
a key namespaced by the weights' identity, parallel and host layout (hicache_keys.py).

- batch_exists: the leading run this node holds (shared memory), then what Redis holds after it.
- batch_get / batch_get_v1: local blocks are copied from shared memory straight into SGLang's
  pages and verified there; with `remote` (the default) the rest of the leading run is read from
  Redis in the same call (`get_with(..., remote=True)`): straight into a page that is contiguous,
  verified where it landed, else through a buffer, verified by the page's digest.
- batch_set / batch_set_v1: pages are copied once, into the client's staging slots (waiting up to
  `save_wait_s` for room); the daemon verifies them and stores them in its tiers (and Redis, by its
  policy). A page already on this node is not sent again. MLA pages are written only by
  `is_storage_writer`.
- hybrid SWA models (the v2 calls): the sliding-window pool's pages beside the KV pages, in the
  pool `swa_pool` (hicache_sidecars.py); other sidecar pools are not stored (a miss).
- clear: bumps the namespace's epoch in Redis (part of every key): its pages are never found
  again, on any node, and age out; nothing other namespaces share is deleted.
- Best effort: every call goes through the link's guard (integrations/link.py): a daemon down,
  a Redis outage, a timeout or a bad page is a miss (None, False, 0), counted and logged
  (throttled). The only errors SGLang sees are at attach: a bad extra config, weights kvtier
  cannot identify (WeightsUnknown), or a pool that cannot hold its pages (PoolMismatch).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.client import ReadCounts, SyncClient
from kvtier.client.discovery import library_logger
from kvtier.integrations.counters import Counters, LogThrottle
from kvtier.integrations.link import LINK_COUNTERS, EngineLink
from kvtier.integrations.sglang import hicache_pages as pages
from kvtier.integrations.sglang.hicache_config import ConfigError, HiCacheSettings
from kvtier.integrations.sglang.hicache_identity import backend_weights
from kvtier.integrations.sglang.hicache_namespace import EpochUnknown, PageNamespace
from kvtier.integrations.sglang.hicache_pool import page_spec
from kvtier.integrations.sglang.hicache_sidecars import SidecarCalls

T = TypeVar("T")

COUNTERS = (  # besides the link's own (LINK_COUNTERS); kvtier_stats adds daemon_unavailable, its connect_failures
    "pages_read_local",  # pages copied from this node's shared memory, verified
    "pages_read_remote",  # pages read straight from Redis, verified
    "pages_missed",  # pages asked for and not delivered (absent, corrupt, unreachable)
    "pages_written",  # pages handed to the daemon
    "pages_deduped",  # pages already on this node: not sent again
    "pages_dropped",  # pages not handed over: no staging room in time, or the daemon/Redis down
    "bad_pages",  # values or targets of the wrong size or kind (refused)
    "epoch_unknown",  # calls answered as misses because the namespace's epoch was never read
)
METRICS_KEPT = 1024  # per-call figures kept for get_stats between two reads


class KvtierHiCacheStorage(SidecarCalls, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings, unknown = HiCacheSettings.from_extra(storage_config.extra_config)
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError("kvtier does not store split-head pages (tp_lcm_size with the page_head layout): "
                              "run every node with the same TP size, or leave tp_lcm_size out")
        self.log = library_logger().bind(component="sglang_hicache", pool=self.settings.pool,
                                         tp_rank=storage_config.tp_rank)
        if unknown:
            self.log.warning("sglang_hicache.unknown_config_keys", keys=unknown, detail="ignored (a typo?)")
        self.warn = LogThrottle(self.log)
        self.counters = Counters(LINK_COUNTERS + COUNTERS)
        self.writer = bool(storage_config.is_storage_writer)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self._sidecar_spec: dict[str, Any] = {}  # stored sidecar pool name -> its kvtier pool's spec
        st = self.settings
        self.ns = PageNamespace(storage_config, st.pool, st.salt, self.warn,
                                backend_weights(storage_config, st, self.log))
        self._metrics: dict[str, deque[float]] = {n: deque(maxlen=METRICS_KEPT) for n in
                                                  ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth",
                                                   "backup_bandwidth")}
        self.link = EngineLink(runtime_dir=st.runtime_dir, spec=page_spec(st.pool, None, None),
                               counters=self.counters, log=self.log, retry_s=st.retry_s,
                               staging_blocks=st.staging_blocks, connect_timeout_s=st.connect_timeout_s,
                               socket_timeout_s=st.call_timeout_s, call_timeout_s=st.call_timeout_s,
                               remote_timeout_s=st.remote_timeout_s, component="sglang_hicache",
                               puts=True)  # HiCache backs pages up through it
        self.link.start(first=True)  # a daemon that is down is not an error; a wrong pool is

    # --- geometry and keys -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its page size and bytes must be the pool's (else the attach fails)."""
        super().register_mem_pool_host(mem_pool_host)
        page_size, page_bytes = int(mem_pool_host.page_size), pages.host_page_bytes(mem_pool_host)
        if (self.storage_config.extra_config or {}).get("interface_v1"):
            pages.check_in_place_view(mem_pool_host, page_bytes)
        self.ns.set_host(str(getattr(mem_pool_host, "layout", self.ns.layout)), page_size, page_bytes,
                         pages.host_geometry(mem_pool_host))
        spec, client = page_spec(self.settings.pool, page_size, page_bytes), self.link.current
        if client is not None:
            spec.check(client)  # PoolMismatch: SGLang's attach fails with the reason
        self.link.spec = spec
        self.link.register(self.ns.manifest_entry(sglang.__version__))  # its namespace, in the pool's manifest
        self.log.info("sglang_hicache.host_pool", layout=self.ns.layout, page_size=page_size, page_bytes=page_bytes)

    def _keys(self, client: SyncClient, keys: Sequence[object]) -> list[bytes]:
        return self.ns.keys(client, keys)

    def _parent(self, client: SyncClient, extra_info: Any) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix:
            return self._keys(client, [prefix[-1]])[0]
        return None

    # --- the safety net --------------------------------------------------------------------------

    def _guard(self, op: str, miss: T, fn: Callable[[SyncClient], T]) -> T:
        """fn(client) through the link's guard (a miss on any failure, counted and logged), with
        SGLang's own two kinds: a namespace whose epoch is unknown, and a bad page."""
        def run(client: SyncClient) -> T:
            try:
                return fn(client)
            except EpochUnknown:
                self.counters.add("epoch_unknown")
            except (TypeError, ValueError) as e:
                self.counters.add("bad_pages")
                self.warn.warning("sglang_hicache.bad_request", op=op, error=str(e))
            return miss

        return self.link.guard(op, miss, run)

    # --- exists ------------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The length of the leading run of `keys` present: on this node, then in Redis."""
        if not keys:
            return 0

        def run(client: SyncClient) -> int:
            kk = self._keys(client, keys)
            if not self.settings.remote:
                return client.lookup(self.settings.pool, kk).length
            try:
                found = client.locate(self.settings.pool, kk, timeout=self.settings.call_timeout_s)
            except TimeoutError:  # Redis slow: this node's own answer stands
                self.counters.add("timeouts")
                return client.lookup(self.settings.pool, kk).length
            return found.length + found.redis_length

        return self._guard("batch_exists", 0, run)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- get ---------------------------------------------------------------------------------------

    def _read(self, client: SyncClient, kk: list[bytes], dst: list[pages.U8], pool: str | None = None) -> int:
        """Blocks kk -> the byte views dst (flat or page-shaped); how many leading ones landed,
        verified: from shared memory, and with `remote` the rest of the run from Redis (straight
        into a contiguous page)."""
        got = ReadCounts()  # this call's own figures: other threads share the client
        landed: dict[int, int] = {}  # page -> xxh3 taken as it was copied in (one pass)

        def copy_in(i: int, src: pages.U8) -> None:
            landed[i] = pages.copy_in(dst[i], src)

        def digest(i: int) -> int:
            csum = landed.pop(i, None)
            return pages.digest(dst[i]) if csum is None else csum

        n = client.get_with(pool or self.settings.pool, kk, copy_in, digest, remote=self.settings.remote,
                            land=lambda i: dst[i].reshape(-1) if dst[i].flags.c_contiguous else None,
                            counts=got, timeout=self.settings.call_timeout_s)
        self.counters.add("pages_read_local", got.local)
        self.counters.add("pages_read_remote", got.remote)
        self.counters.add("pages_missed", len(kk) - n)
        return n

    def _page_targets(self, client: SyncClient, count: int, targets: Sequence[Any] | None) -> list[torch.Tensor]:
        if targets is not None:
            if len(targets) != count:
                raise ValueError(f"{count} keys but {len(targets)} target locations")
            return list(targets)
        p = client.pool(self.settings.pool)
        return [torch.empty(p.block_bytes // p.dtype.itemsize, dtype=p.dtype) for _ in range(count)]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each key's page in its target tensor (a flat host page), or None from the first miss on."""
        misses: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return misses
        t0 = time.perf_counter()

        def run(client: SyncClient) -> list[torch.Tensor | None]:
            targets = self._page_targets(client, len(keys), target_locations)
            views = [pages.tensor_bytes(t) for t in targets]  # in place, whatever their strides
            size = client.pool(self.settings.pool).block_bytes
            usable = next((i for i, v in enumerate(views) if v.size != size), len(views))
            if usable < len(views):
                self.counters.add("bad_pages")
                self.warn.warning("sglang_hicache.bad_target", bytes=int(views[usable].size), page_bytes=size)
            n = self._read(client, self._keys(client, keys[:usable]), views[:usable]) if usable else 0
            self.counters.add("pages_missed", len(keys) - usable)
            self._note("prefetch", n, t0)
            return [targets[i] if i < n else None for i in range(len(keys))]

        return self._guard("batch_get", misses, run)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Zero-copy: pages land in the host pool at host_indices (page i at host_indices[i * page_size])."""
        misses = [False] * len(keys)
        if not keys:
            return misses
        t0 = time.perf_counter()

        def run(client: SyncClient) -> list[bool]:
            views = self._host_views(keys, host_indices)
            n = self._read(client, self._keys(client, keys), views)
            self._note("prefetch", n, t0)
            return [i < n for i in range(len(keys))]

        return self._guard("batch_get_v1", misses, run)

    def _host_views(self, keys: Sequence[str], host_indices: torch.Tensor, host: Any = None) -> list[pages.U8]:
        host = host if host is not None else self.mem_pool_host
        if host is None:
            raise ValueError("the zero-copy calls need SGLang's host pool (register_mem_pool_host first)")
        ps = int(host.page_size)
        idx = host_indices.tolist()
        if len(idx) < len(keys) * ps:
            raise ValueError(f"{len(keys)} pages need {len(keys) * ps} host indices, got {len(idx)}")
        return [pages.page_view(host, int(idx[i * ps])) for i in range(len(keys))]

    # --- set ---------------------------------------------------------------------------------------

    def _write(self, client: SyncClient, kk: list[bytes], fill: Callable[[int, pages.U8], object],
               parent: bytes | None, pool: str | None = None) -> int:
        """Hand blocks to the daemon; how many leading ones were taken (already here counts)."""
        pool = pool or self.settings.pool
        done = client.lookup(pool, kk).length  # content-addressed: a page here is not sent again
        self.counters.add("pages_deduped", done)
        if done < len(kk):
            staged = self.link.put_with(client, kk[done:], lambda i, dst: fill(done + i, dst),
                                        parent=kk[done - 1] if done else parent, wait_s=self.settings.save_wait_s,
                                        pool=pool)
            self.counters.add("pages_written", staged)
            done += staged
        self.counters.add("pages_dropped", len(kk) - done)
        return done

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat host pages; True only if every one was handed over."""
        if not keys:
            return True
        if not self.writer:
            return True  # MLA: another rank (is_storage_writer) writes these pages
        t0 = time.perf_counter()

        def run(client: SyncClient) -> bool:
            if values is None or len(values) != len(keys):
                raise ValueError(f"{len(keys)} keys but {0 if values is None else len(values)} values")
            size = client.pool(self.settings.pool).block_bytes
            src = [pages.flat_bytes(v) for v in values]
            bad = next((i for i, s in enumerate(src) if s.size != size), None)
            if bad is not None:
                raise ValueError(f"page {bad} is {src[bad].size} bytes, the pool's blocks are {size}")
            n = self._write(client, self._keys(client, keys), lambda i, dst: pages.copy_out(dst, src[i]), None)
            self._note("backup", n, t0)
            return n == len(keys)

        return self._guard("batch_set", False, run)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Zero-copy: each page is copied once, from the host pool into a staging slot."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)
        t0 = time.perf_counter()

        def run(client: SyncClient) -> list[bool]:
            views = self._host_views(keys, host_indices)
            n = self._write(client, self._keys(client, keys), lambda i, dst: pages.copy_out(dst, views[i]),
                            self._parent(client, extra_info))
            self._note("backup", n, t0)
            return [i < n for i in range(len(keys))]

        return self._guard("batch_set_v1", [False] * len(keys), run)

    # --- hybrid models' sidecar pools (hicache_sidecars.py) ---------------------------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register_sidecar(host_pool, str(host_pool_name))

    # --- stats, clear, close -------------------------------------------------------------------------

    def _note(self, kind: str, n: int, t0: float) -> None:
        if n and self.storage_config.enable_storage_metrics:
            dt = max(time.perf_counter() - t0, 1e-9)
            self._metrics[f"{kind}_pgs"].append(n)
            self._metrics[f"{kind}_bandwidth"].append(n * (self.ns.page_bytes or 0) / dt / 1e9)

    def kvtier_stats(self) -> dict[str, Any]:
        """This backend's counters, and whether its daemon is reachable."""
        c = self.counters.snapshot()
        return {**c, "daemon_unavailable": c["connect_failures"], "connected": self.link.current is not None,
                "pool_mismatch": self.link.mismatch or None}

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages per call, GB/s) since the last call, when SGLang has them."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # its import chain needs the whole engine (torchvision, ...)
            return None
        m = StorageMetrics()
        for name, q in self._metrics.items():
            getattr(m, name).extend(q)
            q.clear()
        return m

    def clear(self) -> bool:
        """Forget every page of this namespace, on every node: bump its epoch in Redis, which is
        part of every key, so the old pages are never found again (other backends follow within
        EPOCH_REFRESH_S) and leave by the tiers' LRU and Redis's policy. Pages of other models or
        layouts sharing the pool are untouched. False if Redis or the daemon cannot be reached."""

        def run(client: SyncClient) -> bool:
            self.log.info("sglang_hicache.cleared", epoch=self.ns.bump(client, self.settings.call_timeout_s))
            return True

        return self._guard("clear", False, run)

    def close(self) -> None:
        self.link.close()
