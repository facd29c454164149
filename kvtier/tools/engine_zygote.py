"""vLLM engines forked from one process that has imported vLLM already: the engine tests' starts.

An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) on this CPU build takes about 8 s to
start on 2 idle cores, and about 5.5 s of that is Python importing vLLM. A zygote
(engine_zygote_server.py) imports it once, in a process of its own, and forks each engine from
there: the child runs its module as `python -m` would (runpy, as __main__, with the caller's
argv, environment, working directory and standard streams, the streams passed over a unix socket
with SCM_RIGHTS). This side asks for a fork (`fork_engine`) and drives the child through
`ForkedEngine`, which answers as much of `subprocess.Popen` as kvtier/tools/vllm_engine.py's
EngineProcess uses.

Only an engine that would have started as this very interpreter, under the environment the zygote
imported vLLM in, forks (`env_as_if_imported`): another venv (the LMCache peer), or any other
variable, starts a new process, as before. The exceptions are RUNTIME_ENV: variables nothing
reads at import. An engine whose core and worker run apart (VLLM_ENABLE_V1_MULTIPROCESSING=1, or
AsyncLLM's) forks its first process only: vLLM spawns the other two afresh, each importing vLLM.
Children share what the zygote's import fixed: its `hash()` seed (kvtier's keys never use
`hash()`; vLLM draws its block-hash seed when an engine starts), numpy's global generator and
multiprocessing's authkey (the engines seed their own sampling). The zygote is found through
KVTIER_ENGINE_ZYGOTE (its socket), so a `kvtier bench --vllm` a test runs forks its engines too.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import IO

ZYGOTE_ENV = "KVTIER_ENGINE_ZYGOTE"
# Variables that may differ between the zygote and an engine it forks, as nothing reads them when
# vLLM or torch is imported: vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING when an engine starts (its
# vllm/envs.py reads each variable when asked until an engine core turns its cache on); pytest's
# change by the test; kvtier's are read by the connector, which loads in the child.
RUNTIME_ENV = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING"})
RUNTIME_ENV_PREFIXES = ("PYTEST_", "KVTIER_")
LEN = struct.Struct("<I")
PID = struct.Struct("<i")
MAX_REQUEST = 1 << 20
# What EngineProcess adds to an engine's environment, and so what the zygote imports vLLM under
# (VLLM_LOGGING_LEVEL is read at import): one definition, or every fork would be refused.
ENGINE_ENV = MappingProxyType({"VLLM_LOGGING_LEVEL": "INFO"})
READY = b"KVTIER-ZYGOTE-READY\n"
START_S = 180.0  # importing vLLM on 2 busy cores
STATUS_S = 5.0  # how long a child's exit status may trail its end


def import_env(env: dict[str, str]) -> dict[str, str]:
    """What of `env` an import may read: all of it but RUNTIME_ENV."""
    return {k: v for k, v in env.items() if k not in RUNTIME_ENV and not k.startswith(RUNTIME_ENV_PREFIXES)}


def env_as_if_imported(want: dict[str, str], before: dict[str, str], after: dict[str, str]) -> dict[str, str] | None:
    """The environment a process started with `want` would have once it imported what the zygote
    did, given the zygote's import environment before and after its import (which sets a few:
    TORCHINDUCTOR_CACHE_DIR, PYTORCH_NVML_BASED_CUDA_CHECK, LD_LIBRARY_PATH through cv2...);
    None where `want` differs from the zygote's anywhere an import may read, so the engine
    must start afresh. A caller that imported vLLM itself passes on what its import set: that
    counts as the zygote's."""
    mine, theirs = import_env(want), set(before) | set(after)
    if set(mine) - theirs:
        return None
    env = dict(want)
    for k in theirs:
        if mine.get(k) == before.get(k):
            if k in after:
                env[k] = after[k]  # set by the import, as a fresh process's own import would
            else:
                env.pop(k, None)
        elif mine.get(k) != after.get(k):
            return None
    return env


def recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("zygote connection closed mid-message")
        buf += part
    return buf


