"""The tests' Redis Cluster: kvtier.tools.redis_cluster's (real redis-server processes on free
loopback ports, never the machine's own Redis), plus what the fault tests do to it: find a key's
master, move slots under load, wait for replication."""

from __future__ import annotations

import signal
from collections.abc import Callable

import redis
from redis.crc import key_slot

from kvtier.tools.redis_cluster import ClusterNode, LocalCluster, free_port
from tests.support.waiting import wait_until

__all__ = ["ClusterNode", "RedisCluster", "free_port", "wait_replicated"]


def wait_replicated(connect: Callable[[], redis.Redis], timeout: float = 10.0) -> None:
    """Until a master's replicas have every write it took (replication is asynchronous)."""
    def caught_up() -> bool:
        with connect() as c:
            info = c.info("replication")
        offsets = [int(v["offset"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return bool(offsets) and min(offsets) >= int(info["master_repl_offset"])
    wait_until(caught_up, timeout=timeout, interval=0.02, message="the replicas caught up")


class RedisCluster(LocalCluster):
    def hang(self, node: ClusterNode, hung: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the node: it keeps its sockets but answers nothing, as a hung
        server or a dead route does."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP if hung else signal.SIGCONT)

    def owner_of(self, key: str | bytes) -> ClusterNode:
        """The running master that serves `key`'s slot now."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for n in self.masters():
            if slot in self.slots_of(n):
                return n
        raise LookupError(f"no running master serves {key!r} (slot {slot})")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        mid = master.node_id()
        for n in self.nodes:
            if n is master or not n.running:
                continue
            with n.client() as c:
                role = c.execute_command("ROLE")
                if role[0] == b"slave" and int(role[2]) == master.port:
                    return n
        raise LookupError(f"{master.addr} ({mid}) has no replica")

    def move_slots(self, slots: list[int], source: ClusterNode, target: ClusterNode,
                   midway: Callable[[], None] | None = None, batch: int = 8) -> int:
        """Move `slots` and their keys from source to target while clients keep running, as
        `redis-cli --cluster reshard` does: mark the slots IMPORTING on the target and MIGRATING
        on the source, MIGRATE their keys in batches, then SETSLOT NODE everywhere. Meanwhile
        clients get ASK for keys already moved (and for new keys), then MOVED. `midway` runs
        while every slot is half-way (keys moved, ownership not yet). Returns the keys moved."""
        sid, tid = source.node_id(), target.node_id()
        moved = 0
        with source.client() as src, target.client() as dst:
            for slot in slots:
                dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
                src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", tid)
            for slot in slots:
                while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                    src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
            if midway is not None:
                midway()
            for slot in slots:  # keys set via ASK since the loop above are on the target already
                if src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot):
                    raise RuntimeError(f"slot {slot} got keys on the source while migrating")
                dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", tid)
                src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", tid)
        for n in self.masters():
            if n not in (source, target):
                with n.client() as c:
                    for slot in slots:
                        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", tid)
        return moved

    def slots_of(self, master: ClusterNode) -> list[int]:
        with master.client() as c:
            return [slot for start, end, *holders in c.execute_command("CLUSTER", "SLOTS")
                    if int(holders[0][1]) == master.port for slot in range(start, end + 1)]

    def wait_replicated(self, master: ClusterNode, timeout: float = 10.0) -> None:
        wait_replicated(master.client, timeout)

    def client(self) -> redis.RedisCluster:
        """A sync cluster client for set-up and inspection; the caller closes it."""
        return redis.RedisCluster(host="127.0.0.1", port=self.masters()[0].port, socket_timeout=5.0)
