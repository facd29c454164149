"""The Prometheus endpoint: the daemon's own counters, read at scrape time.

A custom collector on a private `CollectorRegistry` (no global registry, no module state): every
scrape reads the per-pool and per-tier counters, the bus counters, the stream lag and pending
counts the daemon last sampled, and the event-loop lag. prometheus-client serves it from its own
thread; reading plain ints and floats across threads is safe under the GIL, and a scrape that
lands mid-update is at most one event behind.

Metric names (documented in docs/operations.md; the Grafana dashboard uses them):
  kvtier_tier_blocks, kvtier_tier_capacity_blocks, kvtier_tier_bytes, kvtier_tier_capacity_bytes
  kvtier_tier_hits_total, kvtier_tier_stored_total, kvtier_tier_promotions_total,
  kvtier_tier_demotions_total, kvtier_tier_copies_total, kvtier_tier_evictions_total,
  kvtier_tier_bytes_in_total, kvtier_tier_failed_transfers_total, kvtier_tier_refused_evictions_total,
  kvtier_tier_stale_commands_total, kvtier_tier_transfer_seconds (histogram)
  kvtier_pool_hits_total, kvtier_pool_misses_total, kvtier_pool_puts_total,
  kvtier_pool_puts_dropped_total, kvtier_pool_client_puts_dropped_total, kvtier_pool_granted_puts_total,
  kvtier_pool_grants_reclaimed_total, kvtier_redis_errors_total,
  kvtier_redis_corrupt_total, kvtier_resync_missing_total, kvtier_resync_copies_total
  kvtier_bus_<counter>_total (published, delivered, acked, dead_lettered, handler_errors,
  redis_errors, reclaimed, deleted_entries), kvtier_stream_pending, kvtier_stream_lag
  kvtier_event_loop_lag_seconds, kvtier_event_loop_lag_max_seconds, kvtier_up,
  kvtier_gc_seconds_total, kvtier_gc_collections_total (by generation), kvtier_gc_pause_max_seconds
  kvtier_arena_bytes, kvtier_arena_populated_bytes, kvtier_arena_populate_failed, kvtier_arena_page_bytes,
  kvtier_ready_seconds
  kvtier_disk_up, kvtier_disk_lost_blocks, kvtier_disk_adopted_blocks, kvtier_disk_scanned_slots,
  kvtier_disk_admissions_total (the disk tier: kvtier/tiers/disk.py; its blocks are in kvtier_tier_* tier="disk")
  kvtier_pinned_blocks{pool,tenant}, kvtier_pinned_bytes, kvtier_pins_total{pool,outcome} (session pins)
  kvtier_tenant_bytes{pool,tier,tenant}, kvtier_tenant_hits_total, kvtier_tenant_evictions_total (fair share)
  kvtier_stream_trimmed_total{stream}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvtier.tiers.stats import LATENCY_BUCKETS_S

_TIER_COUNTERS = {  # TierCounters field -> (metric name, help)
    "hits": ("kvtier_tier_hits", "Blocks clients read from this tier"),
    "stored": ("kvtier_tier_stored", "New blocks from clients stored in this tier"),
    "promoted_in": ("kvtier_tier_promotions", "Blocks promoted into this tier"),
    "demoted_in": ("kvtier_tier_demotions", "Blocks written back (demoted) into this tier"),
    "copied_in": ("kvtier_tier_copies", "Blocks written through into this tier"),
    "evicted": ("kvtier_tier_evictions", "Blocks dropped from this tier"),
    "bytes_in": ("kvtier_tier_bytes_in", "Payload bytes written into this tier"),
    "failed": ("kvtier_tier_failed_transfers", "Transfers into this tier that failed (counted as misses)"),
    "refused": ("kvtier_tier_refused_evictions", "Evictions refused because no lower tier held the block"),
    "stale": ("kvtier_tier_stale_commands", "Commands skipped as redelivered or overtaken"),
}
_POOL_COUNTERS = {
    "hits": ("kvtier_pool_hits", "Blocks clients read from shared memory"),
    "misses": ("kvtier_pool_misses", "Blocks clients asked for past their cached prefix"),
    "remote_reads": ("kvtier_pool_remote_reads", "Blocks clients read straight from Redis (read-through)"),
    "puts": ("kvtier_pool_puts", "Blocks clients handed over"),
    "puts_dropped": ("kvtier_pool_puts_dropped", "Handed-over blocks dropped (no room, bad staging, Redis refused)"),
    "client_puts_dropped": ("kvtier_pool_client_puts_dropped",
                            "Blocks clients could not hand over (staging full, the bus down), as they count them"),
    "granted_puts": ("kvtier_pool_granted_puts", "Blocks clients wrote into cpu slots granted to them (one pass)"),
    "grants_reclaimed": ("kvtier_pool_grants_reclaimed",
                         "Granted cpu slots taken back unused (client gone, expired, duplicate, bad header)"),
    "redis_errors": ("kvtier_redis_errors", "Errors from Redis on block reads and writes"),
    "redis_corrupt": ("kvtier_redis_corrupt", "Values in Redis that failed verification and were deleted"),
    "redis_redirects": ("kvtier_redis_redirects", "Block commands a Redis Cluster redirected (MOVED, ASK, TRYAGAIN)"),
    "redis_slot_reloads": ("kvtier_redis_slot_reloads", "Cluster slot-map reloads after a master failed a batch"),
    "redis_skipped": ("kvtier_redis_skipped", "Block commands failed at once: their cluster master is marked down"),
    "resync_missing": ("kvtier_resync_missing", "Local blocks the re-replication sweep found missing in Redis"),
    "resync_copies": ("kvtier_resync_copies", "Blocks the re-replication sweep wrote to Redis again"),
}
BUS_COUNTERS = ("published", "delivered", "acked", "dead_lettered", "handler_errors", "redis_errors", "reclaimed",
                "deleted_entries")


class DaemonCollector(Collector):
    """Reads a stats snapshot (the same dict stats.json holds) at every scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        yield GaugeMetricFamily("kvtier_up", "1 while the daemon serves", value=1)
        gauges = {
            name: GaugeMetricFamily(name, doc, labels=["pool", "tier"])
            for name, doc in (("kvtier_tier_blocks", "Blocks resident in the tier (Redis: written by this node)"),
                              ("kvtier_tier_capacity_blocks", "Slots of the tier"),
                              ("kvtier_tier_bytes", "Bytes resident in the tier"),
                              ("kvtier_tier_capacity_bytes", "Bytes the tier can hold"))
        }
        tier_c = {f: CounterMetricFamily(n, d, labels=["pool", "tier"]) for f, (n, d) in _TIER_COUNTERS.items()}
        hist = HistogramMetricFamily("kvtier_tier_transfer_seconds",
                                     "Time from command receipt until a block is visible in the tier",
                                     labels=["pool", "tier"])
        pool_c = {f: CounterMetricFamily(n, d, labels=["pool"]) for f, (n, d) in _POOL_COUNTERS.items()}
        for pool, p in sorted(s.get("pools", {}).items()):
            for f, m in pool_c.items():
                m.add_metric([pool], p.get(f, 0))
            for tier, t in p["tiers"].items():
                labels = [pool, tier]
                gauges["kvtier_tier_blocks"].add_metric(labels, t["blocks"])
                gauges["kvtier_tier_bytes"].add_metric(labels, t["bytes"])
                if t.get("capacity") is not None:
                    gauges["kvtier_tier_capacity_blocks"].add_metric(labels, t["capacity"])
                    gauges["kvtier_tier_capacity_bytes"].add_metric(labels, t["capacity_bytes"])
                for f, m in tier_c.items():
                    m.add_metric(labels, t.get(f, 0))
                counts, running = t.get("transfer_buckets", []), 0
                buckets = []
                for le, n in zip([*map(str, LATENCY_BUCKETS_S), "+Inf"], counts):
                    running += n
                    buckets.append((le, running))
                hist.add_metric(labels, buckets, t.get("transfer_s", 0.0))
        yield from gauges.values()
        yield from _arena_gauges(s)
        yield from _disk_metrics(s)
        yield from _pin_metrics(s)
        yield from _tenant_metrics(s)
        yield from tier_c.values()
        yield hist
        yield from pool_c.values()
        bus = s.get("bus", {})
        for f in BUS_COUNTERS:
            yield CounterMetricFamily(f"kvtier_bus_{f}", f"Stream entries: {f.replace('_', ' ')}", value=bus.get(f, 0))
        pending = GaugeMetricFamily("kvtier_stream_pending", "Entries delivered to a consumer and not yet acked",
                                    labels=["stream"])
        lag = GaugeMetricFamily("kvtier_stream_lag", "Entries in the stream not yet delivered to its group",
                                labels=["stream"])
        trimmed = CounterMetricFamily("kvtier_stream_trimmed", "Entries every group had read, trimmed by age "
                                      "([bus] stream_keep_s)", labels=["stream"])
        for stream, info in sorted(s.get("streams", {}).items()):
            pending.add_metric([stream], info.get("pending", 0))
            if info.get("lag") is not None:
                lag.add_metric([stream], info["lag"])
            trimmed.add_metric([stream], info.get("trimmed", 0))
        yield pending
        yield lag
        yield trimmed
        loop = s.get("loop", {})
        yield GaugeMetricFamily("kvtier_event_loop_lag_seconds", "How late a 100 ms sleep woke up, last sample",
                                value=loop.get("lag_ms", 0.0) / 1000)
        yield GaugeMetricFamily("kvtier_event_loop_lag_max_seconds", "Worst event-loop lag since start",
                                value=loop.get("lag_max_ms", 0.0) / 1000)
        gc_s = CounterMetricFamily("kvtier_gc_seconds", "Time in Python's garbage collector (it stalls the event loop)",
                                   labels=["generation"])
        gc_n = CounterMetricFamily("kvtier_gc_collections", "Collections of Python's garbage collector",
                                   labels=["generation"])
        for g, (secs, n) in enumerate(zip(loop.get("gc_s", ()), loop.get("gc_collections", ()))):
            gc_s.add_metric([str(g)], secs)
            gc_n.add_metric([str(g)], n)
        yield gc_s
        yield gc_n
        yield GaugeMetricFamily("kvtier_gc_pause_max_seconds", "Longest garbage collection since start",
                                value=loop.get("gc_pause_max_ms", 0.0) / 1000)


