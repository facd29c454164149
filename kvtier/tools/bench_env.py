"""The benchmarks' environment: a private redis-server and a real `kvtier daemon` on it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvtier.processes import die_with_parent, stop_processes


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


class Env:
    def __init__(self, layout: dict | None, cpu_blocks: int, workdir: Path, *, device: str = "cpu",
                 gpu_blocks: int = 0, pools_toml: str | None = None, redis_url: str | None = None,
                 policy_toml: str = "") -> None:
        """A daemon serving pool "b" of `layout` (or the [pools.*] tables in `pools_toml`), on a
        private redis-server, or on `redis_url` when given (a second node sharing the first's)."""
        self.dir = workdir
        self.sock = workdir / "redis.sock"
        self.redis = None
        if redis_url is None:
            self.redis = subprocess.Popen(
                ["redis-server", "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
                 "--save", "", "--appendonly", "no", "--dir", str(workdir), "--maxmemory", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            self.wait_for(lambda: self.sock.exists(), "redis-server")
        self.url = redis_url or f"unix://{self.sock}"
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
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(workdir / "n.sock"))
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "daemon", "--config", str(cfg)],
            env={**os.environ, "NOTIFY_SOCKET": str(workdir / "n.sock")},
            stdout=open(workdir / "daemon.log", "w"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.notify.settimeout(0.5)
        deadline = time.monotonic() + 60
        while True:
            try:
                if b"READY=1" in self.notify.recv(4096):
                    break
            except TimeoutError:
                pass
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "daemon.log").read_text()[-2000:]
                self.close()
                raise RuntimeError(f"the daemon did not start (exit code {self.daemon.returncode}):\n{tail}")

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
        stop_processes([self.daemon], 30)  # the daemon first: it still talks to the redis-server
        if self.redis is not None:
            stop_processes([self.redis], 30)
        self.notify.close()
