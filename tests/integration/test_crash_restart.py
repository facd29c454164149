"""SIGKILL the daemon during a put/get/migrate workload, restart it, and check what survived.

Two client processes (the demo worker: zipf prompts, every block it reads checked against its
known content) run throughout; the daemon, with tiers small enough that blocks keep moving to
Redis and back, is killed KILLS times (20 in CI; KVTIER_CRASH_KILLS=500 by hand). Four kills in
five land at random moments; one in five is the daemon killing itself at a named failpoint
(kvtier/failpoints.py): bytes in shared memory before the index knows them, a slot half written,
outcomes published before the acks, a Redis pipeline in flight. After every restart:

- READY=1 arrives within the start timeout;
- the cpu arena was re-attached and re-indexed from its slot headers ("arena.reattached");
- no slot is left torn (odd generation; the half-written one was discarded), and every block a
  slot header calls valid holds exactly its bytes, in the cpu arena and in the gpu pool;
- /dev/shm holds this node's directory, gpu and cpu segments and the live clients' staging
  segments, nothing else.

At the end the clients have read no wrong byte, and every pending stream entry has been
reclaimed and acked.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.disk.reader import DiskSlots
from kvtier.runtime import DESCRIPTOR, read_json
from kvtier.shm.segment import SHM_DIR, ShmSegment
from kvtier.shm.slots import Flags, Kind, SlotTable
from kvtier.tools.daemon_process import READY_TIMEOUT_S
from kvtier.tools.demo import expected_block
from tests.support.waiting import wait_until
from tests.support.workload import demo_totals, start_demo_workers, stop_demo_workers

pytestmark = pytest.mark.integration
KILLS = int(os.environ.get("KVTIER_CRASH_KILLS", "20"))
POINTS = ("shm_written", "shm_torn", "after_xadd", "redis_write")
CLIENTS = 2


def _check_arenas(node: str, runtime_dir) -> dict:
    """Scan the gpu and cpu slot headers: nothing torn, every valid block exact."""
    pool = read_json(runtime_dir / DESCRIPTOR)["pools"]["t"]
    fp, bb = bytes.fromhex(pool["fingerprint"]), pool["block_bytes"]
    seen = {"valid": 0}
    for part in ("gpu", "cpu"):
        seg = ShmSegment.attach(f"kvtier.{node}.t.{part}", trusted_uid=os.geteuid())
        try:
            table = SlotTable.open(seg, Kind.ARENA, fp, bb)
            for slot in range(table.n):
                h = table.header(slot)
                # The daemon is live and may be writing this very slot: a torn header now is
                # a write in progress, so re-read until the generation is even.
                deadline = time.monotonic() + 2
                while h.gen % 2 and time.monotonic() < deadline:
                    h = table.header(slot)
                assert h.gen % 2 == 0, f"{part} slot {slot} stays torn (gen {h.gen}) after the restart"
                if h.flags == Flags.VALID:
                    got = table.payload(slot).copy()
                    again = table.header(slot)
                    if again.gen != h.gen:
                        continue  # rewritten while we copied
                    assert got.tobytes() == expected_block(h.key, bb).tobytes(), \
                        f"{part} slot {slot} holds wrong bytes for {h.key.hex()[:16]}"
                    seen["valid"] += 1
            table._payloads = None
        finally:
            seg.close()
    return seen


def _log_count(d, event: str) -> int:
    return sum(1 for x in d.log_events() if x.get("event") == event)


def _last(d, event: str) -> dict:
    return [x for x in d.log_events() if x.get("event") == event][-1]


def _added(bus, stream: str) -> int:
    """Entries ever added to `stream` (Redis >= 7.0), trimmed ones included."""
    return int(bus.xinfo_stream(stream)["entries-added"])


def _segments(node: str) -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"kvtier.{node}.")}


def _check_disk(d) -> int:
    """Every block the disk tier's file calls valid, read and verified as a client reads it,
    holds exactly its bytes. How many there were."""
    pool = read_json(d.runtime_dir / DESCRIPTOR)["pools"]["t"]
    seg = pool["disk"]
    slots = DiskSlots(Path(seg["dir"]) / seg["segment"], bytes.fromhex(pool["fingerprint"]), pool["block_bytes"],
                      os.geteuid())
    seen = 0
    try:
        buf = np.empty(pool["block_bytes"], dtype=np.uint8)
        for slot in range(slots.n):
            h = slots._header(slot)
            if h.flags == Flags.VALID and slots.read_into(slot, h.key, buf) is not None:
                assert buf.tobytes() == expected_block(h.key, pool["block_bytes"]).tobytes(), \
                    f"disk slot {slot} holds wrong bytes for {h.key.hex()[:16]}"
                seen += 1
    finally:
        slots.close()
    return seen


def _check_segments(node: str, workers: list[subprocess.Popen]) -> None:
    names = _segments(node)
    own = {n for n in names if ".stage." not in n}
    assert own == {f"kvtier.{node}.t.{p}" for p in ("dir", "gpu", "cpu")}, f"leaked or missing: {sorted(own)}"
    live = {str(w.pid) for w in workers if w.poll() is None}
    staging_pids = {n.split(".stage.")[1].split(".")[0] for n in names - own}
    assert staging_pids <= live, f"staging segments of dead clients: {staging_pids - live}"


@pytest.mark.timeout(120 + 8 * KILLS)
@pytest.mark.slow
@pytest.mark.parametrize("with_disk", [False, True], ids=["memory", "disk"])
def test_sigkill_at_random_moments_and_named_points(daemon_factory, redis_server, tmp_path, with_disk):
    """With a disk tier too (half the kills): cpu sheds into it, and every restart adopts its
    block file again, which must hold no wrong byte either."""
    kills = KILLS if not with_disk else max(5, KILLS // 2)
    disk = {"disk_dir": tmp_path / "disk", "disk_bytes": 2 << 20} if with_disk else {}
    d = daemon_factory(gpu=8, cpu=24, persist_arena=True,
                       extra='[policy]\ndisk_admit_after = 0\n' if with_disk else "", **disk)
    workers = start_demo_workers(d.runtime_dir, tmp_path, CLIENTS, prefixes=12)
    bus = redis_server.client()
    client_stream = f"kvtier:{{{d.node}}}:client"
    rng = random.Random(kills)
    named = 0
    disk_blocks = 0  # the most valid blocks the disk tier's file held after a restart
    slowest_start = 0.0
    try:
        # Every client connected and putting (its staging segment exists) before the first kill.
        wait_until(lambda: {n.split(".stage.")[1].split(".")[0] for n in _segments(d.node) if ".stage." in n}
                   >= {str(w.pid) for w in workers}, timeout=60, message="every client is putting")
        wait_until(lambda: d.pool_stats().get("puts", 0) > 20, timeout=30, message="the workload started")
        for i in range(kills):
            if i % 5 == 4:  # one kill in five: the daemon dies at a named point in a write
                point = POINTS[(i // 5) % len(POINTS)]
                d.kill()
                d.env["KVTIER__DAEMON__FAILPOINT"] = f"{point}:{rng.randint(1, 5)}"
                d.start(wait_ready=False)  # it may well reach the point before READY
                wait_until(lambda: not d.alive, timeout=30, message=f"the daemon reached failpoint {point}")
                assert d.proc.returncode == -signal.SIGKILL, d.log_tail()
                d.kill()  # collect the notify socket
                del d.env["KVTIER__DAEMON__FAILPOINT"]
                named += 1
            else:
                # The kill lands wherever the workload happens to be, a few client events from now
                # (the stream's count of entries ever added, unlike the daemon's counters, runs on
                # across restarts; its length does not, as the daemon trims what was read).
                target = _added(bus, client_stream) + rng.randint(1, 12)
                wait_until(lambda target=target: _added(bus, client_stream) >= target, timeout=30, interval=0.01,
                           message="the workload moved on")
                d.kill()
            assert all(w.poll() is None for w in workers), "a client died with the daemon"
            before = _log_count(d, "arena.reattached")
            t0 = time.monotonic()
            d.start()  # waits for READY=1, at most READY_TIMEOUT_S
            slowest_start = max(slowest_start, time.monotonic() - t0)
            assert _log_count(d, "arena.reattached") == before + 1, "the restart did not re-attach the cpu arena"
            if i % 5 == 4 and point == "shm_torn":
                last = _last(d, "arena.reattached")
                assert last["discarded"] >= 1 and last["torn"] >= 1, f"the torn slot was not discarded: {last}"
            _check_arenas(d.node, d.runtime_dir)
            _check_segments(d.node, workers)
            if with_disk:
                disk_blocks = max(disk_blocks, _check_disk(d))
        wait_until(lambda: d.pool_stats().get("puts", 0) > 0, timeout=30, message="work resumed after the last restart")
    finally:
        stop_demo_workers(workers)
        bus.close()
    total = demo_totals(tmp_path, CLIENTS)
    assert total["wrong_blocks"] == 0, total
    assert total["requests"] > kills and total["local_hits"] > 0, total
    assert not with_disk or disk_blocks > 0, "the disk tier never held a block: the kills did not exercise it"

    # Entries left pending by the kills are reclaimed (own history, then XAUTOCLAIM) and acked.
    r = redis_server.client()
    streams = [f"kvtier:{{{d.node}}}:{s}" for s in ("client", "facts", "tier:gpu", "tier:cpu", "tier:redis")
               + (("tier:disk",) if with_disk else ())]
    wait_until(lambda: all(g["pending"] == 0 and g["lag"] == 0 for s in streams for g in r.xinfo_groups(s)),
               timeout=30, message="every pending entry reclaimed and acked")
    dead = r.xlen(f"kvtier:{{{d.node}}}:dlq") if r.exists(f"kvtier:{{{d.node}}}:dlq") else 0
    r.close()
    seen = _check_arenas(d.node, d.runtime_dir)
    discarded = sum(x.get("discarded", 0) for x in d.log_events() if x.get("event") == "arena.reattached")
    d.stop()
    leftover = _segments(d.node)
    assert leftover == {f"kvtier.{d.node}.t.cpu"}, f"after a clean stop only the kept arena remains: {leftover}"
    ShmSegment.unlink_name(f"kvtier.{d.node}.t.cpu")
    print(f"\ncrash/restart ({'with' if with_disk else 'no'} disk tier, at most {disk_blocks} blocks on it): "
          f"{kills} kills ({named} at named points), slowest restart to READY "
          f"{slowest_start:.1f}s (limit {READY_TIMEOUT_S:.0f}s), {discarded} torn or corrupt slots discarded, "
          f"{seen['valid']} valid blocks verified at the end, {dead} dead letters, {total['requests']} requests, "
          f"{total['blocks']} blocks wanted, wrong blocks {total['wrong_blocks']}")