def _arena_gauges(s: dict[str, Any]) -> list[GaugeMetricFamily]:
    """The cpu arenas' population (kvtier/daemon/population.py): a dashboard shows its progress."""
    out = {name: GaugeMetricFamily(name, doc, labels=["pool"]) for name, doc in (
        ("kvtier_arena_bytes", "Payload bytes of the cpu arena"),
        ("kvtier_arena_populated_bytes", "Payload bytes of the cpu arena populated and in service"),
        ("kvtier_arena_populate_failed", "1 when the arena's population stopped on an error (it serves what it has)"),
        ("kvtier_arena_page_bytes", "Page size backing the arena (2 MiB: huge pages)"),
    )}
    for pool, p in sorted(s.get("pools", {}).items()):
        a = p.get("arena")
        if not a:
            continue
        out["kvtier_arena_bytes"].add_metric([pool], a["bytes"])
        out["kvtier_arena_populated_bytes"].add_metric([pool], a["populated_bytes"])
        out["kvtier_arena_populate_failed"].add_metric([pool], 1 if a["state"] == "failed" else 0)
        out["kvtier_arena_page_bytes"].add_metric([pool], a["page_bytes"])
    ready = GaugeMetricFamily("kvtier_ready_seconds", "Seconds from the daemon's start to READY")
    if s.get("ready_s") is not None:
        ready.add_metric([], s["ready_s"])
    return [*out.values(), ready]


