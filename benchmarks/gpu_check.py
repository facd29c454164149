"""Check kvtier's CUDA paths on a machine with a GPU; skip cleanly (exit 0) without one.

    .venv/bin/python benchmarks/gpu_check.py [--blocks N]

1. cudaHostRegister of a cpu arena (a real kvtier shared-memory segment) in bounded chunks,
   every return code checked, and unregistered again.
2. H2D and D2H copies of 2 MiB blocks from and to the registered arena, against a plain pinned
   buffer copy of the same bytes (GB/s, ratio), and checked byte for byte against the CPU copy.
3. A device pool exported with kvtier's CUDA IPC descriptor (kvtier/shm/cuda_ipc.py) and read by a
   second process, which checks every block's checksum.
4. The gpu tier itself: a LocalTier on a device payload writes and reads back blocks verified on
   the device (kvtier/shm/device_sum.py, the same sums as on CPU), and that verification timed
   against a device copy of the same bytes.
5. The whole data path on a real GPU pool: a daemon whose gpu tier is on CUDA (on a private
   redis-server, as `kvtier bench` starts one) and this process as its client. Blocks are put from
   a CUDA tensor, shed from the gpu tier to the cpu arena by the daemon (D2H), and read back into
   a CUDA tensor through the IPC mapping; every byte is compared, and the get is timed against a
   device-to-device copy of the same bytes. A byte changed through the IPC mapping must be a miss.
   Skipped, and said so, without redis-server on PATH.
6. The vLLM connector's copies, without vLLM: paged KV caches as vLLM lays out Llama-3-8B on a GPU
   (32 layers of [blocks, 2, 8, 32, 128] bfloat16) on CUDA; gather and scatter between them and
   kvtier blocks, byte for byte against the same copies on CPU tensors; then the worker's own save
   and load (WorkerMover) against a real daemon, from and into the CUDA caches, every byte
   compared. `--connector-device cpu` runs this step alone on CPU (a check of the check).

Prints one line per check and "ALL CHECKS PASSED" at the end; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.core.events import Tier  # noqa: E402
from kvtier.core.index import TierIndex  # noqa: E402
from kvtier.layout import BlockLayout  # noqa: E402
from kvtier.shm import cuda_ipc as gpu_mem  # noqa: E402
from kvtier.shm.device_sum import device_sums  # noqa: E402
from kvtier.shm.directory import NO_SLOT, DirectoryWriter, directory_bytes, directory_capacity  # noqa: E402
from kvtier.shm.segment import ShmSegment  # noqa: E402
from kvtier.shm.slots import Kind, SlotTable, checksum, segment_bytes  # noqa: E402
from kvtier.tiers.local import LocalTier  # noqa: E402

LAYOUT = BlockLayout("llama3-8b", 32, 8, 128, 16, "bfloat16")  # 2 MiB blocks
CHUNK = 64 << 20  # cudaHostRegister at most this much at a time
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def child_reads(desc_path: str) -> int:
    """The second process: open the pool by IPC and verify every block's checksum."""
    desc = json.loads(Path(desc_path).read_text())
    pool = gpu_mem.import_ipc(desc["ipc"])
    host = pool.cpu().numpy()
    bad = [i for i, c in enumerate(desc["checksums"]) if checksum(host[i]) != c]
    print(json.dumps({"blocks": len(desc["checksums"]), "bad": bad}))
    return 1 if bad else 0


