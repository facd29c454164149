"""One pool's figures for stats.json and the metrics endpoint."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from kvtier.core.events import Tier
from kvtier.core.pins import Pins
from kvtier.tiers.pool import PoolRuntime

TOP_TENANTS = 8  # tenants shown by name (the most blocks pinned); the rest add up under "other"


def pool_snapshot(rt: PoolRuntime) -> dict[str, Any]:
    tiers = {}
    for t in Tier:
        idx = rt.placement.tiers[t]
        if t == Tier.DISK and rt.disk is None:
            continue  # the pool has no disk tier (one turned off stays listed, at capacity 0)
        c = rt.counters.tiers[t.label]
        # Redis: blocks this daemon wrote and has not deleted (TTL expiry and other nodes'
        # writes are not seen); local tiers: blocks resident now.
        blocks = max(0, c.stored + c.demoted_in + c.copied_in - c.evicted) if t == Tier.REDIS else idx.used
        tiers[t.label] = {
            "blocks": blocks,
            "capacity": idx.capacity,
            "bytes": blocks * rt.layout.block_bytes,
            "capacity_bytes": None if idx.capacity is None else idx.capacity * rt.layout.block_bytes,
            "incoming": rt.placement.incoming(t) if t != Tier.REDIS else 0,
            **{k: getattr(c, k) for k in c.__slots__},
        }
    return {
        "block_bytes": rt.layout.block_bytes,
        "puts": rt.counters.puts,
        "puts_dropped": rt.counters.puts_dropped,
        "client_puts_dropped": rt.counters.client_puts_dropped,
        "granted_puts": rt.counters.granted_puts,
        "grants_reclaimed": rt.counters.grants_reclaimed,
        "grants_held": rt.placement.tiers[Tier.CPU].granted,
        "hits": rt.counters.hits,
        "misses": rt.counters.misses,
        "remote_reads": rt.counters.remote_reads,
        "redis_corrupt": rt.redis.stats.corrupt,
        "redis_errors": rt.redis.stats.errors,
        "redis_redirects": rt.redis.batches.redirects,
        "redis_slot_reloads": rt.redis.batches.reloads,
        "redis_skipped": rt.redis.batches.skipped,
        "resync_missing": rt.counters.resync_missing,
        "resync_copies": rt.counters.resync_copies,
        "tiers": tiers,
        "caches": {name: {"entries": n, "bound": most} for name, (n, most) in rt.placement.caches().items()},
        "pins": pins_snapshot(rt.placement.pins, rt.counters.pins_retained, rt.counters.pin_retain_errors),
        "tenants": tenants_snapshot(rt.placement.tenants.counters(rt.layout.block_bytes)),
        "arena": rt.arena.stats() if rt.arena is not None else None,
        "disk": _disk(rt),
    }


def expire_pins(pools: Iterable[PoolRuntime], now: float) -> None:
    """End the pins whose time is up. Every decision does so first; this is for the figures, and
    runs on the event loop, with the decisions (never in the metrics thread)."""
    for rt in pools:
        rt.placement.pins.expire(now)


def pins_snapshot(pins: Pins, retained: int, retain_errors: int) -> dict[str, Any]:
    """Session pins: blocks and bytes held now, per tenant (bounded: the top TOP_TENANTS and
    "other"; "" is the tenant a pin names none), and what pins did since the start."""
    held = sorted(pins.held().items(), key=lambda kv: (-kv[1], kv[0]))
    tenants = dict(held[:TOP_TENANTS])
    if rest := sum(n for _, n in held[TOP_TENANTS:]):
        tenants["other"] = tenants.get("other", 0) + rest
    return {"blocks": len(pins), "bytes": len(pins) * pins.block_bytes, "tenants": tenants,
            **asdict(pins.counts), "retained": retained, "retain_errors": retain_errors}


def tenants_snapshot(counters: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Fair share (core/tenants.py): per tenant, bytes in each node tier, hits and evictions;
    bounded like the pins: the TOP_TENANTS holding the most bytes by name, the rest summed as
    "other" ("" is the default tenant)."""
    ranked = sorted(counters.items(), key=lambda kv: (-sum(v for k, v in kv[1].items() if k.endswith("_bytes")),
                                                      kv[0]))
    out = {who: dict(c) for who, c in ranked[:TOP_TENANTS]}
    for _, c in ranked[TOP_TENANTS:]:
        other = out.setdefault("other", {})
        for k, v in c.items():
            other[k] = other.get(k, 0) + v
    return out


def _disk(rt: PoolRuntime) -> dict[str, Any] | None:
    """The disk tier's state; one that could not open at start shows as off, with why."""
    if rt.disk is not None:
        return {**rt.disk.stats(), "admission": rt.placement.disk_admissions.snapshot()}
    if rt.disk_error is None:
        return None
    return {"state": "off", "path": None, "direct": False, "error": rt.disk_error, "errno": None, "off_at": None,
            "lost": 0, "scanned": 0, "adopted": 0, "adopt_s": None,
            "admission": rt.placement.disk_admissions.snapshot()}
