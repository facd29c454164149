"""`kvtier demo`: a daemon on the embedded Redis plus client processes whose prompts share prefixes.

Every block's bytes are a pure function of its key, so each client checks every block it reads:
the closing summary reports wrong bytes, which must be zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.processes import die_with_parent, stop_processes
from kvtier.runtime import DESCRIPTOR, STATS, read_json
from kvtier.status import human_bytes
from kvtier.tools.daemon_process import DaemonProcess, DaemonStartError
from kvtier.tools.demo_config import demo_disk_config

READY_TIMEOUT_S = 30.0


PATTERN_BYTES = 4093  # prime: a copy shifted by any offset but a multiple of it mismatches


def expected_block(key: bytes, nbytes: int, into: np.ndarray | None = None) -> np.ndarray:
    """A block's bytes, a function of its key: a key-seeded random run of PATTERN_BYTES, repeated.
    Cheap to make (a tile, not nbytes of random numbers): on a 2-core machine, the clients'
    checking must not take the CPU the measured paths need. `into` is filled instead of a new array."""
    run = np.frombuffer(np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(PATTERN_BYTES),
                        dtype=np.uint8)
    out = np.empty(nbytes, dtype=np.uint8) if into is None else into
    whole = nbytes // PATTERN_BYTES * PATTERN_BYTES
    out[:whole].reshape(-1, PATTERN_BYTES)[:] = run
    out[whole:] = run[:nbytes - whole]
    return out


def shared_prompts(n: int, seed: int = 1234) -> list[list[int]]:
    """The system prompts every client shares: 8 to 24 blocks of token ids up to 128k."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128_000, size=16 * int(rng.integers(8, 25))).tolist() for _ in range(n)]


# --- the client process ------------------------------------------------------------------------


def worker_main(args) -> int:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    report = asyncio.run(_worker(args, stop))
    Path(args.report).write_text(json.dumps(report))
    return 0