async def client_round(env, dev: torch.device, n_gpu: int, n: int) -> None:
    from kvtier.client import Client

    async with await Client.connect(env.rdir, staging_blocks=n) as client:
        p = client.pool("b")
        bb = p.block_bytes
        raw = torch.randint(0, 256, (n, bb), dtype=torch.uint8, device=dev)
        kv = raw.view(p.dtype).reshape(n, *p.shape)
        keys = client.block_keys("b", list(range(n * p.layout.block_tokens)), salt=b"gpu-check")
        # half the gpu tier (under its watermarks): the blocks must land there and read back exact
        m = n_gpu // 2
        res = await client.put("b", keys[:m], kv[:m])
        check("put from a CUDA tensor staged every block", res.dropped == 0, f"staged {res.staged}")
        check("put blocks become resident", await client.wait_resident("b", keys[:m], timeout=60))
        tiers = client.lookup("b", keys[:m]).tiers
        check("fresh puts land in the CUDA gpu tier", all(t == Tier.GPU for t in tiers),
              f"tiers {sorted({t.name for t in tiers})}")
        out = torch.zeros_like(kv)
        out_raw = out.view(torch.uint8).reshape(n, bb)  # compare bytes: random bf16 holds NaNs
        got = await client.get("b", keys[:m], out)
        check("get from the gpu tier into a CUDA tensor is exact", got == m and torch.equal(out_raw[:m], raw[:m]),
              f"{got}/{m} blocks")

        async def get_all() -> None:
            await client.get("b", keys[:m], out)

        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await get_all()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        t_d2d = timed(lambda: out[:m].copy_(kv[:m]))
        gb = m * bb / 1e9
        print(f"get from the gpu tier into a CUDA tensor {gb / best:.2f} GB/s vs a device copy "
              f"{gb / t_d2d:.0f} GB/s (ratio {t_d2d / best:.4f}; each block is copied on the device "
              f"and the copy verified there, one block at a time)")
        # the rest overflows the gpu tier: the daemon sheds the oldest to the cpu arena (D2H)
        for i in range(m, n, m):
            res = await client.put("b", keys[i:i + m], kv[i:i + m], parent=keys[i - 1])
            check(f"put blocks {i}..{min(n, i + m) - 1} staged", res.dropped == 0)
        check("all blocks resident on the node", await client.wait_resident("b", keys, timeout=60))

        def gpu_settled() -> bool:  # shedding done: the gpu tier is back under its high watermark
            t = env.stats().get("pools", {}).get("b", {}).get("tiers", {}).get("gpu", {})
            return t.get("blocks", n_gpu) <= 0.9 * n_gpu

        env.wait_for(gpu_settled, "gpu tier shedding")
        tiers = client.lookup("b", keys).tiers
        on_gpu, on_cpu = sum(t == Tier.GPU for t in tiers), sum(t == Tier.CPU for t in tiers)
        check("the daemon shed blocks from the CUDA pool to the cpu arena", on_gpu > 0 and on_cpu > 0,
              f"gpu {on_gpu}, cpu {on_cpu}")
        out.zero_()
        got = await client.get("b", keys, out)
        check("every block reads back exact from both tiers", got == n and torch.equal(out_raw, raw),
              f"{got}/{n} blocks")
        # a byte changed behind the seqlock, through the IPC mapping any client holds: a miss there
        # (a block with no cpu copy: with one, the read would rightly fall back to that copy)
        at = max(i for i, t in enumerate(tiers) if t == Tier.GPU and p.directory.find(keys[i])[1] == NO_SLOT)
        where, slot = p.locate(keys[at])
        check("the block to change is still in the gpu tier", where == Tier.GPU, f"block {at} in {where.name}")
        if where == Tier.GPU:
            p.gpu_device_payload[slot, :1].bitwise_xor_(0xFF)
            got = await client.get("b", keys, out)
            check("a gpu block changed through the IPC mapping is a miss, not wrong bytes",
                  got == at and torch.equal(out_raw[:at], raw[:at]), f"read {got}, changed block {at}")
            p.gpu_device_payload[slot, :1].bitwise_xor_(0xFF)
            got = await client.get("b", keys, out)
            check("restored, it reads exact again", got == n and torch.equal(out_raw, raw), f"{got}/{n} blocks")
    stats = env.stats().get("pools", {}).get("b", {}).get("tiers", {})
    failed = {t: v.get("failed", 0) for t, v in stats.items()}
    check("the daemon counted no failed transfer", stats != {} and not any(failed.values()), f"failed {failed}")


