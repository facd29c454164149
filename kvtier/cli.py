"""kvtier: the per-node KV-cache tier daemon and its tools (daemon, config check, status, where, bench, demo)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from kvtier.config import ConfigError, format_config, load_config
from kvtier.runtime import runtime_dir_for


def _load(path: str | None):
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"kvtier: invalid configuration ({len(e.problems)} problem(s)):", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_daemon(args: argparse.Namespace) -> int:
    import structlog

    from kvtier.daemon.app import Daemon
    from kvtier.daemon.lifecycle import stop_on_signals
    from kvtier.errors import KvtierError
    from kvtier.logs import configure_logging

    cfg = _load(args.config)
    configure_logging(cfg.log.level, cfg.log.format)
    log = structlog.get_logger("kvtier")

    daemon = Daemon(cfg, os.environ, log)

    async def main() -> None:
        stop = asyncio.Event()
        with stop_on_signals(stop, log, force_after_s=cfg.daemon.shutdown_grace_s + 10):
            await daemon.run(stop)

    try:
        if cfg.daemon.event_loop == "uvloop":
            import uvloop

            loop_factory = uvloop.new_event_loop
        else:
            loop_factory = asyncio.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
            # Stopped cleanly: segments, descriptor, Redis clients and the embedded server are
            # all released by now. Leave at once rather than through the loop and interpreter
            # teardown, where a wedged executor thread could keep a stopped daemon alive.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except asyncio.CancelledError:
        log.warning("daemon.forced_exit")
        return 1
    except KvtierError as e:  # expected (a setting, another daemon, no room): one line, no traceback
        log.error("daemon.fatal" if daemon.ready.is_set() else "daemon.start_failed", error=str(e))
        return 1
    except BaseException as e:  # report a fatal error as one log line, then a non-zero exit
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        log.error("daemon.fatal", error=f"{type(e).__name__}: {e}", exc_info=True)
        return 1
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    if args.file and args.config_file and args.file != args.config_file:
        print("kvtier config check: give the file once (FILE or --config FILE)", file=sys.stderr)
        return 2
    path = args.file or args.config_file
    cfg = _load(path)
    print(format_config(cfg, redact=True))
    print(f"# OK: {path or '(defaults)'} is valid", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvtier.processes import pid_alive
    from kvtier.runtime import RUNTIME_DIR_ENV, STATS, read_json
    from kvtier.status import liveness, render_status

    rdir = runtime_dir_for(args.runtime_dir, os.environ)
    prev, shown = None, 0
    try:
        while True:
            try:
                stats = read_json(rdir / STATS)
            except (OSError, ValueError) as e:
                where = "" if args.runtime_dir or os.environ.get(RUNTIME_DIR_ENV) else (
                    f" (the default runtime directory; a daemon elsewhere is found with --runtime-dir DIR or "
                    f"{RUNTIME_DIR_ENV}=DIR)")
                print(f"kvtier: no daemon stats at {rdir / STATS}{where}: {e}", file=sys.stderr)
                return 1
            down = liveness(stats, time.time(), pid_alive(stats.get("pid")))
            if down is not None and not args.watch:
                print(f"kvtier: {down}", file=sys.stderr)
                return 1
            if down is not None:
                text = down  # keep watching: a restarted daemon shows up again
            else:
                text = json.dumps(stats, indent=1) if args.json else render_status(stats, prev)
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[2J", end="")  # redraw in place, like top
            print(text, flush=True)
            shown += 1
            if not args.watch or (args.count and shown >= args.count):
                return 0
            prev = stats if down is None else None
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.vllm:
        from kvtier.tools.bench_vllm import run_vllm_bench

        return run_vllm_bench(args)
    if args.prefill:
        from kvtier.tools.prefill import run_prefill

        return run_prefill(args)
    if args.cluster:
        from kvtier.tools.bench_cluster import run_cluster_bench

        return run_cluster_bench(args)
    if args.disk:
        from kvtier.tools.bench_disk import run_disk_bench

        return run_disk_bench(args)
    if args.arena:
        from kvtier.tools.bench import run_arena_bench

        return run_arena_bench(args)
    from kvtier.tools.bench import run_bench

    return run_bench(args)


def cmd_where(args: argparse.Namespace) -> int:
    from kvtier.client import SyncClient
    from kvtier.errors import KvtierError

    try:
        if args.tokens_file:
            text = Path(args.tokens_file).read_text()
        else:
            text = args.tokens or ""
        tokens = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except (OSError, ValueError) as e:
        print(f"kvtier where: cannot read the token ids: {e}", file=sys.stderr)
        return 2
    try:
        with SyncClient(args.runtime_dir) as c:
            keys = c.block_keys(args.pool, tokens, salt=args.salt.encode() if args.salt else None)
            w = c.where(args.pool, keys)
            indexed, node = c.prefix_index, c.node
    except (KvtierError, OSError) as e:
        print(f"kvtier where: {e}", file=sys.stderr)
        return 1
    off = (f"[prefix_index] is not enabled on this daemon (node {node}): it lists none of its blocks, and "
           f"`where` names only nodes whose daemons enable it (docs/integrations/events.md)")
    if args.json:
        print(json.dumps({"blocks": len(keys), "length": w.length, "redis_length": w.redis_length,
                          "prefix_index_enabled": indexed,
                          "nodes": [{"node": r.node, "length": r.length, "tiers": list(r.tiers)} for r in w.nodes]}))
        return 0
    print(f"{len(keys)} full blocks; Redis holds the first {w.redis_length}")
    if not indexed:
        print(f"kvtier where: {off}", file=sys.stderr)
    if not w.nodes:
        print("no node holds the first block locally" + ("" if indexed else " in the index"))
    for r in w.nodes[:args.top]:
        tiers = ", ".join(f"{t} {r.tiers.count(t)}" for t in ("gpu", "cpu") if t in r.tiers)
        print(f"{r.node:<32} {r.length:>6} blocks  ({tiers})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtier.tools.demo import run_demo

    return run_demo(args)


def cmd_demo_worker(args: argparse.Namespace) -> int:
    from kvtier.tools.demo import worker_main

    return worker_main(args)


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    ap = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{daemon,config,status,where,bench,demo}")

    d = sub.add_parser("daemon", help="run the per-node daemon")
    d.add_argument("--config", "-c", help="TOML config file (default: built-in defaults + KVTIER__* env)")
    d.set_defaults(fn=cmd_daemon)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_cmd", required=True)
    cc = csub.add_parser("check", help="print the resolved config, or every error in it")
    cc.add_argument("file", nargs="?", help="TOML config file")
    cc.add_argument("--config", "-c", dest="config_file", help="the same, as `kvtier daemon` takes it")
    cc.set_defaults(fn=cmd_config_check)

    s = sub.add_parser("status", help="show tiers and counters of the running daemon")
    s.add_argument("--runtime-dir", help="the daemon's runtime directory")
    s.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    s.add_argument("--watch", "-w", action="store_true", help="refresh until Ctrl-C, with rates per second")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes")
    s.set_defaults(fn=cmd_status)

    b = sub.add_parser("bench", help="measure every hot path against its bound, measured in the same run")
    b.add_argument("--gib", type=float, default=1.0, help="working set in GiB (default 1)")
    b.add_argument("--quick", action="store_true", help="tiny sizes; checks each path returns the right bytes")
    b.add_argument("--json", help="also write the results as JSON to this file")
    b.add_argument("--prefill", action="store_true",
                   help="run the prefill-saved scenario instead: client processes replay a shared-prompt trace")
    b.add_argument("--vllm", action="store_true",
                   help="measure the vLLM connector and secondary tier against kvtier's own get/put, and TTFT "
                        "on real engines: cold, vLLM's own cache, kvtier's cases, the peer (needs vLLM; see "
                        "docs/integrations/vllm.md and docs/performance.md)")
    b.add_argument("--peer", default="", help="with --vllm: the LMCache venv's python (scripts/setup-lmcache-"
                                              "venv.sh) to run LMCache MP on the same engine and prompts")
    b.add_argument("--lengths", default="512,2048,4096", help="with --vllm: prefix lengths in tokens")
    b.add_argument("--samples", type=int, default=5, help="with --vllm: requests per TTFT cell")
    b.add_argument("--burst-rounds", type=int, default=2, help="with --vllm: rounds of the burst table")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="with --vllm: the TTFT model's dtype (float32 where the CPU has no bf16 matmul, "
                        "e.g. AVX2 only: vLLM falls back to a far slower bf16 path there)")
    b.add_argument("--cluster", action="store_true",
                   help="the redis tier and cross-node pulls on a local Redis Cluster of 1 and of 3 masters, "
                        "against raw redis-py cluster pipelines (--gib sets the bytes; default 1)")
    dk = b.add_argument_group("disk tier")
    dk.add_argument("--disk", action="store_true",
                    help="only the disk rows: the block file's write and verified read against fio's best on the "
                         "same directory, and header adoption at 1M blocks (needs fio)")
    dk.add_argument("--disk-dir", default="", help="the directory to measure (default: a temporary one under /var/tmp)")
    dk.add_argument("--disk-block-kib", type=int, default=2048, help="block size in KiB (default 2048, Llama-3-8B's)")
    dk.add_argument("--disk-gib", type=float, default=1.0, help="bytes written and read per shape, GiB (default 1)")
    ar = b.add_argument_group("cpu arena (also part of the default run)")
    ar.add_argument("--arena", action="store_true",
                    help="only the arena rows: start-to-READY and time-to-populated per GiB, cold and warm, the "
                         "header scan at 1M slots, and get/put on each backing")
    ar.add_argument("--arena-gib", type=float, default=2.0, help="arena size for the start rows (default 2)")
    ar.add_argument("--arena-huge-dir", default="",
                    help="also measure on this huge-page mount (hugetlbfs, or tmpfs mounted huge=within_size)")
    pf = b.add_argument_group("prefill scenario")
    pf.add_argument("--clients", type=int, default=3, help="client processes (default 3)")
    pf.add_argument("--requests", type=int, default=240, help="requests in the trace (default 240)")
    pf.add_argument("--prefixes", type=int, default=24, help="shared system prompts (default 24)")
    pf.add_argument("--gpu-blocks", type=int, default=48, help="gpu tier blocks (default 48)")
    pf.add_argument("--cpu-blocks", type=int, default=144, help="cpu tier blocks (default 144)")
    pf.add_argument("--device", default="cpu", help="gpu tier device: cpu (default), auto or cuda")
    pf.add_argument("--layout", choices=("llama8b", "llama70b"), default="llama8b",
                    help="block layout: Llama-3-8B (2 MiB blocks, default) or a 70B-class model (80 layers, "
                         "8 kv heads, 128 head dim, bf16: 5 MiB blocks)")
    pf.add_argument("--prefill-tok-s", type=float, default=None,
                    help="cost model: prefill tokens per second of GPU time (default: the layout's model at "
                         "400 TFLOP/s: 25,000 for 8B, 2,857 for 70B)")
    pf.add_argument("--pull", action="store_true",
                    help="clients get what Redis holds by prefetch and wait (the pull path), not read-through")
    pf.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    pf.add_argument("--timeout", type=float, default=900, help="give up after this many seconds (default 900)")
    b.set_defaults(fn=cmd_bench)

    wh = sub.add_parser("where", help="which nodes hold the longest cached prefix of these tokens (the prefix index)")
    wh.add_argument("--pool", required=True, help="the kvtier pool")
    src = wh.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="token ids, separated by commas or spaces, or a JSON list")
    src.add_argument("--tokens-file", help="a file of token ids (JSON list, or separated by commas or spaces)")
    wh.add_argument("--salt", help="the salt the blocks were put with")
    wh.add_argument("--runtime-dir", help="the local daemon's runtime directory")
    wh.add_argument("--top", type=int, default=10, help="nodes to list (default 10)")
    wh.add_argument("--json", action="store_true", help="print the answer as JSON")
    wh.set_defaults(fn=cmd_where)

    m = sub.add_parser("demo", help="start a daemon on the embedded Redis and drive a shared-prefix workload")
    m.add_argument("--config", "-c", help="daemon config (default: the built-in demo pool)")
    m.add_argument("--clients", type=int, default=3, help="client processes (default 3)")
    m.add_argument("--duration", type=float, default=30.0, help="seconds to run (default 30; Ctrl-C stops early)")
    m.add_argument("--prefixes", type=int, default=24, help="distinct shared system prompts (default 24)")
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--keep", action="store_true", help="keep the runtime directory (logs, stats) afterwards")
    m.add_argument("--disk-mib", type=int, default=0, metavar="N",
                   help="give the demo pool a disk tier of N MiB in the runtime directory (default 0: none)")
    m.set_defaults(fn=cmd_demo)

    w = sub.add_parser("_demo-worker")  # the demo's client processes: not listed
    w.add_argument("--runtime-dir", required=True)
    w.add_argument("--pool", required=True)
    w.add_argument("--prefixes", type=int, required=True)
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--report", required=True)
    w.add_argument("--trace", help="replay this trace file (JSON) instead of drawing requests at random")
    w.add_argument("--share", type=int, default=0, help="with --trace: replay requests share, share+shares, ...")
    w.add_argument("--shares", type=int, default=1)
    w.add_argument("--think-s", type=float, default=0.02, help="pause between requests")
    w.add_argument("--pull", action="store_true",
                   help="get what Redis holds by prefetch and wait (the pull path) instead of read-through")
    w.add_argument("--compute-tok-s", type=float, default=0.0,
                   help="wait for the prefill of the blocks missed at this many tokens/s before putting them")
    w.set_defaults(fn=cmd_demo_worker)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:
        # The reader went away (`kvtier status | head -1`): not an error. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
