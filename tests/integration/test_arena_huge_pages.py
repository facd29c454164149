"""The cpu arena on 2 MiB pages, through a real daemon: a tmpfs mounted huge=within_size, a
hugetlbfs with pages set aside, a hugetlbfs without enough of them (a clear refusal, or with
"auto" a clean fall-back to /dev/shm), and NUMA binding on this machine's one node.

The kernel is asked whether the pages really are huge: the daemon's /proc/<pid>/smaps for the
arena's mapping (ShmemPmdMapped for tmpfs, KernelPageSize for hugetlbfs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.shm.segment import ShmSegment
from tests.support.blocks import put_and_read_back
from tests.support.daemon_proc import POOL_TOML
from tests.support.mounts import huge_pages_set_aside, mounted, need_root
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def pool(cpu_bytes: str) -> str:
    return POOL_TOML.format(name="t", gpu=0, cpu=1).replace("cpu_blocks = 1", f'cpu_bytes = "{cpu_bytes}"')


def arena_toml(**kw) -> str:
    return "\n[arena]\n" + "".join(f'{k} = "{v}"\n' for k, v in kw.items())


def smaps_of(pid: int, path: Path) -> dict[str, int]:
    """The kB figures of the daemon's mapping of `path`."""
    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    out: dict[str, int] = {}
    inside = False
    for line in lines:
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            inside = line.rstrip().endswith(str(path))
            continue
        if inside and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
            out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


async def put_get(d, salt: bytes, n: int = 8) -> None:
    async with await Client.connect(d.runtime_dir) as client:
        await put_and_read_back(client, salt, n, seed=len(salt))


def populated(d) -> dict:
    """The arena's figures once this daemon process (not an earlier one's stats.json) says populated."""
    def done() -> dict | None:
        s = d.stats() if d.runtime_dir.joinpath("stats.json").exists() else {}
        a = (s.get("pools", {}).get("t") or {}).get("arena") or {}
        return a if s.get("pid") == d.proc.pid and a.get("state") == "populated" else None

    return wait_until(done, timeout=60, message="the arena populated")


async def test_arena_on_tmpfs_huge_pages_then_back_to_dev_shm(daemon_factory, tmp_path):
    need_root()
    with mounted("tmpfs", tmp_path / "thp", "huge=within_size,size=512m,mode=1777") as thp:
        d = daemon_factory(node="thp", persist_arena=True, pools_toml=pool("256MiB"),
                           extra=arena_toml(huge_pages="on", huge_pages_dir=thp))
        name = f"kvtier.{d.node}.t.cpu"
        try:
            a = populated(d)
            assert a["page_bytes"] == 2 << 20 and "within_size" in a["backing"], a
            assert (thp / name).exists() and not ShmSegment.exists(name), "the arena lives on the huge-page mount"
            await put_get(d, b"thp")
            huge_kb = smaps_of(d.proc.pid, thp / name).get("ShmemPmdMapped", 0)
            assert huge_kb >= 128 << 10, f"the kernel maps {huge_kb} kB of the arena with 2 MiB pages"
            d.stop()
            d.start()  # warm, from the huge-page mount
            assert "arena.reattached" in d.log_tail(20000)
            await put_get(d, b"thp-again")
            # Huge pages off again: the old arena is removed from the mount, a new one made in /dev/shm.
            d.stop()
            d.config.write_text(d.config.read_text().replace('huge_pages = "on"', 'huge_pages = "off"'))
            d.start()
            assert not (thp / name).exists() and ShmSegment.exists(name)
            assert populated(d)["page_bytes"] == 4096
            await put_get(d, b"plain")
        finally:
            d.stop_or_kill(20)
            ShmSegment.unlink_name(name)
            ShmSegment.unlink_name(name, thp)


