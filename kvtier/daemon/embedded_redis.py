"""The embedded default: a private redis-server on a unix socket in the runtime directory.

Used when no Redis URL is configured (single machine, development, the demo). It keeps nothing on
disk, and PR_SET_PDEATHSIG ties it to the daemon, so a SIGKILLed daemon leaves no orphan behind.
Streams and blocks share it, so its eviction policy must be volatile-* (blocks carry a TTL and the
streams do not): allkeys-* would evict the streams and their consumer groups.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from kvtier.config import EmbeddedRedisConfig
from kvtier.errors import KvtierError
from kvtier.processes import die_with_parent


class EmbeddedRedis:
    def __init__(self, cfg: EmbeddedRedisConfig, runtime_dir: Path, log) -> None:
        self.cfg = cfg
        self.socket_path = runtime_dir / "redis.sock"
        self.runtime_dir = runtime_dir
        self.log = log.bind(component="embedded_redis")
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    async def start(self, timeout_s: float = 10.0) -> str:
        binary = shutil.which(self.cfg.binary)
        if binary is None:
            raise KvtierError(
                f"{self.cfg.binary!r} not found on PATH; install it (Debian/Ubuntu: apt-get install "
                "redis-server) or set [redis] url to an existing server"
            )
        self.socket_path.unlink(missing_ok=True)  # a leftover from a crashed run
        args = [
            binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "770",
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.runtime_dir),
            "--maxmemory", self.cfg.maxmemory, "--maxmemory-policy", self.cfg.maxmemory_policy,
            "--logfile", str(self.runtime_dir / "redis.log"), "--protected-mode", "yes",
        ]
        self.proc = await asyncio.create_subprocess_exec(
            *args, stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.socket_path.exists():
            if self.proc.returncode is not None:
                log = self.runtime_dir / "redis.log"
                raise KvtierError(f"embedded redis-server exited with {self.proc.returncode}; see {log}")
            if loop.time() > deadline:
                await self.stop()
                raise KvtierError("embedded redis-server did not open its socket in time")
            await asyncio.sleep(0.01)
        self.log.info("embedded_redis.started", pid=self.proc.pid, socket=str(self.socket_path))
        return self.url

    async def wait(self) -> int:
        """Returns when the server exits; the daemon treats that as fatal."""
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self.socket_path.unlink(missing_ok=True)
        self.log.info("embedded_redis.stopped")