def _disk_metrics(s: dict[str, Any]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """The disk tiers: whether each is on (an I/O error turns it off), and its adoption after a start."""
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        name: GaugeMetricFamily(name, doc, labels=["pool"]) for name, doc in (
            ("kvtier_disk_up", "1 while the disk tier serves; 0 once an I/O error (EIO, ENOSPC, EROFS) turned it off"),
            ("kvtier_disk_lost_blocks", "Blocks the disk tier held when it was turned off"),
            ("kvtier_disk_adopted_blocks", "Blocks adopted again from the block file after the start"),
            ("kvtier_disk_scanned_slots", "Slots of the block file whose headers were scanned since the start"),
        )}
    admissions = CounterMetricFamily("kvtier_disk_admissions", "Blocks the cpu tier shed, by the disk admission's "
                                     "verdict (admitted or not, and why)", labels=["pool", "reason"])
    for pool, p in sorted(s.get("pools", {}).items()):
        d = p.get("disk")
        if not d:
            continue
        out["kvtier_disk_up"].add_metric([pool], 0 if d["state"] == "off" else 1)
        out["kvtier_disk_lost_blocks"].add_metric([pool], d["lost"])
        out["kvtier_disk_adopted_blocks"].add_metric([pool], d["adopted"])
        out["kvtier_disk_scanned_slots"].add_metric([pool], d["scanned"])
        for reason, n in sorted(d["admission"].items()):
            admissions.add_metric([pool, reason], n)
    return [*out.values(), admissions]


