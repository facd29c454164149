"""What `kvtier bench` prints: the table of rows (each figure against its bound, with the target
it must meet), the note on what the ratios need, and the JSON; a run that read wrong bytes fails."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvtier.shm.onepass import COMPILED, HASH_KERNEL
from kvtier.tools.bench_arena import rows as arena_table


def _memcpy(x: dict) -> str:
    """The bound, and beside it the same bytes copied a block at a time where measured."""
    block = f" (a block at a time: {x['memcpy_block_gbps']:.2f})" if "memcpy_block_gbps" in x else ""
    return f"memcpy {x['memcpy_gbps']:.2f} GB/s{block}"


def table(out: dict) -> list[dict]:
    rows = []

    def row(name, figure, bound, ratio, target, ok):
        rows.append({"path": name, "figure": figure, "bound": bound, "ratio": ratio, "target": target, "meets": ok})

    m = out["memcpy_gbps"]
    if "get" in out:
        g = out["get"]["gbps"]
        mb = _memcpy(out)
        row("get: cpu arena -> caller tensor", f"{g:.2f} GB/s", mb, g / m, ">= 0.8x", g / m >= 0.8)
        p = out["put"]["gbps"]
        row("put: client -> visible in cpu", f"{p:.2f} GB/s{_granted(out['put'])}", mb, p / m, ">= 0.5x", p / m >= 0.5)
    for kib, x in out.get("small_blocks", {}).items():
        sm = x["memcpy_gbps"]
        for op, target in (("get", 0.5), ("put", 0.3)):
            y = x[op]
            row(f"{op}, {kib} KiB blocks", f"{y['blocks_per_s']:,.0f} blocks/s, {y['gbps']:.2f} GB/s{_granted(y)}",
                _memcpy(x), y["gbps"] / sm, f">= {target}x", y["gbps"] / sm >= target)
    if "redis" in out:
        x = out["redis"]
        for op, ours, bound, shape in (("put", "put_gbps", "raw_put_gbps", "raw_put_shape"),
                                       ("verified get", "get_gbps", "raw_get_gbps", "raw_get_shape")):
            s = x[shape]
            ratio = x[ours] / x[bound]
            raw = f"best raw {'SET' if op == 'put' else 'GET'} {x[bound]:.2f} GB/s"
            row(f"redis tier: {op}", f"{x[ours]:.2f} GB/s", f"{raw} ({s['depth']} deep x {s['connections']})",
                ratio, ">= 0.8x", ratio >= 0.8)
    if "cross_node" in out:
        x = out["cross_node"]
        ratio = x["gbps"] / x["bound_gbps"]
        row(f"cross-node read-through: cold {x['blocks']}-block prefix", f"{x['gbps']:.2f} GB/s",
            f"raw GET + copy {x['bound_gbps']:.2f} GB/s", ratio, ">= 0.9x", ratio >= 0.9)
    if "bus" in out:
        x, b = out["bus"]["events_per_s"], out["bus"]["bound_per_s"]
        row("bus: published -> applied", f"{x:,.0f} ev/s", f"raw XADD+XREADGROUP {b:,.0f} ev/s", x / b, ">= 0.5x",
            x / b >= 0.5)
    if "lookup" in out:
        x, b = out["lookup"]["ms"], out["lookup"]["bound_ms"]
        row("lookup: 32,768 tokens, hashing included", f"{x:.2f} ms", f"bare SHA-256 chain {b:.2f} ms", x / b, "<= 2x",
            x / b <= 2)
    if "directory" in out:
        x = out["directory"]["ratio"]
        row("lookup: 1M blocks indexed vs 1k", f"{x:.2f}x", "", x, "<= 1.5x", x <= 1.5)
    if "where" in out:
        x = out["where"]
        row(f"where: {x['blocks'] * 16:,} tokens, {x['nodes']:,} nodes in the prefix index", f"{x['where_ms']:.2f} ms",
            f"bare lookup (EXISTS) {x['bare_lookup_ms']:.2f} ms", x["ratio"], "(measured)", None)
    for r in arena_table(out):
        row(*r)
    if "idle" in out:
        c, r = out["idle"]["cpu_pct"], out["idle"]["rss_beyond_arenas_mb"]
        row("daemon at idle", f"{c:.2f} % CPU, {r:.0f} MB", "", None, "< 2 %, < 200 MB", c < 2 and r < 200)
    return rows


def shown(ratio: float, target: str) -> str:
    """A ratio to two places, or three where two would round it onto its target and hide the
    verdict (0.298 against >= 0.3x reads 0.298, not 0.30)."""
    two = f"{ratio:.2f}"
    bound = target.lstrip("<>= ").rstrip("x")
    try:
        return f"{ratio:.3f}" if float(two) == float(bound) != ratio else two
    except ValueError:  # "(measured)": no number to meet
        return two


def render(rows: list[dict]) -> str:
    lines = ["| path | figure | bound (same run) | ratio | target | meets |", "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["ratio"] is None else shown(r["ratio"], r["target"])
        lines.append(f"| {r['path']} | {r['figure']} | {r['bound']} | {ratio} | {r['target']} | "
                     f"{'—' if r['meets'] is None else 'yes' if r['meets'] else 'NO'} |")
    return "\n".join(lines)


def idle_note(rows: list[dict], load: float, cores: int) -> str:
    """What the ratios need: kvtier and its bound share this machine's cores in the same run, so
    a busy machine (or one with few cores) moves both, and not by the same factor."""
    missed = sum(r.get("meets") is False for r in rows)
    note = (f"Each ratio is against a bound measured in the same run, on the same cores: the figures "
            f"need an otherwise idle machine (load average now {load:.2f} on {cores} cores).")
    if missed:
        note += (f" {missed} row(s) marked NO: on a busy or small host, run again when it is idle before "
                 f"reading them as kvtier's (docs/performance.md has figures from idle runs).")
    return note


def copy_note(compiled: bool, kernel: str = "baseline") -> str:
    """Which block copy the shm rows ran: the figures differ by up to 1.5x between the two."""
    if compiled:
        return ("Block copies: compiled (kvtier/shm/native/copy_hash.c: non-temporal stores, the GIL released; "
                f"xxh3's {kernel} kernel).")
    return ("Block copies: numpy and python-xxhash: kvtier.shm._copy_hash did not build on this install "
            "(it needs a C compiler and Python's headers), so the shm rows run slower than they can.")


def finish(out: dict, table: str, json_path: str | None, correct: bool) -> int:
    """Print the table, write the JSON, and fail the run if any path read wrong bytes."""
    out["compiled_copy"] = COMPILED
    out["hash_kernel"] = HASH_KERNEL
    print(table)
    print(idle_note(out.get("rows", []), os.getloadavg()[0], os.cpu_count() or 1))
    print(copy_note(COMPILED, HASH_KERNEL))
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    if not correct:
        print("kvtier bench: WRONG BYTES on a measured path (a bug: please report it)", file=sys.stderr)
    return 0 if correct else 1


def _granted(put: dict) -> str:
    """How many of a put row's blocks the client wrote into granted slots (the rest: staging),
    each round's rate where the row is the best of several, and the best round's CPU a block."""
    n, r = put.get("granted_blocks"), put.get("rounds_blocks_per_s") or []
    through = f"{n:,} blocks through grants" if isinstance(n, int) else ""
    rounds = f"best of {len(r)} rounds: {' / '.join(f'{x:,}' for x in r)} blocks/s" if len(r) > 1 else ""
    c, d = put.get("client_cpu_us_per_block"), put.get("daemon_cpu_us_per_block")
    cpu = f"CPU a block: client {c:.1f} us, daemon {d:.1f} us" if c is not None and d is not None else ""
    said = "; ".join(x for x in (through, rounds, cpu) if x)
    return f" ({said})" if said else ""
