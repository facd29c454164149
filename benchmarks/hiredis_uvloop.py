"""What hiredis and uvloop each give: `kvtier bench` four times, with each one on and off.

    .venv/bin/python benchmarks/hiredis_uvloop.py [--gib 0.5] [--json out.json]

hiredis off: a sitecustomize on PYTHONPATH hides the module, so redis-py (in the bench process and
in the daemon it starts) falls back to its pure-Python reply parser. uvloop off: the daemon runs
on asyncio's own loop (`KVTIER__DAEMON__EVENT_LOOP=asyncio`). Each run measures its own bounds,
so the ratios compare across runs; the bounds that go through redis-py (redis tier, bus) move
with hiredis too, which is why raw figures are printed beside the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "hiredis + uvloop": {},
    "no hiredis": {"hiredis": False},
    "no uvloop": {"uvloop": False},
    "neither": {"hiredis": False, "uvloop": False},
}
ROWS = ("put", "get", "redis", "bus", "lookup")


def run(name: str, opts: dict, gib: float, tmp: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not opts.get("hiredis", True):
        hide = tmp / "no-hiredis"
        hide.mkdir(exist_ok=True)
        (hide / "sitecustomize.py").write_text("import sys\nsys.modules['hiredis'] = None  # import fails\n")
        env["PYTHONPATH"] = f"{hide}{os.pathsep}{ROOT}"
    if not opts.get("uvloop", True):
        env["KVTIER__DAEMON__EVENT_LOOP"] = "asyncio"
    out = tmp / f"{len(list(tmp.glob('*.json')))}.json"
    print(f"--- {name}", flush=True)
    probe = subprocess.run([sys.executable, "-c", "import redis.utils as u; print(u.HIREDIS_AVAILABLE)"],
                           env=env, capture_output=True, text=True, check=True)
    if (probe.stdout.strip() == "True") != opts.get("hiredis", True):
        raise SystemExit(f"{name}: redis-py hiredis={probe.stdout.strip()}, not what this run needs")
    subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--gib", str(gib), "--json", str(out)], env=env,
                   check=True)
    return json.loads(out.read_text())


def figures(res: dict) -> dict:
    return {
        "put": (res["put"]["gbps"], res["put"]["gbps"] / res["memcpy_gbps"]),
        "get": (res["get"]["gbps"], res["get"]["gbps"] / res["memcpy_gbps"]),
        "redis": (res["redis"]["gbps"], res["redis"]["gbps"] / res["redis"]["bound_gbps"]),
        "bus": (res["bus"]["events_per_s"], res["bus"]["events_per_s"] / res["bus"]["bound_per_s"]),
        "lookup": (res["lookup"]["ms"], res["lookup"]["ms"] / res["lookup"]["bound_ms"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-toggles-") as tmp:
        results = {name: figures(run(name, opts, args.gib, Path(tmp))) for name, opts in CONFIGS.items()}
    units = {"put": "GB/s", "get": "GB/s", "redis": "GB/s", "bus": "ev/s", "lookup": "ms"}
    print("\n| path | " + " | ".join(CONFIGS) + " |")
    print("|---|" + "---|" * len(CONFIGS))
    for row in ROWS:
        cells = [f"{results[c][row][0]:,.2f} {units[row]} ({results[c][row][1]:.2f}x)" for c in CONFIGS]
        print(f"| {row} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