async def test_hugetlbfs_arena_and_a_hugetlbfs_too_small(daemon_factory, tmp_path):
    need_root()
    with mounted("hugetlbfs", tmp_path / "htlb", "pagesize=2M,mode=1777") as htlb:
        # No pages set aside for this arena: "on" refuses to start, and says why.
        free = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
        need = f"{(free + 64) * 2}MiB"
        d = daemon_factory(node="htlb-short", start=False, pools_toml=pool(need),
                           extra=arena_toml(huge_pages="on", huge_pages_dir=htlb))
        d.start(wait_ready=False)
        wait_until(lambda: not d.alive, timeout=30, message="the daemon refuses to start")
        assert d.proc.returncode != 0 and "free huge pages" in d.log_tail(20000), d.log_tail()
        assert not any(htlb.iterdir()) and not ShmSegment.exists(f"kvtier.{d.node}.t.cpu")
        # "auto": the same start falls back to /dev/shm, with the reason logged.
        d2 = daemon_factory(node="htlb-auto", pools_toml=pool(need),
                            extra=arena_toml(huge_pages="auto", huge_pages_dir=htlb))
        assert "arena.huge_pages_unavailable" in d2.log_tail(20000)
        assert populated(d2)["page_bytes"] == 4096 and d2.pool_stats()["arena"]["huge_fallback"]
        await put_get(d2, b"fallback")
        d2.stop()

        # 80 pages (160 MiB) more set aside: an arena of nearly all the free pages goes on them.
        with huge_pages_set_aside(80) as got:
            assert got >= 70, f"the kernel set aside only {got} huge pages"
            free = int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text())
            d3 = daemon_factory(node="htlb", persist_arena=True, pools_toml=pool(f"{(free - 8) * 2}MiB"),
                                extra=arena_toml(huge_pages="on", huge_pages_dir=htlb))
            name = f"kvtier.{d3.node}.t.cpu"
            try:
                a = populated(d3)
                assert a["backing"].startswith("hugetlbfs") and a["page_bytes"] == 2 << 20, a
                await put_get(d3, b"hugetlbfs")
                sm = smaps_of(d3.proc.pid, htlb / name)
                # (smaps counts a page mapped by one process as Private_Hugetlb, shared or not)
                mapped = sm.get("Shared_Hugetlb", 0) + sm.get("Private_Hugetlb", 0)
                assert sm.get("KernelPageSize") == 2048 and mapped >= (free - 8) * 2048, sm
                # Warm: the file holds its pages already, and there are too few free for a second
                # copy; the restart must count only what is missing.
                assert int(Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages").read_text()) < free // 2
                d3.stop()
                d3.start()
                assert "arena.reattached" in d3.log_tail(20000)
                await put_get(d3, b"hugetlbfs-warm")
            finally:
                d3.stop_or_kill(20)
                ShmSegment.unlink_name(name, htlb)


async def test_numa_binding_to_this_machines_node_and_a_missing_node(daemon_factory):
    """One node here: binding the arena to it is checked end to end (the kernel's numa_maps for
    the daemon's mapping says bind:0); what a second node would change is not measured."""
    d = daemon_factory(node="numa", pools_toml=pool("64MiB"), extra=arena_toml(numa_node="0"))
    name = f"kvtier.{d.node}.t.cpu"
    try:
        assert populated(d)["numa_node"] == 0
        line = next(x for x in Path(f"/proc/{d.proc.pid}/numa_maps").read_text().splitlines() if name in x)
        assert "bind:0" in line and "N0=" in line, line
        await put_get(d, b"numa")
    finally:
        d.stop_or_kill(20)
    bad = daemon_factory(node="numa-bad", start=False, pools_toml=pool("64MiB"), extra=arena_toml(numa_node="7"))
    bad.start(wait_ready=False)
    wait_until(lambda: not bad.alive, timeout=30, message="the daemon refuses a node it does not have")
    assert bad.proc.returncode != 0 and "NUMA node 7 does not exist" in bad.log_tail(20000)
    assert not ShmSegment.exists(f"kvtier.{bad.node}.t.cpu")
    assert os.path.exists("/sys/devices/system/node/node0")