class ForkedEngine:
    """A forked engine, as EngineProcess drives a Popen: `stdin`, `stdout`, `poll`, `wait`, `kill`.
    Its end is seen on a pidfd, its exit status comes from the zygote over `conn` (-1 where the
    zygote went first: unknown), and `kill` signals through the pidfd, so a pid reused after the
    engine is gone is never hit."""

    def __init__(self, conn: socket.socket, pid: int, pidfd: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.conn: socket.socket | None = conn
        self.pid, self._pidfd = pid, pidfd
        self.stdin, self.stdout = stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0.0, raising=False)

    def wait(self, timeout: float | None = None, raising: bool = True) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select([self._pidfd, *([self.conn] if self.conn else [])], [], [], left)[0]
            if self.conn is not None and self.conn in ready:
                self._status()
            elif self._pidfd in ready:  # ended: its status follows from the zygote, if it is there
                if self.conn is not None and select.select([self.conn], [], [], STATUS_S)[0]:
                    self._status()
                if self.returncode is None:
                    self._done(-1)
            elif not ready:
                if raising:
                    raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout or 0.0)
                return None
        return self.returncode

    def _status(self) -> None:
        assert self.conn is not None
        try:
            self._done(PID.unpack(recv_exact(self.conn, PID.size))[0])
        except OSError:  # the zygote went (ConnectionError among them): the pidfd alone says when the engine ends
            self.conn.close()
            self.conn = None

    def _done(self, code: int) -> None:
        self.returncode = code
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        os.close(self._pidfd)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_engine(cmd: list[str], env: dict[str, str], stderr: IO[bytes]) -> ForkedEngine | None:
    """`cmd` (python -m MODULE ARGS...) forked from the zygote KVTIER_ENGINE_ZYGOTE names, with
    pipes for stdin and stdout and `stderr` as its stderr; None where it must start afresh (no
    zygote, another interpreter or environment, the zygote unreachable or failing)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path or len(cmd) < 3 or cmd[1] != "-m":
        return None
    with ExitStack() as undo:  # everything opened here is closed unless an engine is handed back
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            undo.callback(conn.close)
            conn.settimeout(30.0)
            conn.connect(path)
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            for fd in (in_r, in_w, out_r, out_w):
                undo.callback(os.close, fd)
            msg = json.dumps({"python": cmd[0], "module": cmd[2], "argv": cmd[3:], "env": env,
                              "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [LEN.pack(len(msg)) + msg], [in_r, out_w, stderr.fileno()])
            pid = PID.unpack(recv_exact(conn, PID.size))[0]
            if pid <= 0:  # refused: not this interpreter or environment
                return None
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
            if len(fds) != 1:
                raise ConnectionError("the zygote sent no pidfd")
        except OSError:  # ConnectionError among them
            return None  # a forked child, if any, reads EOF on its stdin and ends
        conn.settimeout(None)
        undo.pop_all()
    for fd in (in_r, out_w):  # the child's ends
        os.close(fd)
    return ForkedEngine(conn, pid, fds[0], os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"))


class EngineZygote:
    """The zygote process (engine_zygote_server.py) in this interpreter and environment, alive
    while its stdin is open."""

    def __init__(self, workdir: Path, log: IO[bytes]) -> None:
        self.socket = str(workdir / "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.tools.engine_zygote_server", self.socket],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     env={**os.environ, **ENGINE_ENV})
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_S)
        if not ready or self.proc.stdout.readline() != READY:
            self.close()
            raise RuntimeError(f"the engine zygote did not start within {START_S:.0f} s")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # it exits; engines it forked run on until their own stdin closes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def engine_zygote(log_path: Path) -> Iterator[EngineZygote]:
    """A zygote for the block, named in KVTIER_ENGINE_ZYGOTE meanwhile (for subprocesses too)."""
    with open(log_path, "ab") as log, tempfile.TemporaryDirectory(prefix="kvtier-zygote-") as d:
        z = EngineZygote(Path(d), log)
        old = os.environ.get(ZYGOTE_ENV)
        os.environ[ZYGOTE_ENV] = z.socket
        try:
            yield z
        finally:
            if old is None:
                os.environ.pop(ZYGOTE_ENV, None)
            else:
                os.environ[ZYGOTE_ENV] = old
            z.close()
