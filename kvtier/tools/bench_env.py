"""The benchmarks' environment: a private redis-server and a real `kvtier daemon` on it."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import redis

from kvtier.processes import die_with_parent, stop_processes
from kvtier.tools.daemon_process import DaemonProcess, DaemonStartError
from kvtier.tools.redis_cluster import free_port


def pool_toml(name: str, layout: dict, device: str, gpu_blocks: int, cpu_blocks: int) -> str:
    return f"""
[pools.{name}]
model = "{layout['model']}"
layers = {layout['layers']}
kv_heads = {layout['kv_heads']}
head_dim = {layout['head_dim']}
block_tokens = {layout['block_tokens']}
dtype = "{layout['dtype']}"
device = "{device}"
gpu_blocks = {gpu_blocks}
cpu_blocks = {cpu_blocks}
"""


def _answers(port: int) -> bool:
    try:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5) as r:
            return bool(r.ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


class Env:
    def __init__(self, layout: dict | None, cpu_blocks: int, workdir: Path, *, device: str = "cpu",
                 gpu_blocks: int = 0, pools_toml: str | None = None, redis_url: str | None = None,
                 policy_toml: str = "") -> None:
        """A daemon serving pool "b" of `layout` (or the [pools.*] tables in `pools_toml`), on a
        private redis-server, or on `redis_url` when given (a second node sharing the first's)."""
        self.dir = workdir
        self.redis = None
        if redis_url is None:
            # TCP on loopback, as Redis is reached across nodes. (A unix socket moved 2 MiB SETs at
            # well under half the speed here: docs/performance.md.)
            port = free_port()
            self.redis = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                 "--dir", str(workdir), "--maxmemory", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            self.wait_for(lambda: _answers(port), "redis-server")
            redis_url = f"redis://127.0.0.1:{port}"
        self.url = redis_url
        self.node = f"bench-{uuid.uuid4().hex[:8]}"
        self.rdir = workdir / "rt"
        cfg = workdir / "bench.toml"
        cfg.write_text(f"""
[node]
id = "{self.node}"
runtime_dir = "{self.rdir}"
[log]
format = "json"
level = "warning"
[redis]
url = "{self.url}"
[daemon]
persist_arena = false
[metrics]
listen = ""
{policy_toml}
""" + (pools_toml if pools_toml is not None else pool_toml("b", layout or {}, device, gpu_blocks, cpu_blocks)))
        self.daemon = DaemonProcess(cfg, self.rdir, log_path=workdir / "daemon.log", tied=True)
        try:
            self.daemon.start(timeout=60)
        except DaemonStartError:
            self.close()
            raise

    @staticmethod
    def wait_for(cond, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up")
            time.sleep(0.02)

    def stats(self) -> dict:
        try:
            return json.loads((self.rdir / "stats.json").read_text())
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        self.daemon.stop_or_kill(30)  # the daemon first: it still talks to the redis-server
        if self.redis is not None:
            stop_processes([self.redis], 30)
