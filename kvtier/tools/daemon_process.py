"""A real `kvtier daemon` child process, with a NOTIFY_SOCKET of the caller's: the one launcher
that the benchmarks, the demo and the tests share (start, wait for READY, read its stats, stop)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.processes import die_with_parent
from kvtier.runtime import STATS, read_json

READY_TIMEOUT_S = 30.0


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not send the awaited notification, in time."""


class DaemonProcess:
    def __init__(self, config: Path | None, runtime_dir: Path, env: dict | None = None, *,
                 log_path: Path | None = None, new_session: bool = False, tied: bool = False) -> None:
        """`config` None: the daemon's built-in defaults plus KVTIER__* from `env`. The log goes
        to `log_path` (default: the config's name with .log). `new_session`: the daemon does not
        get the caller's Ctrl-C; it is stopped through this object. `tied`: it is killed if the
        starting thread dies outright (PDEATHSIG), as a tool's daemon must be."""
        self.config = config
        self.node = config.stem if config is not None else "default"  # tests name configs after the node
        self.runtime_dir = runtime_dir
        self.log_path = log_path or (config.with_suffix(".log") if config is not None else runtime_dir / "daemon.log")
        self.env = env or {}
        self._new_session = new_session
        self._tied = tied
        self.proc: subprocess.Popen | None = None
        self.messages: list[str] = []
        self._sock: socket.socket | None = None
        self._sock_dir: Path | None = None  # the notify socket's directory while it is open

    def start(self, wait_ready: bool = True, timeout: float = READY_TIMEOUT_S) -> DaemonProcess:
        self.messages = []  # a restart must earn its own READY=1
        self._close()
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvtier-notify-"))  # short path for sun_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock_path = self._sock_dir / f"n{time.monotonic_ns()}.sock"
        self._sock.bind(str(sock_path))
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(sock_path)}
        cmd = [sys.executable, "-m", "kvtier.cli", "daemon"] + (["--config", str(self.config)] if self.config else [])
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=self._new_session,
                                         preexec_fn=die_with_parent if self._tied else None)
        if wait_ready:
            self.wait_for_message("READY=1", timeout)
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
        """Block until the daemon sends `msg` (e.g. READY=1); DaemonStartError with the log's
        tail if it exits first or the deadline passes."""
        deadline = time.monotonic() + timeout
        while msg not in self.messages:
            if self.proc.poll() is not None:
                self._drain(0.01)
                if msg in self.messages:
                    return
                raise DaemonStartError(f"the daemon exited ({self.proc.returncode}) before {msg}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise DaemonStartError(f"no {msg} from the daemon within {timeout:.0f} s:\n{self.log_tail()}")
            self._drain(0.05)

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

    def stop_or_kill(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`; its exit code."""
        try:
            return self.stop(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

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
        if self._sock_dir is not None:  # no kvtier-notify-* directory outlives its daemon
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None

    def log_events(self) -> list[dict]:
        """The daemon's JSON log lines, parsed, oldest first. A line that does not parse is
        skipped: a reader may catch the last line half-written, and a SIGKILL may tear one."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        events = []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
        return events

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""
