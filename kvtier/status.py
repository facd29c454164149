"""Rendering the daemon's stats snapshot as a compact table for `kvtier status` and the demo."""

from __future__ import annotations

import time

COLUMNS = ("blocks", "capacity", "hits", "stored", "promoted_in", "demoted_in", "evicted", "failed")


def _latency(t: dict) -> str:
    """Mean and worst transfer into the tier, in ms."""
    n = t.get("transfers", 0)
    if not n:
        return f"{'-':>15}"
    return f"{1000 * t['transfer_s'] / n:>7.2f}/{1000 * t['transfer_max_s']:<7.1f}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def human_bytes(n: float) -> str:
    """1.5 GiB, 2.0 MiB, 8 KiB, 512 B: a size in the unit that shows it."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def liveness(stats: dict, now: float, alive: bool) -> str | None:
    """Why these stats are not a running daemon's, or None when they are: its pid is gone, or it
    has not written them for several intervals (hung, or stopped on another host's pid)."""
    age = now - float(stats.get("written_at") or 0)
    seen = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(stats.get("written_at") or 0)))
    last = f"last seen {seen}, {age:.0f} s ago: pid {stats.get('pid')}, node {stats.get('node')}"
    if not alive:
        return f"daemon not running ({last})"
    if age > max(10.0, 5 * float(stats.get("stats_interval_s") or 1.0)):
        return f"daemon not writing its stats ({last}; it is alive but hung, or busy past its watchdog)"
    return None


RATES = ("hits", "stored", "promoted_in", "demoted_in", "evicted", "failed")


def _rates(pool: dict, prev_pool: dict | None, dt: float) -> str:
    """Per-second rates of the tier counters since the previous snapshot."""
    cells = []
    for tier in [t for t in ("gpu", "cpu", "disk", "redis") if t in pool["tiers"]]:
        now, before = pool["tiers"][tier], (prev_pool or {}).get("tiers", {}).get(tier, {})
        per_s = "/".join(f"{max(0, now.get(c, 0) - before.get(c, 0)) / dt:.0f}" for c in RATES)
        cells.append(f"{tier} {per_s}")
    return "  rates/s (" + "/".join(RATES) + "): " + "  ".join(cells)


def _arena(a: dict) -> str:
    pct = 100 * a["populated_bytes"] / a["bytes"] if a["bytes"] else 100.0
    state = {"populating": f"populating {pct:.0f}%", "failed": f"population FAILED at {pct:.0f}%: {a['error']}"}
    took = f" in {a['populate_s']:.1f}s" if a.get("populate_s") is not None and a["state"] == "populated" else ""
    numa = "" if a.get("numa_node") is None else f"  NUMA node {a['numa_node']}"
    huge = f"  (huge pages not used: {a['huge_fallback']})" if a.get("huge_fallback") else ""
    return (f"  arena  {state.get(a['state'], 'populated' + took)}  "
            f"{_mib(a['populated_bytes'])}/{_mib(a['bytes'])} MiB  slots in service {a['in_service']}/{a['slots']}  "
            f"{a['backing']}{numa}{huge}")


def _disk(d: dict) -> str:
    """The disk tier's state: on, adopting what its file held, or OFF after an I/O error."""
    if d["state"] == "off":
        state = f"OFF since an I/O error ({d['error']}); {d['lost']} blocks dropped with it; a restart retries"
    elif d["state"] == "adopting":
        state = f"adopting: {d['scanned']} slots scanned, {d['adopted']} blocks adopted"
    else:
        took = "" if d.get("adopt_s") is None else f" in {d['adopt_s']:.1f}s"
        state = f"on  {d['adopted']} blocks adopted at start{took}"
    adm = d.get("admission") or {}
    return (f"  disk   {state}  {'O_DIRECT' if d['direct'] else 'page cache'}  {d['path'] or ''}  "
            f"admission: " + " ".join(f"{k} {v}" for k, v in sorted(adm.items())))


def _pins(p: dict | None) -> list[str]:
    """Session pins: what they hold now, by tenant, and what was refused (shown once any was made)."""
    if not p or not (p["blocks"] or p["pinned"] or p["refused_budget"] or p["refused_node"]):
        return []
    who = "  ".join(f"{t or '(none)'} {n}" for t, n in p["tenants"].items())
    lost = f", {p['retain_errors']} Redis TTLs not lengthened" if p.get("retain_errors") else ""
    return [f"  pins   {p['blocks']} blocks, {human_bytes(p['bytes'])}  {who}  refused {p['refused_budget']} "
            f"over budget, {p['refused_node']} over the node's share  expired {p['expired']}{lost}"]


