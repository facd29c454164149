"""`kvtier bench --vllm`: the vLLM integrations against kvtier's own calls, in the same run.

Rows (row: figure; bound (same run); target):

- connector save: GB/s, vLLM pages -> staged -> visible in the cpu tier (the worker's wait_for_save path);
  Client.put of the same bytes until visible; >= 0.7x
- connector load: GB/s, resident blocks -> vLLM pages, verified (the worker's start_load_kv path);
  Client.get of the same bytes; >= 0.7x
- tier store / load: see kvtier/tools/bench_vllm_tier.py; Client.put / Client.get; >= 0.7x
- TTFT on real engines (kvtier/tools/bench_ttft.py): cold, vLLM's own prefix cache (the floor),
  kvtier from this node, on the saving engine's next request, from Redis on another node, a
  miss, and LMCache MP with `--peer`; targets from issue 29 (worst <= 1.1x the floor, ...)

The connector rows run the worker's own code (`WorkerMover`) over paged caches shaped as vLLM
lays out Llama-3-8B on a GPU (32 layers of [blocks, 2, 8, 32, 128] bfloat16: 4 MiB per 32-token
block), without an engine. The TTFT rows start real vLLM engines. `--quick` shrinks everything
(the TTFT cells run on the tiny model, one length, two samples) and only checks that every path
moves the right bytes and every TTFT cell runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvtier.tools.bench_basics import GB
from kvtier.tools.bench_env import Env
from kvtier.tools.bench_report import render

PAGED = dict(model="llama3-8b-vllm", layers=32, kv_heads=8, head_dim=128, block_tokens=32, dtype="bfloat16")
TINY_PAGED = dict(model="tiny-vllm", layers=2, kv_heads=2, head_dim=32, block_tokens=32, dtype="float16")


def _say(msg: str) -> None:
    print(f"kvtier bench --vllm: {msg}", file=sys.stderr, flush=True)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def connector_rows(env: Env, layout: dict, n: int, rounds: int, out: dict) -> None:
    from kvtier.client.pools import TORCH_DTYPES
    from kvtier.client.sync import SyncClient
    from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace
    from kvtier.integrations.vllm.connector_copy import block_view, gather_blocks
    from kvtier.integrations.vllm.connector_link import connector_link
    from kvtier.integrations.vllm.connector_transfers import BlockTransfer, GroupPart
    from kvtier.integrations.vllm.connector_worker import WorkerMover

    bs, dtype = layout["block_tokens"], TORCH_DTYPES[layout["dtype"]]
    page = (2, layout["kv_heads"], bs, layout["head_dim"])
    caches = {f"layers.{i}.attn": torch.empty((2 * n + 1, *page), dtype=dtype) for i in range(layout["layers"])}
    for c in caches.values():
        c.view(torch.uint8).random_(0, 256)
    ns = KeyNamespace(layout["model"], '{"weights":"operator:bench"}', "bench", bs, layout["layers"],
                      layout["kv_heads"], layout["head_dim"], layout["dtype"], "bench", "cpu")
    settings = ConnectorSettings(pool="b", runtime_dir=str(env.rdir), staging_blocks=n, call_timeout_s=120)
    link = connector_link(settings.pool, settings.runtime_dir, n, settings.retry_s, settings.call_timeout_s, puts=True)
    mover = WorkerMover(settings, ns, link, (0, 1), (0, 1), [list(caches)])
    mover.register(caches)
    deadline = time.monotonic() + 30  # the link's own thread connects: wait for it, as an engine would not
    while link.client() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the connector's link did not connect in 30 s {link.mismatch}")
        time.sleep(0.05)
    raw = SyncClient(env.rdir, staging_blocks=n, timeout=120)
    pool = raw.pool("b")
    bb = pool.block_bytes
    save_s, put_s, load_s, get_s = [], [], [], []
    kv = torch.zeros((n, *pool.shape), dtype=dtype)  # the bound's buffers, touched before any timing
    out_t = torch.zeros_like(kv)
    correct = True
    try:
        for r in range(rounds):
            tokens = torch.randint(0, 128_000, (n * bs,), generator=torch.Generator().manual_seed(r)).tolist()
            src_ids = tuple(range(1, n + 1))
            tr = BlockTransfer(f"bench-{r}", tuple(tokens), None, None, (GroupPart(0, 0, src_ids),))
            keys = mover.chain_keys(link.client(), tr, 0)
            # connector save: gather from the pages, stage, until the daemon made them visible
            t0 = time.perf_counter()
            mover.save([tr])
            if not raw.wait_resident("b", keys, timeout=120):
                raise RuntimeError("connector save: blocks did not become visible")
            save_s.append(time.perf_counter() - t0)
            # the bound: Client.put of the same bytes (fresh keys) until visible
            gather_blocks(mover.caches, torch.tensor(src_ids), block_view(kv, layout["layers"], page))
            rkeys = raw.block_keys("b", tokens, salt=b"bench-raw")
            t0 = time.perf_counter()
            res = raw.put("b", rkeys, kv)
            if res.dropped or not raw.wait_resident("b", rkeys, timeout=120):
                raise RuntimeError(f"put: {res.dropped} dropped or blocks not visible")
            put_s.append(time.perf_counter() - t0)
            # connector load into other pages, verified; the bound: Client.get of the same bytes
            dst_ids = tuple(range(n + 1, 2 * n + 1))
            load = BlockTransfer(f"bench-load-{r}", tuple(tokens), None, None, (GroupPart(0, 0, dst_ids),))
            t0 = time.perf_counter()
            failed = mover.load([load])
            load_s.append(time.perf_counter() - t0)
            # Compared as bytes: random bits hold NaNs, which never equal themselves.
            correct &= not failed and all(torch.equal(_raw(c[1:n + 1]), _raw(c[n + 1:])) for c in mover.caches)
            t0 = time.perf_counter()
            got = raw.get("b", rkeys, out_t)
            get_s.append(time.perf_counter() - t0)
            correct &= got == n and torch.equal(_raw(out_t), _raw(kv))
    finally:
        raw.close()
        link.close()
    nbytes = n * bb
    out["connector"] = {"blocks": n, "block_bytes": bb, "correct": bool(correct),
                        "save_gbps": nbytes / min(save_s) / GB, "put_gbps": nbytes / min(put_s) / GB,
                        "load_gbps": nbytes / min(load_s) / GB, "get_gbps": nbytes / min(get_s) / GB}


def tier_rows(workdir: Path, chunk_bytes: int, n: int, rounds: int, out: dict) -> None:
    from kvtier.tools.bench_vllm_tier import measure_secondary_tier

    blocks = int(2 * rounds * n / 0.85) + 16
    env = Env(None, 0, workdir, pools_toml=f"""
