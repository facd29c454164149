"""The engine zygote's own side: `python -m kvtier.tools.engine_zygote_server SOCKET`.

It imports vLLM, listens on SOCKET (a 0600 unix socket in a 0700 directory; a peer of another
uid is refused too), and forks an engine per request (kvtier/tools/engine_zygote.py has the
caller's side and the rules), until its stdin closes. Per request it sends back the child's pid
and a pidfd, and, when the child ends, its exit status. After vLLM's import the process holds two
native threads besides its own (torch's and vLLM's, idle); a child that hung on what one of
them held would fail its engine's start deadline, never pass a test.
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
import sys
import threading
import traceback

from kvtier.tools.engine_zygote import LEN, MAX_REQUEST, PID, READY, env_as_if_imported, import_env, recv_exact

_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def _child(req: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: the caller's streams, environment and directory, then the module as
    __main__, then what an interpreter does as it exits (joins its threads, runs the exit
    handlers: vLLM's, logging's). Never returns."""
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
        sys.path[0] = req["cwd"]  # as `python -m` started there puts it
        random.seed()
        sys.argv = [req["module"], *req["argv"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: its JSON (python, module, argv, env, cwd) and the three fds sent with it."""
    head, fds, _, _ = socket.recv_fds(conn, LEN.size, 3)
    try:
        head += recv_exact(conn, LEN.size - len(head))
        n = LEN.unpack(head)[0]
        if n > MAX_REQUEST:
            raise ValueError(f"a request of {n} bytes")
        req = json.loads(recv_exact(conn, n))
        if not (isinstance(req, dict) and isinstance(req.get("env"), dict) and isinstance(req.get("argv"), list)
                and all(isinstance(req.get(k), str) for k in ("python", "module", "cwd"))
                and all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items())
                and all(isinstance(a, str) for a in req["argv"]) and len(fds) == 3):
            raise ValueError("not a fork request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return req, fds


def serve(path: str) -> None:
    """Import vLLM, listen on `path`, fork an engine per request; exit when stdin closes."""
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
                    conn.sendall(PID.pack(os.waitstatus_to_exitcode(status)))
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
        try:
            if _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1] != os.getuid():
                raise PermissionError("a peer of another uid")
            req, fds = _request(conn)
            try:
                env = env_as_if_imported(req["env"], before, after)
                if req["python"] != sys.executable or env is None:
                    conn.sendall(PID.pack(0))  # refused: the caller starts the engine afresh
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # SIGCHLD is held from before the fork until the pid is sent and the child
                # registered, so its exit status can only follow them (a handler pending from an
                # earlier child runs when the mask is set, before the fork).
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
                try:
                    pid = os.fork()
                    if pid == 0:
                        _child({**req, "env": env}, fds, [listener, conn, *children.values()])
                    pidfd = os.pidfd_open(pid)
                    try:
                        conn.sendall(PID.pack(pid))
                        socket.send_fds(conn, [b"p"], [pidfd])
                    finally:
                        os.close(pidfd)
                    conn.settimeout(None)
                    children[pid] = conn
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            finally:
                for fd in fds:
                    os.close(fd)
        except Exception as e:  # one bad request never takes the zygote, and the engines it forked, down
            print(f"zygote: request refused: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
