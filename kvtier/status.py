"""Rendering the daemon's stats snapshot as a compact table for `kvtier status` and the demo."""

from __future__ import annotations

COLUMNS = ("blocks", "capacity", "hits", "stored", "promoted_in", "demoted_in", "evicted", "failed")


def _latency(t: dict) -> str:
    """Mean and worst transfer into the tier, in ms."""
    n = t.get("transfers", 0)
    if not n:
        return f"{'-':>15}"
    return f"{1000 * t['transfer_s'] / n:>7.2f}/{1000 * t['transfer_max_s']:<7.1f}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def render_status(stats: dict) -> str:
    lines = [f"node {stats.get('node')}  pid {stats.get('pid')}  up {stats.get('uptime_s', 0):.0f}s"]
    for name, pool in sorted(stats.get("pools", {}).items()):
        lines.append(
            f"pool {name}: block {_mib(pool['block_bytes'])} MiB  puts {pool['puts']}  "
            f"dropped {pool['puts_dropped']}  misses {pool['misses']}  redis corrupt {pool['redis_corrupt']}"
        )
        lines.append("  tier   " + " ".join(f"{c:>11}" for c in COLUMNS) + "   MiB used/cap  in ms avg/max")
        for tier in ("gpu", "cpu", "redis"):
            t = pool["tiers"][tier]
            cells = " ".join(f"{'-' if t.get(c) is None else t.get(c):>11}" for c in COLUMNS)
            cap = t.get("capacity_bytes")
            used = f"{_mib(t['bytes'])}/{'-' if cap is None else _mib(cap)}"
            lines.append(f"  {tier:<6} {cells} {used:>15}  {_latency(t)}")
    bus = stats.get("bus", {})
    if bus:
        lines.append("bus: " + "  ".join(f"{k} {v}" for k, v in sorted(bus.items())))
    loop = stats.get("loop", {})
    if loop:
        lines.append(f"event loop lag: {loop.get('lag_ms', 0):.1f} ms now, {loop.get('lag_max_ms', 0):.1f} ms max")
    return "\n".join(lines)