def zipf_weights(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** 1.1  # zipf: a few prompts are hot
    return w / w.sum()


def _draw(rng: np.random.Generator, weights: np.ndarray) -> dict:
    """One request: a shared prompt (zipf) plus a private suffix of 1-4 blocks, given by its
    length and the seed of its tokens."""
    return {"prompt": int(rng.choice(len(weights), p=weights)), "suffix_blocks": int(rng.integers(1, 5)),
            "suffix_seed": int(rng.integers(0, 2**31))}


def make_trace(requests: int, prefixes: int, seed: int) -> list[dict]:
    """A replayable trace of `requests` requests over `prefixes` shared prompts."""
    rng, weights = np.random.default_rng(seed), zipf_weights(prefixes)
    return [_draw(rng, weights) for _ in range(requests)]


def request_tokens(prompts: list[list[int]], req: dict) -> list[int]:
    suffix = np.random.default_rng(req["suffix_seed"]).integers(0, 128_000, 16 * req["suffix_blocks"])
    return prompts[req["prompt"]] + suffix.tolist()


def _requests(args, prompts: list[list[int]]):
    """This worker's requests: its share of the trace file, or an endless stream from its seed."""
    if args.trace:
        trace = json.loads(Path(args.trace).read_text())
        yield from trace[args.share::args.shares]
        return
    rng, weights = np.random.default_rng(args.seed), zipf_weights(len(prompts))
    while True:
        yield _draw(rng, weights)


async def _worker(args, stop: dict) -> dict:
    import torch

    from kvtier.client import Client
    from kvtier.logs import configure_logging

    configure_logging("warning", "json")  # the orchestrator prints progress; keep the console for it
    client = await Client.connect(args.runtime_dir, staging_blocks=64)
    pool = client.pool(args.pool)
    bb = pool.block_bytes
    prompts = shared_prompts(args.prefixes)
    r = dict(requests=0, blocks=0, local_hits=0, redis_hits=0, via_redis=0, wrong_blocks=0, put_staged=0,
             put_dropped=0, gpu_reads=0, cpu_reads=0, hot_blocks=0, hot_hits=0, cold_blocks=0, cold_hits=0,
             gpu_at_lookup=0, cpu_at_lookup=0, prefix_s=[], prefix_blocks=[], pulls=0, pull_timeouts=0, pull_s=0.0,
             ask_s=0.0, asks_empty=0, attempt_s=0.0)
    max_blocks = max(len(p) for p in prompts) // 16 + 4
    out = torch.empty((max_blocks, *pool.shape), dtype=pool.dtype)
    want = np.empty(bb, dtype=np.uint8)  # what a block read must hold
    made = np.empty((max_blocks, bb), dtype=np.uint8)  # the blocks "prefilled" and put
    try:
        for req in _requests(args, prompts):
            if stop["now"]:
                break
            rank = req["prompt"]
            keys = client.block_keys(args.pool, request_tokens(prompts, req), salt=b"demo")
            t0 = time.perf_counter()  # time to get the cached prefix: lookup, Redis, read
            if args.pull:
                found = await client.locate(args.pool, keys)
                if len(keys) > found.length:  # asking Redis costs time, whatever it answers
                    asked = time.perf_counter() - t0
                    r["pull_s"] += asked
                    if not found.redis_length:
                        r["ask_s"] += asked
                        r["asks_empty"] += 1
                if found.redis_length:
                    # Pull the rest of the prefix up from Redis before reading it.
                    head = keys[found.length - 1] if found.length else None
                    more = keys[found.length : found.length + found.redis_length]
                    t_pull = time.perf_counter()
                    await client.prefetch(args.pool, more, parent=head)
                    if not await client.wait_resident(args.pool, keys[: found.length + len(more)], timeout=1.0):
                        r["pull_timeouts"] += 1  # read what has arrived; recompute the rest
                    r["pull_s"] += time.perf_counter() - t_pull
                    r["pulls"] += 1
                    r["redis_hits"] += len(more)
                hit = client.lookup(args.pool, keys)
                n = await client.get(args.pool, keys, out)
            else:
                # Read-through: the local head from shared memory, the rest straight from Redis.
                found = hit = client.lookup(args.pool, keys)
                before, spent = client.stats.remote_reads, client.stats.remote_s
                n = await client.get(args.pool, keys, out, remote=True)
                asked = client.stats.remote_s - spent  # the time spent reading from Redis
                r["pull_s"] += asked
                if client.stats.remote_reads > before:
                    r["pulls"] += 1
                    r["redis_hits"] += client.stats.remote_reads - before
                elif n < len(keys):  # Redis was asked and had nothing to add
                    r["ask_s"] += asked
                    r["asks_empty"] += 1
            r["attempt_s"] += time.perf_counter() - t0  # every request's, also those that found nothing
            if n:  # something was cached: the time to get it
                r["prefix_s"].append(time.perf_counter() - t0)
                r["prefix_blocks"].append([hit.length, n - hit.length])  # local at lookup, the rest from Redis
            for i in range(n):
                if not np.array_equal(out[i].view(torch.uint8).reshape(-1).numpy(), expected_block(keys[i], bb, want)):
                    r["wrong_blocks"] += 1
            r["gpu_reads"] += sum(1 for t in hit.tiers[:n] if t.label == "gpu")
            r["cpu_reads"] += sum(1 for t in hit.tiers[:n] if t.label == "cpu")
            # Where the blocks read were when the request arrived (the rest came from Redis).
            r["gpu_at_lookup"] += sum(1 for t in found.tiers[:n] if t.label == "gpu")
            r["cpu_at_lookup"] += sum(1 for t in found.tiers[:n] if t.label == "cpu")
            r["requests"] += 1
            r["blocks"] += len(keys)
            r["local_hits"] += n
            r["via_redis"] += max(0, n - found.length)  # read now, but only in Redis at lookup
            # The prompt part only: how well the hottest vs the colder half of prompts is served.
            band = "hot" if rank == 0 else "cold" if rank >= len(prompts) // 2 else None
            if band:
                r[f"{band}_blocks"] += len(prompts[rank]) // 16
                r[f"{band}_hits"] += min(n, len(prompts[rank]) // 16)
            if n < len(keys) and args.compute_tok_s:
                # The GPU prefills the rest meanwhile: the client waits that long (the cost model's
                # rate), as an engine does, rather than put it back at once.
                await asyncio.sleep((len(keys) - n) * 16 / args.compute_tok_s)
            if n < len(keys):  # "prefill" the rest and hand it to the daemon
                fresh = made[:len(keys) - n]
                for j, k in enumerate(keys[n:]):
                    expected_block(k, bb, fresh[j])
                kv = torch.from_numpy(fresh).view(pool.dtype).reshape(len(keys) - n, *pool.shape)
                res = await client.put(args.pool, keys[n:], kv, parent=keys[n - 1] if n else None)
                r["put_staged"] += res.staged
                r["put_dropped"] += res.dropped
            await asyncio.sleep(args.think_s)  # think time; also leaves the 2-core machine to the daemon
    finally:
        r["remote_failures"] = client.stats.remote_failures
        await client.close()
    return r


# --- the orchestrator ----------------------------------------------------------------------------


def progress_line(stats: dict, t0: float) -> str:
    parts = [f"t={time.monotonic() - t0:5.1f}s"]
    for _, pool in stats.get("pools", {}).items():
        for tier in [t for t in ("gpu", "cpu", "disk", "redis") if t in pool["tiers"]]:
            t = pool["tiers"][tier]
            cap = f"/{t['capacity']}" if t["capacity"] else ""
            parts.append(f"{tier} {t['blocks']}{cap} blk hit {t['hits']} up {t['promoted_in']} "
                         f"down {t['demoted_in']} ev {t['evicted']}")
        parts.append(f"miss {pool['misses']}")
    return " | ".join(parts)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run_demo(args) -> int:
    # SIGTERM/SIGHUP stop the demo like Ctrl-C does, through the same cleanup. SIGINT is set too:
    # a process started in the background by a non-interactive shell inherits it ignored, and
    # Python then leaves it so (the demo would not stop on Ctrl-C or `kill -INT`).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    rdir = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))
    env = dict(os.environ)
    env.update({
        "KVTIER__NODE__RUNTIME_DIR": str(rdir),
        "KVTIER__NODE__ID": f"demo-{os.getpid()}",
        "KVTIER__DAEMON__PERSIST_ARENA": "false",
        "KVTIER__METRICS__LISTEN": "127.0.0.1:0",  # a free port, whatever else runs on this machine
        "KVTIER__LOG__FORMAT": "json",
    })
    log_path = rdir / "daemon.log"
    kept = "" if args.keep else "; removed at exit, --keep keeps it"
    print(f"kvtier demo: starting the daemon (runtime dir {rdir}, log {log_path}{kept})", flush=True)
    # A new session: Ctrl-C reaches the children only through us, in order. Tied: if we are
    # killed outright, they go too.
    config = Path(args.config) if args.config else demo_disk_config(rdir, args.disk_mib) if args.disk_mib else None
    daemon = DaemonProcess(config, rdir, env, log_path=log_path,
                           new_session=True, tied=True)
    workers: list[subprocess.Popen] = []
    code = 0
    try:
        try:
            daemon.start(timeout=READY_TIMEOUT_S)
        except DaemonStartError as e:
            raise SystemExit(f"kvtier demo: {e}") from None
        pool = sorted(read_json(rdir / DESCRIPTOR)["pools"])[0]
        print(f"kvtier demo: daemon ready; {args.clients} clients on pool {pool!r} for {args.duration:.0f}s "
              "(Ctrl-C stops)", flush=True)
        for i in range(args.clients):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli", "_demo-worker", "--runtime-dir", str(rdir), "--pool", pool,
                 "--prefixes", str(args.prefixes), "--seed", str(args.seed * 1000 + i),
                 "--report", str(rdir / f"client-{i}.json")], env=env, start_new_session=True,
                preexec_fn=die_with_parent))
        t0 = time.monotonic()
        gone: set[int] = set()
        started = False  # the clients' first puts have reached the daemon
        print("kvtier demo: waiting for the clients to start (each imports torch first)", flush=True)
        try:
            while time.monotonic() - t0 < args.duration:
                time.sleep(1.0)
                if daemon.proc.poll() is not None:
                    print(f"kvtier demo: the daemon exited with {daemon.proc.returncode}; see {log_path}", flush=True)
                    code = 1
                    break
                for i, w in enumerate(workers):
                    if w.poll() is not None and i not in gone:
                        gone.add(i)
                        code = 1
                        print(f"kvtier demo: client {i} exited early ({_exit_reason(w.returncode)})", flush=True)
                try:
                    stats = read_json(rdir / STATS)
                except (OSError, ValueError):
                    continue
                # Puts handed over but not yet placed show as zeros: start with the first figure the line shows.
                started = started or any(p["hits"] or p["misses"] or any(t["blocks"] for t in p["tiers"].values())
                                         for p in stats["pools"].values())
                if started:
                    print(progress_line(stats, t0), flush=True)
        except KeyboardInterrupt:
            print("\nkvtier demo: stopping", flush=True)
    finally:
        # A second Ctrl-C (or TERM) must not cut the cleanup short and leave processes behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        stop_processes(workers, 15)
        daemon_code = daemon.stop_or_kill(30) if daemon.proc is not None else 1
    code = code or (daemon_code or 0)
    code = _summary(rdir, len(workers)) or code
    if args.keep:
        print(f"kvtier demo: kept {rdir} (daemon.log, stats.json, client reports)")
    else:
        shutil.rmtree(rdir, ignore_errors=True)
    return code


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def sum_reports(reports: list[dict]) -> dict:
    """The workers' reports added up key by key (lists, such as per-request times, joined)."""
    return {k: sum((r[k] for r in reports), [] if isinstance(reports[0][k], list) else 0)
            for k in (reports[0] if reports else {})}


