"""A private Redis master, its replica and three Sentinels watching them, on free loopback ports:
real redis-server processes (Sentinels are `redis-server <conf> --sentinel`). Short timeouts so
a killed master is replaced within a few seconds. No persistence."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from kvtier.processes import stop_processes
from tests.support.redis_cluster import free_port, wait_replicated
from tests.support.waiting import wait_until

SERVICE = "kvtier-test"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
START_TIMEOUT_S = 10.0


class _Server:
    def __init__(self, directory: Path, extra: list[str], sentinel: bool = False) -> None:
        self.dir = directory
        self.port = free_port()
        self.extra = extra
        self.sentinel = sentinel
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"  # a Sentinel rewrites its config file: it must be its own
        conf.write_text("\n".join([f"port {self.port}", "bind 127.0.0.1", f"dir {self.dir}", 'save ""',
                                   "appendonly no", *self.extra]) + "\n")
        args = [exe, str(conf)] + (["--sentinel"] if self.sentinel else [])
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(self._ready, timeout=START_TIMEOUT_S, interval=0.02, message=f"PING on port {self.port}")

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited early:\n{(self.dir / 'redis.log').read_text()[-2000:]}")
        try:
            with self.client(0.5) as c:
                return bool(c.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            stop_processes([self.proc], 5.0, signal.SIGKILL if kill else signal.SIGTERM)
        self.proc = None


class SentinelSet:
    def __init__(self, directory: Path) -> None:
        self.master = _Server(directory / "master", [])
        self.replica = _Server(directory / "replica", [])
        self.sentinels: list[_Server] = []
        self.dir = directory

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{SERVICE}"

    @classmethod
    @contextmanager
    def serving(cls, tmp_dir: Path | str) -> Iterator[SentinelSet]:
        s = cls(Path(tempfile.mkdtemp(prefix="kvtier-sentinel-", dir=tmp_dir)))
        try:
            s.master.start()
            s.replica.extra = [f"replicaof 127.0.0.1 {s.master.port}"]
            s.replica.start()
            for i in range(3):
                sentinel = _Server(s.dir / f"sentinel{i}", [
                    f"sentinel monitor {SERVICE} 127.0.0.1 {s.master.port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                ], sentinel=True)
                sentinel.start()
                s.sentinels.append(sentinel)
            wait_until(s._watching, timeout=20, interval=0.1, message="the Sentinels know the replica and each other")
            yield s
        finally:
            for server in [*s.sentinels, s.replica, s.master]:
                server.stop(kill=True)

    def _watching(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as c:
                info = c.sentinel_master(SERVICE)
                if int(info["num-slaves"]) < 1 or int(info["num-other-sentinels"]) < 2:
                    return False
        return True

    def master_port(self) -> int:
        """The master's port, as the Sentinels name it now."""
        with self.sentinels[0].client() as c:
            _host, port = c.sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def wait_replicated(self, timeout: float = 10.0) -> None:
        wait_replicated(self.master.client, timeout)
