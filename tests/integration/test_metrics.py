"""Operations surface of a live daemon: the Prometheus endpoint and `kvtier status --watch`."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Client
from kvtier.daemon.metrics import BUS_COUNTERS
from tests.support.blocks import make_kv
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

DOCUMENTED = {  # the names docs/operations.md lists and the dashboard uses
    "kvtier_up", "kvtier_tier_blocks", "kvtier_tier_capacity_blocks", "kvtier_tier_bytes",
    "kvtier_tier_capacity_bytes", "kvtier_tier_hits", "kvtier_tier_stored", "kvtier_tier_promotions",
    "kvtier_tier_demotions", "kvtier_tier_copies", "kvtier_tier_evictions", "kvtier_tier_bytes_in",
    "kvtier_tier_failed_transfers", "kvtier_tier_refused_evictions", "kvtier_tier_stale_commands",
    "kvtier_tier_transfer_seconds", "kvtier_pool_hits", "kvtier_pool_misses", "kvtier_pool_puts",
    "kvtier_pool_puts_dropped", "kvtier_pool_client_puts_dropped", "kvtier_redis_errors", "kvtier_redis_corrupt",
    "kvtier_stream_pending",
    "kvtier_stream_lag", "kvtier_event_loop_lag_seconds", "kvtier_event_loop_lag_max_seconds",
    "kvtier_arena_bytes", "kvtier_arena_populated_bytes", "kvtier_arena_populate_failed", "kvtier_arena_page_bytes",
    "kvtier_ready_seconds", "kvtier_disk_up", "kvtier_disk_lost_blocks", "kvtier_disk_adopted_blocks",
    "kvtier_disk_scanned_slots", "kvtier_disk_admissions", "kvtier_gc_seconds", "kvtier_gc_collections",
    "kvtier_gc_pause_max_seconds",
    *(f"kvtier_bus_{c}" for c in BUS_COUNTERS),
}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return {f.name for f in text_string_to_metric_families(r.read().decode())}


async def test_metrics_endpoint_serves_the_documented_names_and_moves_with_the_blocks(daemon_factory):
    d = daemon_factory(gpu=2, cpu=4)
    wait_until(lambda: d.stats().get("metrics_url") if (d.runtime_dir / "stats.json").exists() else None,
               timeout=10, message="metrics_url in stats.json")
    url = d.stats()["metrics_url"]
    assert url.startswith("http://127.0.0.1:"), "loopback only"
    assert DOCUMENTED <= families(url), sorted(DOCUMENTED - families(url))

    before = scrape(url)
    gpu = ("pool", "t"), ("tier", "gpu")
    assert before[("kvtier_tier_capacity_blocks", gpu)] == 2 and before[("kvtier_tier_blocks", gpu)] == 0
    # A 4-slot arena is one chunk: populated before READY.
    arena = (("pool", "t"),)
    assert before[("kvtier_arena_populated_bytes", arena)] == before[("kvtier_arena_bytes", arena)] == 4 * 8192
    assert before[("kvtier_arena_page_bytes", arena)] == 4096 and before[("kvtier_arena_populate_failed", arena)] == 0
    assert 0 < before[("kvtier_ready_seconds", ())] < 30
    # The collector was set for serving: start-up's objects frozen out of collections (daemon/collector.py).
    assert d.stats()["loop"]["gc_frozen"] > 10_000
    async with await Client.connect(d.runtime_dir) as client:
        for c in range(4):  # 8 blocks into 2 gpu + 4 cpu slots: stores, demotions, evictions
            keys = client.block_keys("t", list(range(c * 1000, c * 1000 + 32)), salt=b"metrics")
            assert (await client.put("t", keys, make_kv(2, seed=c))).dropped == 0
        keys = client.block_keys("t", list(range(3000, 3032)), salt=b"metrics")

        def moved() -> bool:
            m = scrape(url)
            return (m[("kvtier_pool_puts_total", (("pool", "t"),))] == 8
                    and m[("kvtier_tier_demotions_total", (("pool", "t"), ("tier", "redis")))] > 0
                    and m[("kvtier_tier_evictions_total", gpu)] > 0)

        await async_wait_until(moved, timeout=20, message="metrics follow the blocks")
        out = make_kv(2, seed=0)
        await client.get("t", keys, out)
    after = scrape(url)
    assert after[("kvtier_tier_blocks", gpu)] > 0
    assert after[("kvtier_tier_transfer_seconds_count", gpu)] >= 2
    assert after[("kvtier_tier_transfer_seconds_bucket", tuple(sorted(gpu + (("le", "+Inf"),))))] == \
        after[("kvtier_tier_transfer_seconds_count", gpu)]
    assert after[("kvtier_bus_published_total", ())] > before[("kvtier_bus_published_total", ())]
    # Collections are timed one by one: none, or a longest pause within their total time
    # (the stats round each generation's seconds to 0.1 ms).
    gens = [(("generation", str(g)),) for g in range(3)]
    n = [after[("kvtier_gc_collections_total", g)] for g in gens]
    secs = sum(after[("kvtier_gc_seconds_total", g)] for g in gens)
    pause = after[("kvtier_gc_pause_max_seconds", ())]
    assert all(a >= before[("kvtier_gc_collections_total", g)] for a, g in zip(n, gens))
    assert (0 < pause <= secs + 0.0002) if sum(n) else (pause == secs == 0), (n, secs, pause)
    await async_wait_until(lambda: ("kvtier_stream_pending", (("stream", f"kvtier:{{{d.node}}}:client"),))
                           in scrape(url), timeout=10, message="stream samples")
    assert d.stop() == 0


def test_status_watch_refreshes_with_rates(daemon_factory):
    d = daemon_factory()
    wait_until(lambda: (d.runtime_dir / "stats.json").exists(), timeout=10, message="stats.json")
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--runtime-dir", str(d.runtime_dir),
                          "--watch", "--interval", "0.3", "--count", "3"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.count(f"node {d.node}") == 3, out
    assert out.count("rates/s (hits/stored/promoted_in/demoted_in/evicted/failed)") == 2, "rates from the 2nd frame on"
    assert "event loop lag" in out and "gc pauses" in out, out
    assert "metrics: http://127.0.0.1:" in out and "streams: client pending" in out
    assert "arena  populated in" in out and "slots in service 16/16  tmpfs /dev/shm, 4 KiB pages" in out, out
    assert d.stop() == 0


def test_the_dashboard_uses_only_metrics_the_daemon_serves() -> None:
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvtier.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"kvtier_[a-z_]+", e)}
    served = {n for n in DOCUMENTED} | {f"{n}_total" for n in DOCUMENTED}
    assert used and used <= served, sorted(used - served)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
