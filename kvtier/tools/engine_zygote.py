"""vLLM engines forked from one process that has imported vLLM already: the engine tests' starts.

An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) on this CPU build takes about 8 s to
start on 2 idle cores, and about 5.5 s of that is Python importing vLLM. `EngineZygote` imports it
once, in a process of its own, and forks each engine from there. The child runs its module as
`python -m` would (runpy, as __main__, with the caller's argv, environment, working directory and
standard streams, the streams passed over a unix socket with SCM_RIGHTS), so an engine behaves as
one started afresh. The caller drives it through `ForkedEngine`, which answers as much of
`subprocess.Popen` as kvtier/tools/vllm_engine.py's EngineProcess uses; the zygote reports each
child's exit status.

`fork_engine` forks only an engine that would have started as this very interpreter under the
variables vLLM and torch read at import (IMPORT_ENV_PREFIXES) as the zygote had them; another venv
(the LMCache peer), or other import-time values, start a new process, as before. An engine whose
core and worker run apart (VLLM_ENABLE_V1_MULTIPROCESSING=1, or AsyncLLM's) forks its first process
only: vLLM spawns the other two afresh, each importing vLLM. Children share the zygote's `hash()`
seed (PYTHONHASHSEED): kvtier's keys never use `hash()`, and the connector's scheduler and worker
halves that run apart still do so in spawned processes. The zygote is found through
KVTIER_ENGINE_ZYGOTE (its socket), so a `kvtier bench --vllm` a test runs forks its engines too.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

ZYGOTE_ENV = "KVTIER_ENGINE_ZYGOTE"
# Variables read when vLLM, torch or transformers are imported (and so frozen into the zygote):
# an engine asking for other values than the zygote's starts afresh.
IMPORT_ENV_PREFIXES = ("VLLM_", "TORCH", "OMP_", "MKL_", "KMP_", "CUDA", "HF_", "TRANSFORMERS", "TOKENIZERS",
                       "PYTHON", "LD_")
_LEN = struct.Struct("<I")
_PID = struct.Struct("<i")
READY = b"KVTIER-ZYGOTE-READY\n"
START_S = 180.0  # importing vLLM on 2 busy cores


# ... but for these, which vLLM reads only when an engine starts (vllm/envs.py reads each variable
# when asked until an engine core turns its cache on): an engine whose core and worker run apart
# forks as well, and vLLM spawns those two processes afresh.
RUNTIME_ENV = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING"})


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` an import reads (see IMPORT_ENV_PREFIXES, RUNTIME_ENV)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES) and k not in RUNTIME_ENV}


def env_as_if_imported(want: dict[str, str], before: dict[str, str], after: dict[str, str]) -> dict[str, str] | None:
    """The environment a process started with `want` would have once it imported what the zygote
    did, given the zygote's import environment before and after (the import sets a few, such as
    TORCHINDUCTOR_CACHE_DIR and LD_LIBRARY_PATH); None where `want` differs from the zygote's
    where an import reads it, so the engine must start afresh. A caller that imported vLLM
    itself passes on what its import set: that counts as the zygote's."""
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


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise ConnectionError("zygote connection closed mid-message")
        buf += part
    return buf


