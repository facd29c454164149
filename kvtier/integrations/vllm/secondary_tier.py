"""kvtier as a secondary tier under vLLM's CPU primary (`TieringOffloadingSpec`, vLLM 0.32).

vLLM copies KV from the GPU into its CPU primary region (one shared-memory row per offload
chunk) and cascades every stored chunk to its secondary tiers; a chunk that only a secondary
tier holds is promoted back into a primary row before the GPU reads it. This tier moves those
rows, as opaque bytes, to and from the local kvtier daemon: its shared-memory cpu tier on this
node and, through it, Redis for the whole cluster. vLLM loads it with no patch:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvtierSecondaryTier",
                             "module_path": "kvtier.integrations.vllm.secondary_tier",
                             "pool": "vllm-chunks", "runtime_dir": "/run/kvtier"}]}}'

Tier options (the other keys of that dict):
    pool               (required) the kvtier pool to use. Its block must be exactly one vLLM
                       chunk (`primary_kv_view.strides[0]` bytes), checked at start (a
                       ValueError names the [pools.*] table to add). The usual way: dtype =
                       "uint8", layers = kv_heads = block_tokens = 1, head_dim = chunk_bytes // 2.
    runtime_dir        where the daemon's descriptor (kvtier.json) is. Default: kvtier's
                       ($KVTIER__NODE__RUNTIME_DIR, /run/kvtier for root, ...).
    load_timeout_s     a load (promotion) job's deadline, prefetch from Redis included (5.0).
    store_timeout_s    a store (cascade) job's deadline: staged and visible in kvtier (10.0).
    lookup_timeout_s   a background existence check's deadline; past it, a miss (1.0).
    connect_timeout_s  connecting to the daemon at start and on each reconnect (5.0).
    health_interval_s  how often the link's thread checks the daemon (its pid, and at most every
                       0.5 s) and tries to reconnect while it is down (0.25).
    staging_chunks     the client's staging slots, each one chunk of /dev/shm (32).
    salt               extra namespace string: tiers with different salts never share chunks.
    weights_id         the weights' identity, for weights kvtier cannot read (tier_keys.py).
    failed_key_ttl_s   a chunk whose load failed is a miss for this long (10.0).
    enable_kv_events   emit BlockStored events (medium STORAGE) when vLLM's are on (False).
    locality           "LOCAL" or "REMOTE" on those events (None).
    backpressure       vLLM's own per-tier back-pressure config (handled by its factory).

Keys: tier_keys.py. A chunk stored on node A is found by node B's tier once it is in Redis: when
A's cpu tier sheds it (write-back, the default), or at once with write-through.
The daemon is reached through the engine link (integrations/link.py); deadlines: tier_io.py.
Every method returns at once and none raises into vLLM after construction: failures are failed
jobs or misses, counted (get_stats) and logged.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvtier.integrations.vllm.tier_chunks import primary_rows
from kvtier.integrations.vllm.tier_io import GRACE_S, Outcome, TierIO
from kvtier.integrations.vllm.tier_keys import KeyMapper, manifest_entry, namespace_bytes, namespace_fields
from kvtier.integrations.vllm.tier_stats import Counters

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

METRIC_PREFIX = "vllm:kv_offload_kvtier_"
FAILED_KEYS_MAX = 100_000


@dataclass(slots=True)
class _Job:
    job_id: JobId
    keys: list[OffloadKey]
    is_load: bool
    submitted: float
    future: concurrent.futures.Future | None = None


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup machinery; its worker thread asks kvtier (shm, then Redis) per batch."""

    def __init__(self, tier: KvtierSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._exists(keys)


class KvtierSecondaryTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        pool: str | None = None,
        runtime_dir: str | None = None,
        load_timeout_s: float = 5.0,
        store_timeout_s: float = 10.0,
        lookup_timeout_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        health_interval_s: float = 0.25,
        staging_chunks: int = 32,
        salt: str | None = None,
        weights_id: str | None = None,
        failed_key_ttl_s: float = 10.0,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(pool, str) or not pool:
            raise ValueError("KvtierSecondaryTier needs 'pool' in its secondary_tiers entry: the name of a kvtier "
                             "pool whose block is one vLLM offload chunk")
        for name, v in (("load_timeout_s", load_timeout_s), ("store_timeout_s", store_timeout_s),
                        ("lookup_timeout_s", lookup_timeout_s), ("connect_timeout_s", connect_timeout_s),
                        ("health_interval_s", health_interval_s)):
            if not v > 0:
                raise ValueError(f"KvtierSecondaryTier: {name} must be > 0, got {v!r}")
        if int(staging_chunks) < 1:
            raise ValueError(f"KvtierSecondaryTier: staging_chunks must be >= 1, got {staging_chunks!r}")
        self.locality = Locality(locality) if locality is not None else None
        self._timeouts = {False: float(store_timeout_s), True: float(load_timeout_s)}
        self._lookup_timeout = float(lookup_timeout_s)
        self._failed_ttl = float(failed_key_ttl_s)
        chunk_bytes, rows = self.block_size_bytes, primary_rows(primary_kv_view)
        fields = namespace_fields(offloading_spec, chunk_bytes, salt, weights_id)
        self.keys = KeyMapper(namespace_bytes(fields))
        self.counters = Counters()
        self._reported = self.counters.snapshot()
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                self._log_warning("vllm_tier.events_disabled",
                                  detail="enable_kv_events is set but vLLM's KV cache events are off")
        self._jobs: dict[JobId, _Job] = {}
        self._finished: list[JobResult] = []
        self._failed_keys: dict[OffloadKey, float] = {}
        self._closed = False
        self._io = TierIO(  # ValueError (PoolMismatch) for a pool that is missing or of the wrong size
            rows, runtime_dir, pool, staging_chunks=int(staging_chunks), connect_timeout_s=float(connect_timeout_s),
            health_interval_s=float(health_interval_s), counters=self.counters,
            entry=manifest_entry(offloading_spec, fields, chunk_bytes))
        try:
            self._lookups = _Lookups(self)
        except BaseException:
            self._io.close()
            raise

    # --- state ----------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the daemon is reachable right now (lookups and jobs go to kvtier)."""
        return self._io.up

    def _log_warning(self, event: str, **kw) -> None:
        if (io := getattr(self, "_io", None)) is not None:
            io.warn.warning(event, **kw)

    # --- lookups --------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT at once when the chunk is resident on this node (shared memory, no I/O). Otherwise
        RETRY while a background check asks Redis, then HIT or MISS."""
        try:
            until = self._failed_keys.get(key)
            if until is not None:
                if until > time.monotonic():
                    self.counters.add("lookup_misses")
                    return LookupResult.MISS
                del self._failed_keys[key]
            if not self._io.up:
                self.counters.add("lookup_unavailable")
                return LookupResult.MISS
            if self._io.local_has(self.keys(key)):
                self.counters.add("lookup_local_hits")
                return LookupResult.HIT
            found = self._lookups.lookup(key, req_context)
        except Exception as e:
            self.counters.add("lookup_errors")
            self._log_warning("vllm_tier.lookup_failed", error=repr(e))
            return LookupResult.MISS
        if found is None:
            return LookupResult.RETRY
        self.counters.add("lookup_async_hits" if found else "lookup_misses")
        return LookupResult.HIT if found else LookupResult.MISS

    def _exists(self, keys: list[OffloadKey]) -> list[bool]:
        """On the lookup thread: one bounded round trip (the link counts and logs a failure)."""
        if not self._io.up:
            self.counters.add("lookup_unavailable")
            return [False] * len(keys)
        try:
            return self._io.exists(self.keys.many(keys), self._lookup_timeout)
        except Exception as e:  # the link's guard answers misses; this is for a bug in the keys
            self.counters.add("lookup_errors")
            self._log_warning("vllm_tier.lookup_failed", error=repr(e))
            return [False] * len(keys)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        if len(self._failed_keys) > FAILED_KEYS_MAX:
            now = time.monotonic()
            self._failed_keys = {k: t for k, t in self._failed_keys.items() if t > now}

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing to do: kvtier's LRU learns recency from the reads (`Client.get` reports them)."""

    # --- jobs -----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, is_load: bool) -> None:
        rec = _Job(job.job_id, list(job.keys), is_load, time.monotonic())
        try:
            chunk_ids = [int(c) for c in job.chunk_ids]
            if len(chunk_ids) != len(rec.keys):
                raise ValueError(f"{len(rec.keys)} keys but {len(chunk_ids)} chunk ids")
            kind = "load" if is_load else "store"
            rec.future = self._io.submit(kind, self.keys.many(rec.keys), chunk_ids,
                                         rec.submitted + self._timeouts[is_load])
            if rec.future is None:
                self.counters.add("daemon_unavailable")
                self._finished.append(self._result(rec, self._failed(rec, "daemon_unavailable")))
                return
        except Exception as e:
            self._finished.append(self._result(rec, self._failed(rec, repr(e))))
            return
        self._jobs[rec.job_id] = rec

    @staticmethod
    def _failed(rec: _Job, reason: str) -> Outcome:
        return Outcome((False,) * len(rec.keys), 0.0, reason)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._finished = self._finished, []
        for job_id in [j for j, r in self._jobs.items() if r.future is not None and r.future.done()]:
            rec = self._jobs.pop(job_id)
            try:
                assert rec.future is not None
                outcome = rec.future.result()
            except concurrent.futures.CancelledError:  # its client was closed: the daemon was lost
                self.counters.add("daemon_unavailable")
                outcome = self._failed(rec, "daemon_unavailable")
            except BaseException as e:  # a bug in the job itself: the chunks failed, vLLM goes on
                outcome = self._failed(rec, repr(e))
            out.append(self._result(rec, outcome))
        return out

    def _result(self, rec: _Job, outcome: Outcome) -> JobResult:
        ok = outcome.ok
        failed = [k for k, good in zip(rec.keys, ok) if not good]
        n_ok = len(rec.keys) - len(failed)
        kind = "load" if rec.is_load else "store"
        self.counters.add(f"{kind}_chunks_ok", n_ok)
        self.counters.add(f"{kind}_chunks_failed", len(failed))
        successful: tuple[OffloadKey, ...] | None = None
        if failed:
            self.counters.add(f"{kind}_jobs_failed")
            self._log_warning(f"vllm_tier.{kind}_failed", reason=outcome.reason, failed=len(failed),
                              chunks=len(rec.keys))
            if rec.is_load:
                # Never promote these again while they keep failing (vLLM #49176: the livelock).
                until = time.monotonic() + self._failed_ttl
                for k in failed:
                    self._failed_keys[k] = until
                self._lookups.mark_miss(failed)
                successful = tuple(k for k, good in zip(rec.keys, ok) if good) or None
        if not rec.is_load and self._events is not None and n_ok:
            self._events.append(OffloadingEvent(keys=[k for k, good in zip(rec.keys, ok) if good],
                                                medium=self.medium, removed=False, locality=self.locality))
        return JobResult(job_id=rec.job_id, success=not failed, successful_keys=successful,
                         transfer_time=outcome.seconds, transfer_bytes=n_ok * self.block_size_bytes)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._finished)

    def drain_jobs(self) -> None:
        """Wait for every submitted job. Each has a deadline enforced on the loop thread, so this
        returns within the longest timeout plus a grace period even if the daemon hangs."""
        futs = [r.future for r in self._jobs.values() if r.future is not None]
        if not futs:
            return
        _done, late = concurrent.futures.wait(futs, timeout=max(self._timeouts.values()) + 2 * GRACE_S)
        if late:
            self._io.log.error("vllm_tier.drain_incomplete", jobs=len(late))

    # --- events, stats, shutdown ----------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=f"kvtier secondary tier: {name}.",
                                                                labelnames=("tier",))
                for name in Counters.NAMES}

    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        now = self.counters.snapshot()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        if not any(delta.values()):
            return None
        stats = OffloadingConnectorStats()
        for name, n in delta.items():
            if n:
                stats.increase_counter(METRIC_PREFIX + name, n, (self.tier_type,))
        return stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._lookups.shutdown()
            self.drain_jobs()
        finally:
            self._io.close()
