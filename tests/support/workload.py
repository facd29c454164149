"""Client-side workloads the integration tests share: demo-worker processes and a put/get round trip."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def start_demo_workers(runtime_dir: Path, report_dir: Path, n: int, prefixes: int) -> list[subprocess.Popen]:
    """`n` demo-worker processes (zipf shared prompts, every block read checked) on pool "t"."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return [subprocess.Popen([sys.executable, "-m", "kvtier.cli", "_demo-worker", "--runtime-dir", str(runtime_dir),
                              "--pool", "t", "--prefixes", str(prefixes), "--seed", str(i),
                              "--report", str(report_dir / f"w{i}.json")], env=env)
            for i in range(n)]


def stop_demo_workers(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        w.send_signal(signal.SIGTERM)
    for w in workers:
        w.wait(30)


def demo_totals(report_dir: Path, n: int) -> dict:
    """The workers' reports, summed key by key."""
    from kvtier.tools.demo import sum_reports

    return sum_reports([json.loads((report_dir / f"w{i}.json").read_text()) for i in range(n)])


async def put_get_roundtrip(runtime_dir: Path) -> None:
    """Two blocks put through a live daemon come back byte-exact."""
    import torch

    from kvtier.client import Client

    async with await Client.connect(runtime_dir) as client:
        keys = client.block_keys("t", list(range(32)))
        kv = torch.arange(2 * 2 * 2 * 2 * 16 * 32, dtype=torch.float16).reshape(2, 2, 2, 2, 16, 32)
        assert (await client.put("t", keys, kv)).dropped == 0
        assert await client.wait_resident("t", keys, timeout=10)
        out = torch.zeros_like(kv)
        assert await client.get("t", keys, out) == 2 and torch.equal(out, kv)
