"""`kvtier bench --disk`: the disk tier's block file against fio on the same directory, same run.

Rows (issue 30):
- write: blocks from page-aligned memory (as the cpu arena's slots are) into the block file,
  each with its header and checksum, against fio's best sequential write;
- verified read: random blocks read back and verified (header before and after, xxh3 of the
  bytes landed), against fio's best random read; the daemon's read (into aligned memory), and a
  client's (kvtier/disk/reader.py, into an unaligned caller buffer: the way a get reads a
  disk-resident block);
- adoption: slot headers scanned per second in a file of 1M blocks, and the part of opening a
  file that comes before READY, at 1k and at 1M blocks (it must not grow with the size).

The bound is the best fio shape found: io_uring at several depths and psync with several jobs,
O_DIRECT where the filesystem takes it. kvtier's rows try its thread counts the same way and
report the best, with the count. When the directory is a tmpfs the device is the page cache, and
the rows say so.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier.disk.blockfile import DiskBlockFile, aligned_empty
from kvtier.disk.reader import DiskSlots
from kvtier.shm.slots import SLOT_MAGIC, Flags, checksum

FP = b"bench-disk".ljust(32, b"\0")
THREADS = (1, 2, 4, 8)


def fstype(directory: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and str(directory.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


def _fio(directory: Path, rw: str, bs: int, size: int, direct: bool, engine: str, depth: int, jobs: int) -> float:
    cmd = ["fio", "--name=bound", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", f"--size={size // jobs}",
           f"--ioengine={engine}", f"--iodepth={depth}", f"--numjobs={jobs}", f"--direct={int(direct)}",
           "--group_reporting", "--output-format=json", "--end_fsync=0", "--invalidate=1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(f"fio failed: {r.stderr.strip()[:300]}")
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    return float(job["write" if "write" in rw else "read"]["bw_bytes"]) / 1e9


def fio_best(directory: Path, rw: str, bs: int, size: int, direct: bool) -> tuple[float, str]:
    """fio's best GB/s over io_uring depths and psync job counts, and the shape that gave it.
    The files are laid out first (fio's own write pass), so that writes overwrite allocated
    blocks, as the block file's do (it is preallocated), and reads hit real blocks."""
    shapes = [("io_uring", d, 1) for d in (1, 4, 16, 32)] + [("io_uring", 16, 2)] + [("psync", 1, j) for j in (2, 4, 8)]
    best, shape = 0.0, ""
    for engine, depth, jobs in shapes:
        d = directory / f"fio-{engine}-{depth}-{jobs}"
        d.mkdir(exist_ok=True)
        try:
            _fio(d, "write", bs, size, direct, "psync", 1, jobs)  # the layout pass, not measured
            gbps = _fio(d, rw, bs, size, direct, engine, depth, jobs)
        except RuntimeError:
            continue  # an engine this kernel or build lacks
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if gbps > best:
            best, shape = gbps, f"{engine} {depth} deep x {jobs}"
    return best, shape


def _blocks(n: int, bb: int) -> np.ndarray:
    src = aligned_empty(n * bb).reshape(n, bb)
    rng = np.random.default_rng(3)
    src[:] = rng.integers(0, 256, (1, bb), dtype=np.uint8)
    src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)  # each block distinct
    return src


def _read_one(f: DiskBlockFile, keys: list[bytes], sums: list[int], local: threading.local, i: int) -> bool:
    if not hasattr(local, "dst"):  # one landing buffer per thread
        local.dst = aligned_empty(f.block_bytes)
    return f.read_into(i, keys[i], local.dst) == sums[i]


def _client_read(slots: DiskSlots, keys: list[bytes], sums: list[int], local: threading.local, i: int) -> bool:
    if not hasattr(local, "dst"):  # a caller's buffer: not page-aligned, as a torch host tensor's is not
        local.dst = np.empty(slots.block_bytes + 64, dtype=np.uint8)[64:]
    return slots.read_into(i, keys[i], local.dst) == sums[i]


def client_rows(path: Path, bb: int, keys: list[bytes], sums: list[int]) -> dict:
    """The read a client makes of a disk-resident block (kvtier/disk/reader.py), from the file
    the daemon wrote: best over thread counts, from the device (the page cache dropped)."""
    slots = DiskSlots(path, FP, bb, os.geteuid())
    best = (0.0, 0)
    try:
        order = np.random.default_rng(7).permutation(len(keys)).tolist()
        for threads in THREADS:
            slots.drop_cache()
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                ok = list(pool.map(functools.partial(_client_read, slots, keys, sums, threading.local()), order))
                gbps = len(keys) * bb / (time.perf_counter() - t0) / 1e9
            if not all(ok):
                raise RuntimeError("a client's verified disk read did not return its block")
            best = max(best, (gbps, threads))
    finally:
        slots.close()
    return {"client_read_gbps": best[0], "client_read_threads": best[1]}


def kvtier_rows(directory: Path, bb: int, size: int) -> dict:
    n = max(8, size // bb)
    path = directory / "bench.blocks"
    src = _blocks(n, bb)
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    sums = [checksum(src[i]) for i in range(n)]
    f, _ = DiskBlockFile.open_or_create(path, n, bb, FP)
    out: dict = {"direct": f.direct, "blocks": n, "block_bytes": bb}
    try:
        best_w = best_r = (0.0, 0)
        order = np.random.default_rng(5).permutation(n).tolist()
        for threads in THREADS:
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda i: f.write(i, keys[i], src[i], csum=sums[i]), range(n)))
                w = n * bb / (time.perf_counter() - t0) / 1e9
                f.drop_cache()  # reads come from the device
                t0 = time.perf_counter()
                ok = list(pool.map(functools.partial(_read_one, f, keys, sums, threading.local()), order))
                r = n * bb / (time.perf_counter() - t0) / 1e9
            if not all(ok):
                raise RuntimeError("a verified disk read did not return its block")
            best_w, best_r = max(best_w, (w, threads)), max(best_r, (r, threads))
        out.update(write_gbps=best_w[0], write_threads=best_w[1], read_gbps=best_r[0], read_threads=best_r[1])
        out.update(client_rows(path, bb, keys, sums))
    finally:
        f.close()
        path.unlink()
    return out


