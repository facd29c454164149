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


def daemon_toml(node: str, runtime_dir: Path, url: str, *, persist_arena: bool = False, level: str = "warning",
                stats_interval_s: float = 1.0, extra: str = "") -> str:
    """A benchmark daemon's config, without its pools: JSON logs, no metrics endpoint. `extra`:
    more tables (policy, arena)."""
    return f"""
[node]
id = "{node}"
runtime_dir = "{runtime_dir}"
[log]
format = "json"
level = "{level}"
[redis]
url = "{url}"
[daemon]
persist_arena = {str(persist_arena).lower()}
stats_interval_s = {stats_interval_s}
[metrics]
listen = ""
{extra}
"""


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    """A private redis-server on a free loopback port, no persistence; (process, URL) once it
    answers. TCP rather than a unix socket, as Redis is reached across nodes (a unix socket moved
    2 MiB SETs at well under half the speed here: docs/performance.md)."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--maxmemory", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        Env.wait_for(lambda: _answers(port), "redis-server")
    except BaseException:
        stop_processes([proc], 10)
        raise
    return proc, f"redis://127.0.0.1:{port}"


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
            self.redis, redis_url = start_redis(workdir)
        self.url = redis_url
        self.node = f"bench-{uuid.uuid4().hex[:8]}"
        self.rdir = workdir / "rt"
        cfg = workdir / "bench.toml"
        cfg.write_text(daemon_toml(self.node, self.rdir, self.url, extra=policy_toml)
                       + (pools_toml if pools_toml is not None
                          else pool_toml("b", layout or {}, device, gpu_blocks, cpu_blocks)))
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

    def wait_populated(self, timeout: float = 120) -> None:
        """Until every pool's cpu arena is populated (the daemon populates it in the background
        after READY): a put timed before then would measure the population too, which has a row
        of its own (kvtier/tools/bench_arena.py)."""
        def populated() -> bool:
            pools = self.stats().get("pools") or {}
            return bool(pools) and all((p.get("arena") or {}).get("state", "populated") == "populated"
                                       for p in pools.values())

        Env.wait_for(populated, "the arena population", timeout)

    def stats(self) -> dict:
        try:
            return json.loads((self.rdir / "stats.json").read_text())
        except (OSError, ValueError):
            return {}

    def close(self) -> None:
        self.daemon.stop_or_kill(30)  # the daemon first: it still talks to the redis-server
        if self.redis is not None:
            stop_processes([self.redis], 30)
