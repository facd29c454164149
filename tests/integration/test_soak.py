"""A scaled-down soak: several client processes, zipf-distributed shared prefixes, a working set
several times gpu + cpu. Nothing wrong is ever read, hot prefixes stay near the top, nothing that
left a local tier is lost, the daemon's counters agree with what the clients saw, and the policy's
caches are within their bounds.

CI runs it for 60 s. For a long run: KVTIER_SOAK_S=600 .venv/bin/python -m pytest tests/integration/test_soak.py -s
"""

from __future__ import annotations

import os
import time

import pytest

from kvtier.bus.codec import decode_entry
from kvtier.client import Client
from kvtier.core.events import Cause, Removed, Tier
from kvtier.store.redis_blocks import redis_block_key
from kvtier.tools.demo import shared_prompts
from tests.support.waiting import wait_until
from tests.support.workload import demo_totals, start_demo_workers, stop_demo_workers

pytestmark = pytest.mark.integration
SOAK_S = float(os.environ.get("KVTIER_SOAK_S", "60"))
CLIENTS = 3
PREFIXES = 24  # ~380 blocks of shared prompts alone, against 16 + 48 local slots


@pytest.mark.timeout(SOAK_S + 120)
@pytest.mark.slow
async def test_soak_zipf_prefixes_three_times_the_local_capacity(daemon_factory, redis_server, tmp_path):
    # Acked entries trimmed after 5 s; an audit group that reads the facts only at the end keeps
    # them all (nothing a group has not been handed is trimmed), for check 3 below.
    d = daemon_factory(gpu=16, cpu=48, bus_extra="stream_keep_s = 5")
    r = redis_server.client()
    facts_stream = f"kvtier:{{{d.node}}}:facts"
    r.xgroup_create(facts_stream, "soak-audit", id="0", mkstream=True)
    prompts = shared_prompts(PREFIXES)
    assert sum(len(p) // 16 for p in prompts) >= 3 * (16 + 48)
    workers = start_demo_workers(d.runtime_dir, tmp_path, CLIENTS, PREFIXES)
    try:
        deadline = time.monotonic() + SOAK_S
        wait_until(lambda: time.monotonic() > deadline or any(w.poll() is not None for w in workers),
                   timeout=SOAK_S + 5, interval=0.5)
        assert all(w.poll() is None for w in workers), "a client died during the soak"
    finally:
        stop_demo_workers(workers)
    total = demo_totals(tmp_path, CLIENTS)
    assert total["requests"] > 50 and total["local_hits"] > 0 and total["redis_hits"] > 0, total

    # 1. Zero wrong bytes, every read checked against the block's known content.
    assert total["wrong_blocks"] == 0

    # Let the daemon finish what the clients sent (their access reports are flushed on exit).
    wait_until(lambda: all(g["pending"] == 0 and g["lag"] == 0 for s in (f"kvtier:{{{d.node}}}:client", facts_stream)
                           for g in r.xinfo_groups(s) if g["name"] == b"kvtier"),
               timeout=20, message="daemon drained its streams")
    wait_until(lambda: d.pool_stats().get("hits", -1) == total["local_hits"], timeout=10,
               message="daemon hit count caught up")
    stats = d.pool_stats()

    # 2. The daemon's counters agree with what the clients saw.
    assert stats["hits"] == total["local_hits"]
    assert stats["misses"] == total["blocks"] - total["local_hits"]
    assert stats["puts"] == total["put_staged"]
    tiers = stats["tiers"]
    assert tiers["gpu"]["hits"] + tiers["cpu"]["hits"] <= stats["hits"]
    # Every cache the policy keeps is within its bound after the run (docs/operations.md,
    # "What the daemon keeps in memory"), bounds taken from the pool's sizes.
    caches = stats["caches"]
    assert all(c["entries"] <= c["bound"] for c in caches.values()), caches
    assert caches["remote_reads"]["bound"] == 16 + 48 and caches["leases"]["bound"] == (16 + 48) // 2, caches
    # And the daemon's own: the redelivery dedup, the command fences, the outage ledgers.
    own = d.stats()["caches"]
    assert {"coordinator.applied", "cpu.fence", "redis.applied", "gpu.outages"} <= own.keys(), own
    assert all(c["entries"] <= c["bound"] for c in own.values()) and own["coordinator.applied"]["entries"] > 0, own
    # The streams stay a queue: what every group read is trimmed (stream_keep_s), not kept to MAXLEN.
    client_stream = r.xinfo_stream(f"kvtier:{{{d.node}}}:client")
    assert client_stream["length"] < client_stream["entries-added"] // 2, client_stream
    assert d.stats()["streams"][f"kvtier:{{{d.node}}}:client"]["trimmed"] > 0

    async with await Client.connect(d.runtime_dir) as client:
        # 3. Every block that left a local tier is still local or in Redis (no silent loss).
        left = set()
        [(_, facts)] = r.xreadgroup("soak-audit", "audit", {facts_stream: ">"})
        assert facts[0][0] == r.xinfo_stream(facts_stream)["first-entry"][0], "a fact trimmed before the audit read it"
        for ev in (e.event for _id, fields in facts for e in decode_entry(fields[b"e"])):
            if isinstance(ev, Removed) and ev.tier in (Tier.GPU, Tier.CPU) and ev.cause == Cause.EVICT:
                left.add(ev.key)
        assert left, "the soak must have pushed blocks out of the local tiers"
        lost = [k for k in left if client.lookup("t", [k]).length == 0 and not r.exists(redis_block_key("t", k))]
        assert lost == [], f"{len(lost)} of {len(left)} evicted blocks are nowhere"

    r.close()

    # 4. Hot prefixes sit in the local tiers: over the run, the hottest prompt's blocks were read
    # from shared memory far more often than those of the colder half of the prompts.
    hot_rate = total["hot_hits"] / max(1, total["hot_blocks"])
    cold_rate = total["cold_hits"] / max(1, total["cold_blocks"])
    assert total["hot_blocks"] and total["cold_blocks"], total
    assert hot_rate > cold_rate, (hot_rate, cold_rate)
    n = max(1, total["blocks"])
    # Where each wanted block was served from: the workers read through (get remote=True), so a
    # block was in gpu or cpu at lookup, or read straight from Redis.
    gpu_r, cpu_r, via_redis = total["gpu_reads"], total["cpu_reads"], total["via_redis"]
    print(f"\nsoak {SOAK_S:.0f}s: {total['requests']} requests, {total['blocks']} blocks wanted; hit in gpu "
          f"{gpu_r / n:.1%}, cpu {cpu_r / n:.1%}, redis {via_redis / n:.1%} (read through); "
          f"missed {(n - total['local_hits']) / n:.1%} (recomputed and put); hottest prompt {hot_rate:.0%} read "
          f"locally, colder half {cold_rate:.0%}; {len(left)} blocks left a local tier, none lost; "
          f"wrong blocks {total['wrong_blocks']}")
    print("daemon tiers: " + "; ".join(
        f"{t} promoted_in {tiers[t]['promoted_in']} demoted_in {tiers[t]['demoted_in']} evicted {tiers[t]['evicted']} "
        f"failed {tiers[t]['failed']} stale {tiers[t]['stale']}" for t in ("gpu", "cpu", "redis")))
