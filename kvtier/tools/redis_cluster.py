"""A throwaway Redis Cluster on free loopback ports, for `kvtier bench --cluster` and the tests:
real redis-server processes joined by `redis-cli --cluster create` (a lone master takes every slot
itself: redis-cli wants three).

`cluster-require-full-coverage no`, so the other masters keep serving while one is down (as
docs/operations.md tells operators to set it), and a short `cluster-node-timeout`, so failures
and failovers are noticed within a second or two. No persistence: a master killed and started
again comes back empty (its nodes.conf keeps its id and slots), as a cache-only Redis does.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.processes import die_with_parent, stop_processes

NODE_TIMEOUT_MS = 1000
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
FORM_TIMEOUT_S = 30.0
SLOTS = 16384


PORT_TRIES = 3


class PortTaken(RuntimeError):
    """A redis-server could not listen: its port was taken after `free_port` chose it."""


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: the one the kernel picks is
    where outgoing connections take theirs too, and in a busy test run one took such a port
    before the server it was for could listen on it. The kernel's own pick if none is found."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def wait_for(cond: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class ClusterNode:
    """One redis-server of the cluster: its client port and cluster-bus port are both free ones."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = free_port()
        self.bus_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, its ports are the node's for good

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start, or start again: the same node id and slots (nodes.conf), with no data. A first
        start whose port another process took since `free_port` found it free (the tests start
        many servers side by side) tries again on new ports; a start again keeps its ports, which
        the other nodes know."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(PORT_TRIES):
            args = [
                exe, "--bind", "127.0.0.1", "--port", str(self.port), "--cluster-port", str(self.bus_port),
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir),
            ]  # fmt: skip
            with open(self.dir / "redis.log", "ab") as log:
                log_from = log.tell()  # what this attempt writes, for `_ready`
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             preexec_fn=die_with_parent)
            try:
                wait_for(partial(self._ready, log_from), f"PING on {self.addr}", START_TIMEOUT_S)
            except PortTaken:
                if self._started or attempt == PORT_TRIES - 1:
                    raise
                self.port, self.bus_port = free_port(), free_port()
                (self.dir / "nodes.conf").unlink(missing_ok=True)  # a new node, on its new ports
                continue
            self._started = True
            return

    def _ready(self, log_from: int) -> bool:
        if not self.running:
            with open(self.dir / "redis.log", "rb") as f:
                f.seek(log_from)
                tail = f.read().decode(errors="replace")[-2000:]
            taken = "Address already in use" in tail
            raise (PortTaken if taken else RuntimeError)(f"redis-server exited early:\n{tail}")
        try:  # one try a poll: redis-py's own retries would wait seconds on a port not served yet
            with self.client(timeout=0.5, retry=False) as c:
                return bool(c.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def client(self, timeout: float = 5.0, retry: bool = True) -> redis.Redis:
        """A plain client of this one node (no redirects followed); the caller closes it.
        `retry` False: one try a command, not redis-py's own retries."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout,
                           **({} if retry else {"retry": Retry(NoBackoff(), 0)}))

    def node_id(self) -> str:
        with self.client() as c:
            return str(c.execute_command("CLUSTER", "MYID").decode())

    def role(self) -> str:
        with self.client() as c:
            return str(c.execute_command("ROLE")[0].decode())

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            stop_processes([self.proc], STOP_TIMEOUT_S, signal.SIGKILL if kill else signal.SIGTERM)
        self.proc = None


class LocalCluster:
    """`masters` masters (slots split evenly by redis-cli), each with `replicas` replicas."""

    def __init__(self, directory: Path, masters: int, replicas: int = 0) -> None:
        if masters < 1 or (masters < 3 and (masters, replicas) != (1, 0)):
            raise ValueError("a cluster of 3 or more masters, or a lone master without replicas")
        self.dir = directory
        self.nodes = [ClusterNode(directory / f"node{i}") for i in range(masters * (1 + replicas))]
        self.masters_count = masters
        self.replicas = replicas

    @property
    def url(self) -> str:
        """kvtier's cluster URL, every node a seed."""
        return "redis+cluster://" + ",".join(n.addr for n in self.nodes)

    @classmethod
    @contextmanager
    def serving(cls, tmp_dir: Path | str, masters: int = 3, replicas: int = 0) -> Iterator:
        cluster = cls(Path(tempfile.mkdtemp(prefix="kvtier-cluster-", dir=tmp_dir)), masters, replicas)
        try:
            cluster.create()
            yield cluster
        finally:
            cluster.close()

    def create(self) -> None:
        for n in self.nodes:
            n.start()
        if self.masters_count == 1:
            with self.nodes[0].client() as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1)
        else:
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli not found on PATH (apt-get install redis-tools)")
            out = subprocess.run(
                [cli, "--cluster", "create", *(n.addr for n in self.nodes), "--cluster-replicas",
                 str(self.replicas), "--cluster-yes"],
                capture_output=True, timeout=FORM_TIMEOUT_S, text=True)  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        wait_for(self.healthy, "cluster_state:ok on every node", FORM_TIMEOUT_S)

    def healthy(self) -> bool:
        """Every running node says cluster_state:ok, knows every other running node, and maps
        every slot to the same masters as the others. (With cluster-require-full-coverage off a
        node says ok while slots it has not heard of yet are unmapped: a client that starts from
        its map then misses a master.)"""
        maps = set()
        for n in self.nodes:
            if not n.running:
                continue
            with n.client() as c:
                info = c.execute_command("CLUSTER", "INFO").decode()
                ranges = c.execute_command("CLUSTER", "SLOTS")
            if "cluster_state:ok" not in info:
                return False
            if int(info.split("cluster_known_nodes:")[1].split()[0]) < sum(m.running for m in self.nodes):
                return False
            if sum(int(r[1]) - int(r[0]) + 1 for r in ranges) != SLOTS:
                return False
            maps.add(frozenset((int(r[0]), int(r[1]), int(r[2][1])) for r in ranges))  # (first, last, master's port)
        return len(maps) <= 1

    def masters(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.running and n.role() == "master"]

    def close(self) -> None:
        for n in self.nodes:
            n.stop(kill=True)
