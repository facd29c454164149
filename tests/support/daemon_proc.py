"""A real `kvtier daemon` process for integration tests, with a NOTIFY_SOCKET the test owns."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.daemon.descriptor import STATS, read_json
from tests.support.waiting import wait_until

READY_TIMEOUT_S = 30.0

POOL_TOML = """
[pools.{name}]
model = "test-model"
layers = 2
kv_heads = 2
head_dim = 32
block_tokens = 16
dtype = "float16"
device = "cpu"
gpu_blocks = {gpu}
cpu_blocks = {cpu}
"""


def write_config(directory: Path, *, node: str, redis_url: str, gpu: int = 8, cpu: int = 16,
                 pool: str = "t", persist_arena: bool = False, extra: str = "",
                 pools_toml: str | None = None, bus_url: str | None = None) -> Path:
    """A daemon config for tests: small blocks (8 KiB), fast bus timings. `pools_toml` replaces
    the default test pool with the caller's [pools.*] tables (engine tests size their own)."""
    path = directory / f"{node}.toml"
    path.write_text(f"""
[node]
id = "{node}"
runtime_dir = "{directory / ('rt-' + node)}"

[log]
format = "json"
level = "info"

[redis]
url = "{redis_url}"
{f'bus_url = "{bus_url}"' if bus_url else ""}
socket_timeout_s = 2.0

[bus]
block_ms = 100
claim_idle_ms = 1000
max_deliveries = 3

[daemon]
shutdown_grace_s = 5.0
stats_interval_s = 0.1
persist_arena = {str(persist_arena).lower()}
off_loop_copy_bytes = 0  # every copy off the event loop: the thread path is the one tested
{extra}

[metrics]
listen = "127.0.0.1:0"  # a free port: test daemons run side by side
stream_sample_s = 0.2
""" + (pools_toml if pools_toml is not None else POOL_TOML.format(name=pool, gpu=gpu, cpu=cpu)))
    return path


class DaemonProcess:
    def __init__(self, config: Path, runtime_dir: Path, env: dict | None = None) -> None:
        self.config = config
        self.node = config.stem  # write_config names the file after the node id
        self.runtime_dir = runtime_dir
        self.log_path = config.with_suffix(".log")
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.messages: list[str] = []
        self._sock: socket.socket | None = None
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvtier-notify-"))  # short path for sun_path

    def start(self, wait_ready: bool = True) -> "DaemonProcess":
        self.messages = []  # a restart must earn its own READY=1
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock_path = self._sock_dir / f"n{time.monotonic_ns()}.sock"
        self._sock.bind(str(sock_path))
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(sock_path)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "daemon", "--config", str(self.config)],
            env=env, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT,
        )
        if wait_ready:
            self.wait_for_message("READY=1", READY_TIMEOUT_S)
        return self

    def _drain(self, timeout: float) -> None:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return
        self.messages.extend(data.decode().splitlines())

    def take_messages(self) -> list[str]:
        """Every notification received since the last call (queued in the socket included)."""
        while self._sock is not None:
            n = len(self.messages)
            self._drain(0.0)
            if len(self.messages) == n:
                break
        taken, self.messages = self.messages, []
        return taken

    def next_messages(self, timeout: float) -> list[str]:
        """Wait up to `timeout` for the next notification; it and any queued behind it."""
        self._drain(timeout)
        return self.take_messages()

    def wait_for_message(self, msg: str, timeout: float) -> None:
        def seen() -> bool:
            if msg in self.messages:
                return True
            if self.proc.poll() is not None and msg not in self.messages:
                self._drain(0.01)
                if msg in self.messages:
                    return True
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before {msg}:\n{self.log_tail()}")
            self._drain(0.05)
            return msg in self.messages

        wait_until(seen, timeout=timeout, interval=0.0, message=f"{msg} from the daemon")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> dict:
        return read_json(self.runtime_dir / STATS)

    def pool_stats(self, pool: str = "t") -> dict:
        try:
            return self.stats()["pools"][pool]
        except (OSError, ValueError, KeyError):
            return {}

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self._sock is not None:
            self._drain(0.05)
            self._sock.close()
            self._sock = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""
