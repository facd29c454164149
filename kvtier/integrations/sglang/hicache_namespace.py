"""The backend's key namespace: SGLang's page geometry, the namespace's epoch in Redis (which
clear() bumps), and the KeyMapper built from both. SGLang's prefetch and backup threads use it
at once, so its state changes under one lock. No SGLang import here.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtier.client import ManifestEntry
from kvtier.client.sync import SyncClient
from kvtier.integrations.counters import LogThrottle
from kvtier.integrations.namespaced_keys import KeyMapper, namespace_bytes
from kvtier.integrations.sglang.hicache_keys import key_mapper, namespace_fields, page_key

EPOCH_REFRESH_S = 1.0  # how stale a backend's view of its namespace's epoch (clear) may be
EPOCH_TIMEOUT_S = 0.25  # a slow Redis must not hold a page lookup up for long
EPOCH_RETRY_S = 5.0  # ... nor every lookup: after a failure, ask again this much later


class EpochUnknown(Exception):
    """The namespace's epoch is not known yet (Redis unreachable since start): a miss."""


class PageNamespace:
    def __init__(self, storage_config: Any, pool: str, salt: str | None, warn: LogThrottle,
                 weights: dict[str, Any]) -> None:
        self.storage_config = storage_config
        self.weights = weights  # the weights' identity (hicache_identity.py)
        self.pool = pool
        self.salt = salt
        self.warn = warn
        # Until SGLang registers its host pool, the layout is what the config says and the page
        # geometry is the kvtier pool's (register checks that the two agree).
        self.layout = "page_first" if storage_config.is_page_first_layout else "layer_first"
        self.page_size: int | None = None
        self.page_bytes: int | None = None
        self._host: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._fields: dict[str, Any] | None = None
        self._mapper: KeyMapper | None = None
        self._mapper_epoch = -1
        self.epoch: int | None = None  # None until read from Redis: no page is served or written
        self._epoch_name = ""
        self._epoch_next = 0.0

    def set_host(self, layout: str, page_size: int, page_bytes: int, geometry: dict[str, Any]) -> None:
        """SGLang's host pool: the namespace is built again from it on the next call."""
        with self._lock:
            self.layout, self.page_size, self.page_bytes, self._host = layout, page_size, page_bytes, geometry
            self._fields, self._mapper = None, None

    def manifest_entry(self, engine_version: str) -> ManifestEntry:
        """The backend's entry in the pool's manifest (core/manifest.py), once the host pool is
        registered: its namespace id is the epoch's name, from the same fields."""
        with self._lock:
            fields = namespace_fields(self.storage_config, weights=self.weights, layout=self.layout,
                                      page_size=int(self.page_size or 0), page_bytes=int(self.page_bytes or 0),
                                      salt=self.salt, host=self._host)
            page = {"page_bytes": self.page_bytes, "page_size": self.page_size, "layout": self.layout,
                    "host": self._host}
        cfg = self.storage_config
        return ManifestEntry(namespace=hashlib.sha256(namespace_bytes(fields)).hexdigest()[:32],
                             engine="sglang-hicache", engine_version=engine_version,
                             model=str(cfg.model_name or ""), weights=dict(self.weights), page=page,
                             extra={"tp_size": cfg.tp_size, "mla": bool(cfg.is_mla_model)})

    def keys(self, client: SyncClient, keys: Sequence[object]) -> list[bytes]:
        mapper = self.mapper(client)  # one mapper for the whole call: one epoch per batch
        return [page_key(mapper, k) for k in keys]

    def mapper(self, client: SyncClient) -> KeyMapper:
        """The key mapper of the namespace's current epoch; EpochUnknown (a miss) until the epoch
        has been read once, so that a backend never serves or writes pages a clear() retired."""
        now = time.monotonic()
        with self._lock:
            if self._fields is None:
                p = client.pool(self.pool)
                self._fields = namespace_fields(
                    self.storage_config, weights=self.weights, layout=self.layout,
                    page_size=self.page_size if self.page_size is not None else p.layout.block_tokens,
                    page_bytes=self.page_bytes if self.page_bytes is not None else p.block_bytes,
                    salt=self.salt, host=self._host)
                self._epoch_name = hashlib.sha256(namespace_bytes(self._fields)).hexdigest()[:32]
                self.epoch, self._epoch_next = None, 0.0
            due, name = now >= self._epoch_next, self._epoch_name
            if due:
                self._epoch_next = now + EPOCH_REFRESH_S  # one thread asks; the others go on
        if due:
            try:
                self._raise_epoch(name, client.epoch(self.pool, name, timeout=EPOCH_TIMEOUT_S))
            except Exception as e:  # Redis down or slow: the last epoch stands, asked again later
                with self._lock:
                    self._epoch_next = now + EPOCH_RETRY_S
                self.warn.warning("sglang_hicache.epoch_unknown", error=f"{type(e).__name__}: {e}", epoch=self.epoch)
        with self._lock:
            if self.epoch is None or self._fields is None:
                raise EpochUnknown("the namespace's epoch has not been read from Redis yet")
            if self._mapper is None or self._mapper_epoch != self.epoch:
                self._mapper = key_mapper({**self._fields, "epoch": self.epoch})
                self._mapper_epoch = self.epoch
            return self._mapper

    def bump(self, client: SyncClient, timeout: float) -> int:
        """clear(): the next epoch, for every backend of the namespace."""
        self.mapper(client)  # the namespace and its epoch's name
        with self._lock:
            name = self._epoch_name
        self._raise_epoch(name, client.epoch(self.pool, name, bump=True, timeout=timeout))
        return self.epoch or 0

    def _raise_epoch(self, name: str, epoch: int) -> None:
        """Epochs only go up: a refresh answered before a clear() must not undo it."""
        with self._lock:
            if name == self._epoch_name and (self.epoch is None or epoch > self.epoch):
                self.epoch = epoch
