"""A private redis-server on a unix socket, owned by the test session (never the machine's own).

No persistence (`--save ""`, no AOF), so `restart()` comes back empty: the same socket path with
all data lost, as after a crash of a cache-only Redis (reliability.md §1.4).
"""

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
from tests.support.waiting import wait_until

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux; keep a margin


class RedisProcess:
    """One redis-server process. Build with `spawn(tmp_dir)`; `stop()` when done."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.socket_path = directory / "redis.sock"
        self.log_path = directory / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @classmethod
    def spawn(cls, tmp_dir: Path | str) -> RedisProcess:
        directory = Path(tmp_dir)
        if len(str(directory / "redis.sock")) > SUN_PATH_MAX:
            directory = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))  # short path for the socket
        directory.mkdir(parents=True, exist_ok=True)
        server = cls(directory)
        server.start()
        return server

    @classmethod
    @contextmanager
    def serving(cls, tmp_dir: Path | str) -> Iterator[RedisProcess]:
        """spawn(tmp_dir), killed on the way out (for fixtures)."""
        server = cls.spawn(tmp_dir)
        try:
            yield server
        finally:
            server.stop(kill=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            raise RuntimeError("redis-server is already running")
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
        args = [
            exe, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(self._ready, timeout=START_TIMEOUT_S, interval=0.02, message=f"PING on {self.url}")

    def _ready(self) -> bool:
        if not self.running:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited early:\n{tail}")
        client = redis.Redis(
            unix_socket_path=str(self.socket_path), socket_timeout=0.5, socket_connect_timeout=0.5
        )
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL with `kill`) and reap. Idempotent."""
        if self.proc is not None:
            stop_processes([self.proc], STOP_TIMEOUT_S, signal.SIGKILL if kill else signal.SIGTERM)
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        """Same socket path, empty dataset."""
        self.stop(kill=kill)
        self.start()

    def client(self) -> redis.Redis:
        """A sync client for test set-up and inspection; the caller closes it."""
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=5.0)