[pools.chunks]
model = "vllm-chunks"
layers = 1
kv_heads = 1
head_dim = {chunk_bytes // 2}
block_tokens = 1
dtype = "uint8"
device = "cpu"
gpu_blocks = 0
cpu_blocks = {blocks}
""")
    try:
        out["tier"] = measure_secondary_tier(str(env.rdir), "chunks", chunk_bytes, n, rounds)
    finally:
        env.close()


def table(out: dict) -> list[dict]:
    rows = []

    def row(name, figure, bound, ratio, target, ok):
        rows.append({"path": name, "figure": figure, "bound": bound, "ratio": ratio, "target": target, "meets": ok})

    if "connector" in out:
        c = out["connector"]
        for what, x, b, bname in (("save: vLLM pages -> visible in cpu", c["save_gbps"], c["put_gbps"], "Client.put"),
                                  ("load: cpu -> vLLM pages, verified", c["load_gbps"], c["get_gbps"], "Client.get")):
            row(f"connector {what}", f"{x:.2f} GB/s", f"{bname} {b:.2f} GB/s", x / b, ">= 0.7x", x / b >= 0.7)
    if "tier" in out:
        t = out["tier"]
        for what, bound in (("store", "put"), ("load", "get")):
            x, b = t[f"{what}_gbps"], t[f"bound_{bound}_gbps"]
            row(f"secondary tier {what}", f"{x:.2f} GB/s", f"Client.{bound} {b:.2f} GB/s", x / b, ">= 0.7x",
                x / b >= 0.7)
    if "ttft_cells" in out:
        from kvtier.tools.bench_ttft import ttft_rows

        rows += ttft_rows(out)
    if "burst" in out:
        from kvtier.tools.bench_burst import burst_rows

        rows += burst_rows(out)
    return rows


def run_vllm_bench(args) -> int:
    quick = args.quick
    layout = TINY_PAGED if quick else PAGED
    from kvtier.layout import BlockLayout

    bb = BlockLayout(**layout).block_bytes
    # --gib is what one round moves through each path: half by the integration, half by the bound.
    n = 16 if quick else max(16, int(args.gib * (1 << 30)) // 2 // bb)
    rounds = 1 if quick else 2
    out: dict = {"quick": quick}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        tmp = Path(tmp)
        _say(f"connector: {n} blocks of {bb / (1 << 20):.2f} MiB, {rounds} rounds")
        (tmp / "c").mkdir()
        env = Env(layout, int(2 * rounds * n / 0.85) + 16, tmp / "c")
        try:
            connector_rows(env, layout, n, rounds, out)
        finally:
            env.close()
        chunk = 64 << 10 if quick else 2 << 20
        _say(f"secondary tier: {n} chunks of {chunk >> 10} KiB")
        (tmp / "t").mkdir()
        tier_rows(tmp / "t", chunk, n if not quick else 16, rounds, out)
        from kvtier.tools.bench_ttft import ttft_cells

        # --quick: one short length on the tiny model, two samples, no peer: every cell runs, no
        # figure is judged.
        lengths = [256] if quick else [int(x) for x in str(getattr(args, "lengths", "512,2048,4096")).split(",")]
        samples = 2 if quick else max(1, int(getattr(args, "samples", 5)))
        peer = None if quick else (getattr(args, "peer", "") or None)
        _say(f"TTFT on real engines: prefixes of {lengths} tokens, {samples} samples a cell"
             + (f", peer LMCache MP ({peer})" if peer else ", no peer (--peer)"))
        (tmp / "ttft").mkdir()
        dtype = str(getattr(args, "dtype", "bfloat16"))
        ttft_cells(tmp / "ttft", lengths, samples, quick=quick, peer_python=peer, out=out, dtype=dtype)
        from kvtier.tools.bench_burst import burst_cells

        rounds = 1 if quick else max(1, int(getattr(args, "burst_rounds", 2)))
        _say(f"under load: a burst of cached prefixes beside decoders, {rounds} round(s)")
        (tmp / "burst").mkdir()
        burst_cells(tmp / "burst", quick=quick, rounds=rounds, peer_python=peer, out=out, dtype=dtype)
    out["rows"] = table(out)
    print(render(out["rows"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    correct = out["connector"]["correct"] and out.get("tier", {}).get("correct", True)
    if not correct:
        print("kvtier bench --vllm: WRONG BYTES on a measured path (a bug: please report it)", file=sys.stderr)
    return 0 if correct else 1
