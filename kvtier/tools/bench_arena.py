"""`kvtier bench` arena rows: start-to-READY and time-to-fully-populated per GiB of a cpu arena,
cold and warm, against the raw population of the same bytes in the same directory; with
`--arena-huge-dir` the same on 2 MiB pages, and get/put with and without them; and the warm
restart's header scan over a million slots.

The raw bound is the best of a grid of thread counts and chunk sizes of posix_fallocate +
MADV_POPULATE_WRITE (kvtier/shm/populate.py, what the daemon itself calls) over the same bytes.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tools.bench_env import daemon_toml
from kvtier.tools.daemon_process import DaemonProcess

GIB = 1 << 30
LLAMA_POOL = """
[pools.a]
model = "llama3-8b"
layers = 32
kv_heads = 8
head_dim = 128
block_tokens = 16
dtype = "bfloat16"
device = "cpu"
gpu_blocks = 0
cpu_bytes = {cpu_bytes}
"""


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def arena_toml(huge_dir: str | None) -> str:
    if not huge_dir:
        return '[arena]\nhuge_pages = "off"\n'
    return f'[arena]\nhuge_pages = "on"\nhuge_pages_dir = "{huge_dir}"\n'


def raw_populate(directory: Path, nbytes: int, threads: int, chunk: int, page: int) -> float:
    """Seconds to allocate and fault in `nbytes` of a new file in `directory`."""
    from kvtier.shm.populate import PageFiller

    path = directory / f"kvtier.bench-raw.{uuid.uuid4().hex[:8]}"
    nbytes = -(-nbytes // page) * page
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = np.frombuffer(m, dtype=np.uint8, count=1)
        f = PageFiller(fd, view.ctypes.data, nbytes, page)
        del view
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda off: f.fill(off, min(nbytes, off + chunk)), range(0, nbytes, chunk)))
        secs = time.perf_counter() - t0
        m.close()
        return secs
    finally:
        os.close(fd)
        path.unlink()


def raw_bound(directory: Path, nbytes: int, page: int, settle_s: float) -> dict[str, Any]:
    """The best s/GiB over threads x chunk sizes, each after `settle_s` idle seconds (see SETTLE_S)."""
    cores = os.cpu_count() or 1
    grid = []
    for threads in sorted({1, 2, cores}):
        for chunk in (64 << 20, 256 << 20):
            time.sleep(settle_s)
            grid.append({"s_per_gib": raw_populate(directory, nbytes, threads, chunk, page) / (nbytes / GIB),
                         "threads": threads, "chunk_mib": chunk >> 20})
    best = min(grid, key=lambda g: g["s_per_gib"])
    return {**best, "grid": grid}


# On a VM whose balloon reports free pages to the host (virtio_balloon here), memory freed a
# few seconds ago costs 2-3x more to populate again than memory freed just now: the host backs
# it anew. Every population measured here (the daemon's and each raw one) starts after this long
# idle, so that all of them pay the same.
SETTLE_S = 5.0


def _arena(d: DaemonProcess) -> dict[str, Any]:
    try:
        s = d.stats()
    except (OSError, ValueError):
        return {}
    a = (s.get("pools", {}).get("a") or {}).get("arena") or {}
    return {**a, "ready_s": s.get("ready_s")} if s.get("pid") == d.proc.pid else {}


def _wait(d: DaemonProcess, cond, what: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        a = _arena(d)
        if a and cond(a):
            return a
        if time.monotonic() > deadline or not d.alive:
            raise RuntimeError(f"arena bench: {what} did not happen ({d.log_tail(2000)})")
        time.sleep(0.05)


def start_and_populate(d: DaemonProcess, gib: float, settle_s: float) -> dict[str, Any]:
    time.sleep(settle_s)
    t0 = time.perf_counter()
    d.start(timeout=60)
    ready_wall = time.perf_counter() - t0
    a = _wait(d, lambda a: a.get("state") != "populating", "full population", 60 + 30 * gib)
    if a["state"] != "populated":
        raise RuntimeError(f"arena bench: population failed: {a.get('error')}")
    return {"ready_wall_s": ready_wall, "ready_s": a["ready_s"], "populate_s": a["populate_s"],
            "s_per_gib": a["populate_s"] / gib, "backing": a["backing"], "page_bytes": a["page_bytes"]}


def arena_rows(url: str, workdir: Path, gib: float, huge_dir: str | None, out: dict, settle_s: float = SETTLE_S
               ) -> None:
    """Cold start, then a warm re-attach, of a `gib` GiB arena (Llama-3-8B blocks)."""
    key = "arena_huge" if huge_dir else "arena"
    node = f"bench-arena-{uuid.uuid4().hex[:6]}"
    rdir = workdir / f"rt-{node}"
    cfg = workdir / f"{node}.toml"
    cfg.write_text(daemon_toml(node, rdir, url, persist_arena=True, level="info", stats_interval_s=0.05,
                               extra=arena_toml(huge_dir))
                   + LLAMA_POOL.format(cpu_bytes=int(gib * GIB)))
    d = DaemonProcess(cfg, rdir, log_path=workdir / f"{node}.log", tied=True)
    directory = Path(huge_dir) if huge_dir else Path("/dev/shm")
    page = 2 << 20 if huge_dir else 4096
    # At the arena's own size: on this VM the first GiB or so of a population is much cheaper
    # than the rest (memory the host still backs), so a smaller probe flatters the bound.
    raw_bytes = int(gib * GIB)
    _say(f"arena: raw population bound over {gib:g} GiB (threads x chunk grid, {settle_s:g} s idle before each)")
    before = raw_bound(directory, raw_bytes, page, settle_s)
    try:
        _say(f"arena: cold start of {gib:g} GiB on {directory}")
        cold = start_and_populate(d, gib, settle_s)
        d.stop(60)
        _say("arena: warm re-attach")
        warm = start_and_populate(d, gib, 0.0)
        d.stop(60)
    finally:
        d.stop_or_kill(30)
        for seg in {directory, Path("/dev/shm")}:
            (seg / f"kvtier.{node}.a.cpu").unlink(missing_ok=True)
    bound = before
    from kvtier.config import ArenaConfig
    from kvtier.daemon.population import populate_widths

    threads = populate_widths(ArenaConfig())[1]  # nothing else runs on the bench's daemon: it populates idle-wide
    same = [g["s_per_gib"] for g in bound["grid"] if g["threads"] == threads and g["chunk_mib"] == 64]
    bound["daemon_shape_s_per_gib"] = min(same) if same else None
    out[key] = {"gib": gib, "cold": cold, "warm": warm, "raw": bound, "settle_s": settle_s}


def header_scan_row(slots: int, out: dict) -> None:
    """A warm restart's scan of `slots` valid slot headers (4 KiB blocks), verified and restored,
    in-process through the code the daemon runs (open_pool, ArenaFill.prepare and apply)."""
    import structlog

    from kvtier.config import PolicyConfig, PoolConfig, RedisConfig
    from kvtier.daemon.pools import close_pool, open_pool
    from kvtier.shm.slots import SLOT_MAGIC, Flags, checksum, key_tag

    devnull = open(os.devnull, "w")  # noqa: SIM115 (closed below; the pool's log lines are not the figure)
    log = structlog.wrap_logger(structlog.PrintLogger(devnull))
    cfg = PoolConfig(name="s", model="scan", layers=1, kv_heads=1, head_dim=64, block_tokens=16, dtype="float16",
                     device="cpu", gpu_blocks=0, cpu_blocks=slots)
    node = f"bench-scan-{uuid.uuid4().hex[:6]}"
    rt = open_pool(cfg, node, PolicyConfig(), None, RedisConfig(), None, log)
    try:
        fill = rt.arena
        assert fill is not None
        while fill.chunks:  # populate it all, as the daemon would in the background
            fill.apply_all(fill.prepare(fill.chunks.pop(0)), rt.placement)
        t = rt.cpu.table
        h = t.headers(0, t.n)
        keys = np.zeros((t.n, 32), dtype=np.uint8)
        keys[:, :8] = np.arange(1, t.n + 1, dtype="<u8").view(np.uint8).reshape(t.n, 8)
        h["magic"], h["flags"], h["gen"], h["length"] = SLOT_MAGIC, Flags.VALID, 2, t.block_bytes
        h["key"] = keys.view("V32").reshape(t.n)
        csum = checksum(t.payload(0))  # every payload is zeros: one checksum fits all
        h["checksum"] = csum
        kb = keys.tobytes()  # and each header's tag binds its key to it, as end_write does
        h["tag"] = np.fromiter((key_tag(kb[32 * i:32 * i + 32], csum) for i in range(t.n)), dtype="<u8", count=t.n)
        del h
    finally:
        close_pool(rt, persist_arena=True)
    t0 = time.perf_counter()
    rt = open_pool(cfg, node, PolicyConfig(), None, RedisConfig(), None, log)
    ready = time.perf_counter() - t0
    try:
        fill = rt.arena
        assert fill is not None
        prep = apply = 0.0
        while fill.chunks:
            t1 = time.perf_counter()
            p = fill.prepare(fill.chunks.pop(0))
            t2 = time.perf_counter()
            fill.apply_all(p, rt.placement)
            prep, apply = prep + t2 - t1, apply + time.perf_counter() - t2
        ok = fill.kept == slots and fill.discarded == 0
        out["header_scan"] = {"slots": slots, "open_s": ready, "scan_verify_s": prep, "restore_s": apply,
                              "us_per_slot": (ready + prep + apply) / slots * 1e6, "kept": fill.kept, "correct": ok}
    finally:
        close_pool(rt, persist_arena=False)
        devnull.close()


def rows(out: dict) -> list[tuple]:
    """(path, figure, bound, ratio, target, meets) for the bench table."""
    res = []
    for key, label in (("arena", "4 KiB pages"), ("arena_huge", "2 MiB pages")):
        if key not in out:
            continue
        x = out[key]
        c, w, raw = x["cold"], x["warm"], x["raw"]
        res.append((f"arena start, cold: {x['gib']:g} GiB, {label}", f"READY {c['ready_s']:.2f} s "
                    f"(process start to READY {c['ready_wall_s']:.2f} s)", "", None, "<= 1 s", c["ready_s"] <= 1.0))
        ratio = c["s_per_gib"] / raw["s_per_gib"]
        same = raw.get("daemon_shape_s_per_gib")
        shape = "" if same is None else f"; at the daemon's own threads and chunk {same:.2f} s/GiB"
        res.append((f"arena populated, cold: {label}", f"{c['s_per_gib']:.2f} s/GiB ({c['populate_s']:.1f} s)",
                    f"best raw fallocate+populate {raw['s_per_gib']:.2f} s/GiB ({raw['threads']} threads x "
                    f"{raw['chunk_mib']} MiB){shape}", ratio, "<= 1.25x", ratio <= 1.25))
        res.append((f"arena warm re-attach: {label}", f"READY {w['ready_s']:.2f} s, in service after "
                    f"{w['populate_s']:.2f} s ({w['s_per_gib']:.2f} s/GiB)", "", None, "<= 1 s to READY",
                    w["ready_s"] <= 1.0))
    if "header_scan" in out:
        x = out["header_scan"]
        res.append((f"warm restart: {x['slots']:,} slot headers scanned, verified, restored",
                    f"{x['open_s'] + x['scan_verify_s'] + x['restore_s']:.2f} s ({x['us_per_slot']:.2f} us/slot; "
                    f"open {x['open_s']:.2f} s, scan+verify {x['scan_verify_s']:.2f} s in threads, restore "
                    f"{x['restore_s']:.2f} s on the loop)", "", None, "(measured)", None))
    return res