PIN_OUTCOMES = ("pinned", "extended", "refused_budget", "refused_node", "released", "expired", "retained",
                "retain_errors")


def _pin_metrics(s: dict[str, Any]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """Session pins (kvtier/core/pins.py). The tenant label is bounded: the snapshot names the
    top tenants and sums the rest as "other"."""
    blocks = GaugeMetricFamily("kvtier_pinned_blocks", "Blocks session pins hold, by the tenant charged",
                               labels=["pool", "tenant"])
    nbytes = GaugeMetricFamily("kvtier_pinned_bytes", "Bytes session pins hold", labels=["pool"])
    outcomes = CounterMetricFamily("kvtier_pins", "Blocks pinned, extended, refused (over the tenant's budget or "
                                   "the node's share), let go, expired; Redis copies retained or not",
                                   labels=["pool", "outcome"])
    for pool, p in sorted(s.get("pools", {}).items()):
        pins = p.get("pins")
        if not pins:
            continue
        for tenant, n in sorted(pins["tenants"].items()):
            blocks.add_metric([pool, tenant], n)
        nbytes.add_metric([pool], pins["bytes"])
        for outcome in PIN_OUTCOMES:
            outcomes.add_metric([pool, outcome], pins[outcome])
    return [blocks, nbytes, outcomes]


def _tenant_metrics(s: dict[str, Any]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """Fair share (kvtier/core/tenants.py), with the tenant label bounded as the pins' is."""
    nbytes = GaugeMetricFamily("kvtier_tenant_bytes", "Bytes a tenant's blocks take in a node tier",
                               labels=["pool", "tier", "tenant"])
    hits = CounterMetricFamily("kvtier_tenant_hits", "Blocks of a tenant read from a node tier",
                               labels=["pool", "tenant"])
    evicted = CounterMetricFamily("kvtier_tenant_evictions", "Blocks of a tenant dropped from a node tier",
                                  labels=["pool", "tenant"])
    for pool, p in sorted(s.get("pools", {}).items()):
        for tenant, c in sorted((p.get("tenants") or {}).items()):
            for tier in ("gpu", "cpu", "disk"):
                if f"{tier}_bytes" in c:
                    nbytes.add_metric([pool, tier, tenant], c[f"{tier}_bytes"])
            hits.add_metric([pool, tenant], c.get("hits", 0))
            evicted.add_metric([pool, tenant], c.get("evicted", 0))
    return [nbytes, hits, evicted]


class MetricsServer:
    """prometheus-client's HTTP server on `listen` ("host:port"), serving one DaemonCollector."""

    def __init__(self, listen: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        host, _, port = listen.rpartition(":")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(snapshot))
        self._server, self._thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        self.url = f"http://{listen.rpartition(':')[0]}:{self._server.server_port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