def adoption_rows(directory: Path, big: int = 1_000_000) -> dict:
    """Headers scanned per second at `big` blocks (4 KiB blocks: the scan reads headers only),
    and the open before READY at 1k and at `big` blocks."""
    out: dict = {"big": big}
    for n in (1_000, big):
        path = directory / f"adopt-{n}.blocks"
        f, _ = DiskBlockFile.open_or_create(path, n, 4096, FP)
        h = f.headers(0, n)
        h["magic"], h["flags"], h["gen"], h["length"] = SLOT_MAGIC, Flags.VALID, 2, 4096
        h["key"] = np.arange(1, n + 1, dtype=np.uint64).repeat(4).view("V32")
        del h
        f.sync()
        f.drop_cache()
        f.close()
        t0 = time.perf_counter()
        f, adopted = DiskBlockFile.open_or_create(path, n, 4096, FP)
        t_open = time.perf_counter() - t0
        assert adopted
        t0 = time.perf_counter()
        found = sum(len(f.adopt(lo, min(n, lo + 65536)).keys) for lo in range(0, n, 65536))
        t_scan = time.perf_counter() - t0
        f.close()
        path.unlink()
        if found != n:
            raise RuntimeError(f"adoption found {found} of {n} blocks")
        out[str(n)] = {"open_ms": t_open * 1000, "scan_s": t_scan, "headers_per_s": n / t_scan}
    return out


def disk_bench(directory: Path, bb: int, size: int, say=print, big: int = 1_000_000) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    kind = fstype(directory)
    probe, _ = DiskBlockFile.open_or_create(directory / "probe.blocks", 1, 4096, FP)
    direct = probe.direct
    probe.close()
    (directory / "probe.blocks").unlink()
    say(f"bench --disk: {directory} ({kind}, {'O_DIRECT' if direct else 'page cache'}), fio bounds")
    out: dict = {"dir": str(directory), "fstype": kind, "direct": direct}
    out["fio_write_gbps"], out["fio_write_shape"] = fio_best(directory, "write", bb, size, direct)
    out["fio_read_gbps"], out["fio_read_shape"] = fio_best(directory, "randread", bb, size, direct)
    say("bench --disk: kvtier block file")
    out.update(kvtier_rows(directory, bb, size))
    say(f"bench --disk: adoption at 1k and {big:,} blocks")
    out["adoption"] = adoption_rows(directory, big)
    return out


def disk_table(d: dict) -> list[tuple]:
    """(path, figure, bound, ratio, target, meets) rows for bench_report."""
    dev = "" if d["fstype"] != "tmpfs" else " (tmpfs: the device is the page cache)"
    rows = []
    for op, ours, threads, bound, shape in (("write, aligned memory -> block file", "write_gbps", "write_threads",
                                             "fio_write_gbps", "fio_write_shape"),
                                            ("verified random read", "read_gbps", "read_threads", "fio_read_gbps",
                                             "fio_read_shape"),
                                            ("client's verified random read", "client_read_gbps",
                                             "client_read_threads", "fio_read_gbps", "fio_read_shape")):
        ratio = d[ours] / d[bound] if d[bound] else 0.0
        rows.append((f"disk {op}, {d['block_bytes'] >> 10} KiB blocks, {d[threads]} threads{dev}",
                     f"{d[ours]:.2f} GB/s", f"fio {d[bound]:.2f} GB/s ({d[shape]})", ratio, ">= 0.8x", ratio >= 0.8))
    a = d["adoption"]
    n = a["big"]
    big, small = a[str(n)], a["1000"]
    rows.append((f"disk adoption: headers scanned at {n:,} blocks", f"{big['headers_per_s'] / 1e6:.1f} M/s", "", None,
                 "(measured)", None))
    rows.append((f"disk adoption: open before READY, {n:,} vs 1,000 blocks", f"{big['open_ms']:.1f} ms",
                 f"1k blocks {small['open_ms']:.1f} ms", big["open_ms"] / max(small["open_ms"], 1e-3),
                 "(does not grow with size)", None))
    return rows


def run_disk_bench(args) -> int:
    import tempfile

    from kvtier.tools.bench_report import finish, render

    if shutil.which("fio") is None:
        print("kvtier bench --disk needs fio (Debian: apt-get install fio)", file=sys.stderr)
        return 2
    bb = args.disk_block_kib << 10
    size = int(args.disk_gib * (1 << 30)) if not args.quick else 32 << 20
    with tempfile.TemporaryDirectory(prefix="kvtier-disk-", dir=args.disk_dir or "/var/tmp") as d:
        out = {"disk": disk_bench(Path(d), bb, size, say=lambda m: print(m, file=sys.stderr, flush=True),
                                  big=100_000 if args.quick else 1_000_000)}
    rows = [dict(zip(("path", "figure", "bound", "ratio", "target", "meets"), r)) for r in disk_table(out["disk"])]
    out["rows"] = rows
    return finish(out, render(rows), args.json, True)