def _tenants(t: dict | None) -> list[str]:
    """Fair share: each tenant's bytes on the node, hits and evictions (shown once a tenant other
    than the default has blocks)."""
    if not t or set(t) <= {""}:
        return []
    return ["  tenants " + "  ".join(
        f"{who or '(default)'} {human_bytes(sum(v for k, v in c.items() if k.endswith('_bytes')))} "
        f"hits {c.get('hits', 0)} evicted {c.get('evicted', 0)}" for who, c in t.items())]


def _models(m: dict | None) -> list[str]:
    """Which models' KV the pool holds: its manifest's namespaces (core/manifest.py)."""
    if not m or not m.get("namespaces"):
        return []
    bad = f", {m['malformed']} malformed entries dropped" if m.get("malformed") else ""
    out = [f"  models: {m['namespaces']} key namespaces{bad} (stored: handed over since first seen)"]
    for e in m.get("models", []):
        w = e.get("weights", {})
        rev = f"  rev {str(w['revision'])[:12]}" if w.get("revision") else ""
        quant = "".join(f"  {k} {w[k]}" for k in ("quantization", "kv_cache_dtype") if w.get(k) not in (None, "auto"))
        out.append(f"    {e.get('model') or '?'}  {e.get('engine')} {e.get('engine_version')}  "
                   f"weights {str(w.get('weights', '?'))[:24]}{rev}{quant}  "
                   f"stored {e.get('stored_blocks', 0)} blocks, {human_bytes(e.get('stored_bytes', 0))}")
    return out


def render_status(stats: dict, prev: dict | None = None) -> str:
    """The table; with `prev` (an earlier snapshot, as `status --watch` keeps) also rates per second."""
    lines = [f"node {stats.get('node')}  pid {stats.get('pid')}  up {stats.get('uptime_s', 0):.0f}s"]
    dt = (stats.get("written_at", 0) - prev.get("written_at", 0)) if prev else 0.0
    for name, pool in sorted(stats.get("pools", {}).items()):
        lines.append(
            f"pool {name}: block {human_bytes(pool['block_bytes'])}  puts {pool['puts']}  "
            f"dropped {pool['puts_dropped']} (by clients {pool.get('client_puts_dropped', 0)})  "
            f"misses {pool['misses']}  redis corrupt {pool['redis_corrupt']}"
        )
        lines.append("  tier   " + " ".join(f"{c:>11}" for c in COLUMNS) + "   MiB used/cap  in ms avg/max")
        for tier in [t for t in ("gpu", "cpu", "disk", "redis") if t in pool["tiers"]]:
            t = pool["tiers"][tier]
            cells = " ".join(f"{'-' if t.get(c) is None else t.get(c):>11}" for c in COLUMNS)
            cap = t.get("capacity_bytes")
            used = f"{_mib(t['bytes'])}/{'-' if cap is None else _mib(cap)}"
            lines.append(f"  {tier:<6} {cells} {used:>15}  {_latency(t)}")
        arena = pool.get("arena")
        if arena:
            lines.append(_arena(arena))
        if pool.get("disk"):
            lines.append(_disk(pool["disk"]))
        lines.extend(_pins(pool.get("pins")))
        lines.extend(_tenants(pool.get("tenants")))
        lines.extend(_models(pool.get("models")))
        if prev and dt > 0 and prev.get("epoch") == stats.get("epoch"):
            lines.append(_rates(pool, prev.get("pools", {}).get(name), dt))
    bus = stats.get("bus", {})
    if bus:
        lines.append("bus: " + "  ".join(f"{k} {v}" for k, v in sorted(bus.items())))
    streams = stats.get("streams", {})
    if streams:
        lines.append("streams: " + "  ".join(f"{n.split('}:', 1)[-1]} pending {i.get('pending', 0)} lag {i.get('lag')}"
                                             for n, i in sorted(streams.items())))
    if stats.get("metrics_url"):
        lines.append(f"metrics: {stats['metrics_url']}")
    loop = stats.get("loop", {})
    if loop:
        gc = f", gc pauses {loop['gc_pause_max_ms']:.1f} ms max" if "gc_pause_max_ms" in loop else ""
        lines.append(f"event loop lag: {loop.get('lag_ms', 0):.1f} ms now, {loop.get('lag_max_ms', 0):.1f} ms max{gc}")
    return "\n".join(lines)