def daemon_on_gpu(dev: torch.device, n_gpu: int) -> None:
    """5. A real daemon with its gpu tier on CUDA, and this process as its client."""
    if shutil.which("redis-server") is None:
        print("SKIP  5. daemon with a CUDA gpu tier: no redis-server on PATH (not counted as a pass)")
        return
    from kvtier.tools.bench import LLAMA
    from kvtier.tools.bench_env import Env

    with tempfile.TemporaryDirectory() as tmp:
        env = Env(LLAMA, cpu_blocks=4 * n_gpu, workdir=Path(tmp), device="cuda", gpu_blocks=n_gpu)
        try:
            asyncio.run(client_round(env, dev, n_gpu, 3 * n_gpu))
        finally:
            env.close()
            log = Path(tmp) / "daemon.log"
            errors = [ln for ln in log.read_text().splitlines() if '"level": "error"' in ln] if log.exists() else []
            check("daemon logged no error", not errors, errors[0][:300] if errors else "")


def connector_copies(dev: torch.device, blocks: int = 24) -> None:
    """6. The vLLM connector's paged copies and its worker's save/load on `dev`, checked against CPU."""
    from kvtier.integrations.vllm.connector_copy import gather_blocks, scatter_blocks

    layers, page = 32, (2, 8, 32, 128)
    g = torch.Generator().manual_seed(6)
    cpu_caches = [torch.randint(-30000, 30000, (2 * blocks + 1, *page), generator=g, dtype=torch.int16)
                  .view(torch.bfloat16) for _ in range(layers)]
    dev_caches = [c.to(dev, copy=True) for c in cpu_caches]
    ids = torch.randperm(2 * blocks, generator=g)[:blocks] + 1
    out_cpu = torch.empty((blocks, layers, *page), dtype=torch.bfloat16)
    out_dev = torch.empty_like(out_cpu, device=dev)
    gather_blocks(cpu_caches, ids, out_cpu)
    gather_blocks(dev_caches, ids.to(dev), out_dev)
    same = lambda a, b: torch.equal(a.cpu().contiguous().view(torch.int16), b.cpu().contiguous().view(torch.int16))  # noqa: E731
    check("6. connector gather on the device equals the CPU path", same(out_dev, out_cpu))
    back = torch.arange(blocks) + 1
    scatter_blocks(out_cpu, cpu_caches, back)
    scatter_blocks(out_dev, dev_caches, back.to(dev))
    check("6. connector scatter on the device equals the CPU path",
          all(same(d, c) for d, c in zip(dev_caches, cpu_caches)))
    if shutil.which("redis-server") is None:
        print("SKIP  6. connector save/load against a daemon: no redis-server on PATH (not counted as a pass)")
        return
    from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace
    from kvtier.integrations.vllm.connector_link import DaemonLink
    from kvtier.integrations.vllm.connector_transfers import BlockTransfer
    from kvtier.integrations.vllm.connector_worker import WorkerMover
    from kvtier.tools.bench_env import Env

    layout = dict(model="llama3-8b-vllm", layers=layers, kv_heads=8, head_dim=128, block_tokens=32, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        env = Env(layout, cpu_blocks=4 * blocks, workdir=Path(tmp))
        link = None
        try:
            ns = KeyNamespace("llama3-8b-vllm", "gpu-check", 32, layers, 8, 128, "bfloat16", "check", dev.type)
            settings = ConnectorSettings(pool="b", runtime_dir=str(env.rdir), staging_blocks=blocks, call_timeout_s=60)
            link = DaemonLink(settings.runtime_dir, blocks, settings.retry_s)
            mover = WorkerMover(settings, ns, link, (0, 1), (0, 1), [f"l{i}" for i in range(layers)])
            mover.register({f"l{i}": c for i, c in enumerate(dev_caches)})
            tokens = tuple(range(blocks * 32))
            src = tuple(int(i) for i in ids)
            saved = [c[list(src)].clone() for c in cpu_caches]  # the reference: what the save must carry
            mover.save([BlockTransfer("check", tokens, None, None, 0, src)])
            keys = mover.chain_keys(link.client(), BlockTransfer("check", tokens, None, None, 0, src))
            check("6. connector save from device pages: every block visible in kvtier",
                  link.client().wait_resident("b", keys, timeout=60))
            dst = tuple(range(blocks + 1, 2 * blocks + 1))
            failed = mover.load([BlockTransfer("check", tokens, None, None, 0, dst)])
            ok = not failed and all(same(d[list(dst)], ref) for d, ref in zip(dev_caches, saved))
            check("6. connector load into device pages equals the saved bytes", ok,
                  f"failed block ids {sorted(failed)[:5]}")
        finally:
            if link is not None:
                link.close()
            env.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256, help="arena blocks of 2 MiB (default 256 = 512 MiB)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--connector-device", help="run step 6 alone on this device (e.g. cpu)")
    args = ap.parse_args()
    if args.child:
        return child_reads(args.child)
    if args.connector_device:
        connector_copies(torch.device(args.connector_device))
        print("FAILED: " + ", ".join(failures) if failures else "ALL CHECKS PASSED")
        return 1 if failures else 0
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); nothing to check")
        return 0
    dev = torch.device("cuda", 0)
    bb, n = LAYOUT.block_bytes, args.blocks
    print(f"device {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {n} blocks of {bb >> 20} MiB")
    name = f"kvtier.gpucheck-{uuid.uuid4().hex[:8]}.cpu"
    seg = ShmSegment.create(name, segment_bytes(n, bb))
    try:
        table = SlotTable.format(seg, Kind.ARENA, n, bb, LAYOUT.fingerprint)
        payloads = table.payloads()  # [n, bb] uint8 view of the shared mapping
        rng = np.random.default_rng(0)
        ref = rng.integers(0, 255, (n, bb), dtype=np.uint8)
        for i in range(n):
            table.write(i, i.to_bytes(32, "little"), ref[i])

        # 1. register the arena with CUDA in bounded chunks
        cudart = torch.cuda.cudart()
        base = payloads.ctypes.data
        total = payloads.nbytes
        codes = []
        for off in range(0, total, CHUNK):
            codes.append(int(cudart.cudaHostRegister(base + off, min(CHUNK, total - off), 0)))
        check("cudaHostRegister in chunks", all(c == 0 for c in codes), f"{len(codes)} chunks, codes {set(codes)}")
        host = torch.from_numpy(payloads)
        check("arena seen as pinned by torch", host.is_pinned())

        # 2. H2D / D2H per block against a plain pinned buffer of the same bytes
        dbuf = torch.empty((n, bb), dtype=torch.uint8, device=dev)

        def h2d() -> None:
            for i in range(n):
                dbuf[i].copy_(host[i], non_blocking=True)

        def d2h() -> None:
            for i in range(n):
                host[i].copy_(dbuf[i], non_blocking=True)

        pinned = torch.empty((n, bb), dtype=torch.uint8, pin_memory=True)
        pinned.copy_(host)

        def plain_h2d() -> None:
            dbuf.copy_(pinned, non_blocking=True)

        def plain_d2h() -> None:
            pinned.copy_(dbuf, non_blocking=True)

        t_h2d, t_plain_h2d = timed(h2d), timed(plain_h2d)
        t_d2h, t_plain_d2h = timed(d2h), timed(plain_d2h)
        gb = n * bb / 1e9
        print(f"H2D per block {gb / t_h2d:.1f} GB/s vs one pinned copy {gb / t_plain_h2d:.1f} GB/s "
              f"(ratio {t_plain_h2d / t_h2d:.2f}); D2H {gb / t_d2h:.1f} vs {gb / t_plain_d2h:.1f} GB/s "
              f"(ratio {t_plain_d2h / t_d2h:.2f})")
        check("D2H bytes equal the CPU reference", bool(np.array_equal(payloads, ref)))
        dbuf.zero_()
        h2d()
        torch.cuda.synchronize()
        check("H2D bytes equal the CPU reference", bool(np.array_equal(dbuf.cpu().numpy(), ref)))
        codes = []
        for off in range(0, total, CHUNK):
            codes.append(int(cudart.cudaHostUnregister(base + off)))
        check("cudaHostUnregister", all(c == 0 for c in codes), f"codes {set(codes)}")

        # 3. a second process reads the device pool through kvtier's IPC descriptor
        pool = gpu_mem.allocate_device_pool(n, bb, dev)
        pool.copy_(torch.from_numpy(ref).to(dev))
        torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            desc = Path(tmp) / "ipc.json"
            desc.write_text(json.dumps({"ipc": gpu_mem.export_ipc(pool),
                                        "checksums": [checksum(ref[i]) for i in range(n)]}))
            run = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--child", str(desc)],
                                 capture_output=True, text=True, timeout=300)
            check("second process reads every block through CUDA IPC", run.returncode == 0,
                  f"rc {run.returncode} " + (run.stdout.strip() + " " + run.stderr.strip())[-300:])

        # 4. the gpu tier: a LocalTier on a device payload, writes and verified reads
        hdr_name = f"kvtier.gpucheck-{uuid.uuid4().hex[:8]}.gpu"
        dir_name = f"kvtier.gpucheck-{uuid.uuid4().hex[:8]}.dir"
        hdr = ShmSegment.create(hdr_name, segment_bytes(n, bb, with_payload=False))
        dseg = ShmSegment.create(dir_name, directory_bytes(directory_capacity(n)))
        try:
            gtable = SlotTable.format(hdr, Kind.GPU_HEADERS, n, bb, LAYOUT.fingerprint)
            directory = DirectoryWriter.create(dseg, directory_capacity(n), LAYOUT.fingerprint)
            tier = LocalTier(Tier.GPU, gtable, TierIndex(n), directory,
                             device_payload=gpu_mem.allocate_device_pool(n, bb, dev))
            keys = [(i + 1).to_bytes(32, "little") for i in range(n)]
            for i, k in enumerate(keys):
                e = tier.index.reserve(k, None)
                assert e is not None
                tier.fill(e, ref[i], checksum(ref[i]))
                tier.index.commit(k)
            out = np.empty(bb, dtype=np.uint8)
            ok = all(tier.read(k, out) == checksum(ref[i]) and np.array_equal(out, ref[i]) for i, k in enumerate(keys))
            check("gpu tier write + read verified on the device, every block", ok)
            sums_ok = device_sums(tier.device_payload) == device_sums(torch.from_numpy(ref))
            check("device sums on CUDA equal the same sums on CPU", sums_ok)
            # Verification on the device against a device copy of the same bytes (issue 14: >= 0.5x).
            pool = tier.device_payload
            copy_dst = torch.empty_like(pool)
            t_copy = timed(lambda: copy_dst.copy_(pool))
            t_both = timed(lambda: (copy_dst.copy_(pool), device_sums(copy_dst)))
            print(f"copy + device verification of {n} blocks {n * bb / 1e9 / t_both:.0f} GB/s vs the device copy "
                  f"alone {n * bb / 1e9 / t_copy:.0f} GB/s (ratio {t_copy / t_both:.2f}; target >= 0.5)")
        finally:
            for s in (hdr, dseg):
                s.unlink()
    finally:
        seg.unlink()
    daemon_on_gpu(dev, n_gpu=32)
    connector_copies(dev)
    if failures:
        print(f"FAILED: {', '.join(failures)}")
        return 1
    print("ALL CHECKS PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
