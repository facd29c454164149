"""`kvtier status`'s arena line (kvtier/status.py) for each state of the population."""

from __future__ import annotations

from kvtier.status import render_status


def stats(arena: dict) -> dict:
    tier = {"blocks": 0, "capacity": 4, "bytes": 0, "capacity_bytes": 4 << 20}
    pool = {"block_bytes": 1 << 20, "puts": 0, "puts_dropped": 0, "misses": 0, "redis_corrupt": 0,
            "tiers": {"gpu": tier, "cpu": tier, "redis": {**tier, "capacity": None, "capacity_bytes": None}},
            "arena": arena}
    return {"node": "n", "pid": 1, "uptime_s": 3, "pools": {"p": pool}}


BASE = {"bytes": 8 << 30, "slots": 4096, "in_service": 1024, "backing": "tmpfs /dev/shm, 4 KiB pages",
        "numa_node": None, "huge_fallback": "", "populate_s": None, "error": ""}


def test_populating_failed_and_populated():
    line = render_status(stats({**BASE, "state": "populating", "populated_bytes": 2 << 30}))
    assert "arena  populating 25%  2048.0/8192.0 MiB  slots in service 1024/4096  tmpfs /dev/shm" in line
    line = render_status(stats({**BASE, "state": "failed", "populated_bytes": 1 << 30,
                                "error": "cannot allocate bytes 0..64: No space left on device"}))
    assert "population FAILED at 12%: cannot allocate bytes 0..64: No space left on device" in line
    line = render_status(stats({**BASE, "state": "populated", "populated_bytes": 8 << 30, "in_service": 4096,
                                "populate_s": 21.5, "numa_node": 1, "huge_fallback": "no /dev/hugepages"}))
    assert "arena  populated in 21.5s" in line and "NUMA node 1" in line and "huge pages not used: no /dev" in line