def _summary(rdir: Path, n_workers: int) -> int:
    try:
        stats = read_json(rdir / STATS)
    except (OSError, ValueError):
        print("kvtier demo: no final stats were written")
        return 1
    reports = []
    for i in range(n_workers):
        try:
            reports.append(json.loads((rdir / f"client-{i}.json").read_text()))
        except (OSError, ValueError):
            print(f"kvtier demo: client {i} wrote no report")
    tot = sum_reports(reports)
    print("\n=== kvtier demo summary ===")
    for name, pool in stats["pools"].items():
        print(f"pool {name}: block {human_bytes(pool['block_bytes'])}, puts {pool['puts']}, "
              f"dropped {pool['puts_dropped'] + pool.get('client_puts_dropped', 0)}, misses {pool['misses']}")
        print(f"  {'tier':<6}{'blocks':>8}{'MiB':>8}{'hits':>8}{'stored':>8}"
              f"{'promoted':>10}{'demoted':>9}{'evicted':>9}{'failed':>8}")
        for tier in [t for t in ("gpu", "cpu", "disk", "redis") if t in pool["tiers"]]:
            t = pool["tiers"][tier]
            hits = pool.get("remote_reads", 0) if tier == "redis" else t["hits"]
            print(f"  {tier:<6}{t['blocks']:>8}{t['bytes'] / 2**20:>8.1f}{hits:>8}{t['stored']:>8}"
                  f"{t['promoted_in']:>10}{t['demoted_in']:>9}{t['evicted']:>9}{t['failed']:>8}")
        print("  hits: blocks clients read from the tier (redis: read straight through from Redis); failed:\n"
              "  transfers into the tier that did not complete (no room, a Redis error, a changed staging\n"
              "  slot), each a miss and never wrong bytes")
    if tot:
        shm = tot["local_hits"] - tot["redis_hits"]
        print(f"clients: {tot['requests']} requests, {tot['blocks']} blocks wanted, {tot['local_hits']} read "
              f"({tot['local_hits'] / max(1, tot['blocks']):.0%}): {shm} from shared memory (of the leading runs: gpu "
              f"{tot['gpu_reads']}, cpu {tot['cpu_reads']}), {tot['redis_hits']} from Redis; {tot['put_staged']} put, "
              f"{tot['put_dropped']} put dropped")
        print(f"wrong blocks read: {tot['wrong_blocks']}")
    bad = bool(tot.get("wrong_blocks"))
    return 1 if bad or not reports else 0