class ForkedEngine:
    """A forked engine, as EngineProcess drives a Popen: `stdin`, `stdout`, `poll`, `wait`, `kill`.
    Its exit status comes from the zygote over `conn`; `kill` signals it through a pidfd, so a
    pid reused after it exits is never hit."""

    def __init__(self, conn: socket.socket, pid: int, pidfd: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.conn, self.pid, self._pidfd = conn, pid, pidfd
        self.stdin, self.stdout = stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0.0, raising=False)

    def wait(self, timeout: float | None = None, raising: bool = True) -> int | None:
        if self.returncode is None:
            if not select.select([self.conn], [], [], timeout)[0]:
                if raising:
                    raise subprocess.TimeoutExpired(f"forked engine {self.pid}", timeout or 0.0)
                return None
            try:
                self.returncode = _PID.unpack(_recv_exact(self.conn, _PID.size))[0]
            except (ConnectionError, OSError):
                self.returncode = -1  # the zygote went first: the status is lost, the engine with it
            self.conn.close()
            os.close(self._pidfd)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_engine(cmd: list[str], env: dict[str, str], stderr: IO[bytes]) -> ForkedEngine | None:
    """`cmd` (python -m MODULE ARGS...) forked from the zygote KVTIER_ENGINE_ZYGOTE names, with
    pipes for stdin and stdout and `stderr` as its stderr; None where it must start afresh
    (no zygote, another interpreter or import environment, or the zygote unreachable)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path or len(cmd) < 3 or cmd[1] != "-m":
        return None
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError:
        return None
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        msg = json.dumps({"python": cmd[0], "module": cmd[2], "argv": cmd[3:], "env": env,
                          "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [_LEN.pack(len(msg)) + msg], [in_r, out_w, stderr.fileno()])
        pid = _PID.unpack(_recv_exact(conn, _PID.size))[0]
        if pid <= 0:  # refused: not this interpreter or import environment
            conn.close()
            return None
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        if len(fds) != 1:
            raise ConnectionError("zygote sent no pidfd")
    except BaseException:
        conn.close()
        for fd in (in_w, out_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w):
            os.close(fd)
    return ForkedEngine(conn, pid, fds[0], os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"))


class EngineZygote:
    """The zygote process: `python -m kvtier.tools.engine_zygote SOCKET`, this interpreter and
    environment, alive while its stdin is open."""

    def __init__(self, workdir: Path, log: IO[bytes]) -> None:
        self.socket = str(workdir / "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.tools.engine_zygote", self.socket],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"})
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


# --- the zygote's side --------------------------------------------------------------------------


def _child(req: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: the caller's streams, environment and directory, then the module as
    __main__, then the exit handlers a process runs (vLLM's, logging's). Never returns."""
    code = 1
    try:
        for s in inherited:  # the zygote's listener and its other children's connections
            s.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the engine waits for its own children
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for fd, target in zip(fds, (0, 1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # fresh objects over the new descriptors
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        random.seed()  # not the zygote's sequence
        sys.argv = [req["module"], *req["argv"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    """Import vLLM, listen on `path` (0600), fork an engine per request; exit when stdin closes."""
    ready_out = os.fdopen(os.dup(1), "wb")  # READY alone on stdout: what vLLM logs goes to stderr
    os.dup2(2, 1)
    before = import_env(dict(os.environ))  # the import sets some of its own: `after`
    from vllm import LLM, SamplingParams  # noqa: F401  (the point: imported once, here)
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401  (the stream engine's)

    after = import_env(dict(os.environ))

    children: dict[int, socket.socket] = {}

    def reap(*_: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_PID.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()

    signal.signal(signal.SIGCHLD, reap)
    old = os.umask(0o177)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.umask(old)
    listener.listen(16)
    ready_out.write(READY)
    ready_out.close()
    while True:
        ready, _, _ = select.select([listener, sys.stdin.fileno()], [], [])
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the caller closed stdin, or died
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        conn.settimeout(30.0)  # a caller that connects and says nothing does not hold the zygote
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
            head += _recv_exact(conn, _LEN.size - len(head))
            req = json.loads(_recv_exact(conn, _LEN.unpack(head)[0]))
            env = env_as_if_imported(req["env"], before, after)
            if len(fds) != 3 or req["python"] != sys.executable or env is None:
                conn.sendall(_PID.pack(0))
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # SIGCHLD waits until the child is registered and its pid sent: the status comes after.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
            try:
                pid = os.fork()
                if pid == 0:
                    _child({**req, "env": env}, fds, [listener, conn, *children.values()])
                pidfd = os.pidfd_open(pid)
                try:
                    conn.sendall(_PID.pack(pid))
                    socket.send_fds(conn, [b"p"], [pidfd])
                finally:
                    os.close(pidfd)
                children[pid] = conn
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        except (OSError, ValueError, KeyError, ConnectionError) as e:
            print(f"zygote: request refused: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1])
