"""Batches of single-key commands (the SETs, GETs and EXISTSes of block values) on one Redis or
across a Redis Cluster's masters. Every command gets its own outcome, the reply or the error it
met; `run` never raises a Redis error.

One server: one pipeline, and a connection-level failure is every command's error.

A cluster: commands are grouped by the master that serves each key's slot (the client's slot
map), and each group is one pipeline; the groups are sent at once. A master that is down or hung
fails only its own group: redis-py would fail the whole pipeline, after retries that close every
connection of the client. After such a failure the slot map is reloaded (at most every
RELOAD_INTERVAL_S), and what failed goes once more if its slot now has another master (a
failover to a replica), so service resumes without a restart. Redirects are followed here:
MOVED patches the slot map and the command goes again; ASK (a slot half-way through a reshard)
sends ASKING and the command on one connection to the importing node, pipelined.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import (
    AskError,
    MovedError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import OUTAGE_ERRORS, REDIS_ERRORS

RELOAD_INTERVAL_S = 0.5
MAX_REDIRECTS = 5  # rounds of MOVED/ASK/TRYAGAIN per batch before the redirect is the outcome
Command: TypeAlias = tuple[Any, ...]  # ("GET", name), ("SET", name, value, "EX", ttl), ...
Outcome: TypeAlias = Any  # a reply, or the exception the command met


class KeyBatches(Protocol):
    redirects: int  # commands a cluster redirected (MOVED, ASK, TRYAGAIN)
    reloads: int  # slot-map reloads after a master failed a batch

    async def run(self, commands: Sequence[Command]) -> list[Outcome]: ...


def batches_for(client: AsyncRedis) -> KeyBatches:
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        return ClusterBatches(client)
    return ServerBatches(client)


class ServerBatches:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.redirects = 0
        self.reloads = 0

    async def run(self, commands: Sequence[Command]) -> list[Outcome]:
        if not commands:
            return []
        pipe = self.client.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        try:
            return list(await pipe.execute(raise_on_error=False))
        except REDIS_ERRORS as e:
            return [e] * len(commands)


class ClusterBatches:
    def __init__(self, client: redis.asyncio.cluster.RedisCluster) -> None:
        self.client = client
        self.reloads = 0  # slot-map reloads after a failed group
        self.redirects = 0  # commands that met MOVED or ASK
        self._next_reload = 0.0
        self._reloading: asyncio.Lock | None = None  # made in the loop that first needs it

    async def run(self, commands: Sequence[Command]) -> list[Outcome]:
        if not commands:
            return []
        out: list[Outcome] = [None] * len(commands)
        try:
            await self.client.initialize()  # a no-op once the slot map is loaded
        except REDIS_ERRORS as e:  # no node reachable
            return [e] * len(commands)
        failed = await self._round(commands, list(range(len(commands))), out)
        if failed:
            await self._reload()
            # A failover hands a failed master's slots to its replica: what failed there goes
            # once more, to the new owner, rather than waiting for the next batch to find it.
            moved = [i for i, sent_to in failed.items() if self._owner(commands[i]) not in (None, sent_to)]
            if moved:
                await self._round(commands, moved, out)
        return out

    def _owner(self, command: Command) -> str | None:
        try:
            node = self.client.get_node_from_key(command[1])
        except RedisClusterException:  # SlotNotCoveredError: no master serves it now
            return None
        return None if node is None else node.name

    async def _round(self, commands: Sequence[Command], todo: list[int], out: list[Outcome]) -> dict[int, str]:
        """Send `todo`, following redirects, outcomes into `out`. Returns the commands that met an
        outage, each with the master it was sent to."""
        failed: dict[int, str] = {}
        for _ in range(MAX_REDIRECTS):
            asks: dict[tuple[str, int], list[int]] = {}
            again: list[int] = []
            for i, sent_to in await self._send(commands, todo, out):
                r = out[i]
                if isinstance(r, OUTAGE_ERRORS) and sent_to is not None:
                    failed[i] = sent_to
                elif isinstance(r, MovedError):  # the slot has moved for good: patch the map, send again
                    await self.client.nodes_manager.move_slot(r)
                    again.append(i)
                elif isinstance(r, AskError):  # half-migrated: this key is on the importing node
                    asks.setdefault((r.host, r.port), []).append(i)
                elif isinstance(r, TryAgainError):
                    again.append(i)
            self.redirects += len(again) + sum(map(len, asks.values()))
            for (host, port), idx in asks.items():
                again += await self._asking(host, port, commands, idx, out)
            if not again:
                break
            todo = again
        return failed

    async def _send(self, commands: Sequence[Command], todo: list[int],
                    out: list[Outcome]) -> list[tuple[int, str | None]]:
        """Each command in `todo` to the master its slot map names, one pipeline per master, all at
        once; outcomes go to `out`. Per command, the master it went to (None: no master serves
        its slot now)."""
        groups: dict[str, list[int]] = {}
        sent: list[tuple[int, str | None]] = []
        for i in todo:
            owner = self._owner(commands[i])
            if owner is None:
                out[i] = SlotNotCoveredError(f"no master serves the slot of {commands[i][1]!r}")
                sent.append((i, None))
                continue
            groups.setdefault(owner, []).append(i)
        await asyncio.gather(*(self._group(commands, idx, out) for idx in groups.values()))
        return sent + [(i, name) for name, idx in groups.items() for i in idx]

    async def _group(self, commands: Sequence[Command], idx: list[int], out: list[Outcome]) -> None:
        """One master's share. Redirects are left as outcomes
        (`allow_redirections=False`): redis-py's own ASK handling sends ASKING and the command on
        different connections (scripts/repro/cluster_ask_asking.py)."""
        pipe = self.client.pipeline(transaction=False)
        for i in idx:
            pipe.execute_command(*commands[i])
        try:
            replies = await pipe.execute(raise_on_error=False, allow_redirections=False)
        except REDIS_ERRORS as e:
            replies = [e] * len(idx)
        for i, r in zip(idx, replies):
            out[i] = r

    async def _asking(self, host: str, port: int, commands: Sequence[Command], idx: list[int],
                      out: list[Outcome]) -> list[int]:
        """ASKING then the command, for each command, pipelined on one connection to the importing
        node (ASKING holds for the next command on its connection only). Returns the commands
        redirected again (the migration finished meanwhile: MOVED)."""
        node = self.client.get_node(host=host, port=port)
        temporary = node is None  # an importing node that serves no slot yet (scale-out)
        if node is None:
            node = redis.asyncio.cluster.ClusterNode(host, port, **self.client.nodes_manager.connection_kwargs)
        conn = node.acquire_connection()
        try:
            await conn.send_packed_command(conn.pack_commands(
                [part for i in idx for part in (("ASKING",), commands[i])]))
            for i in idx:
                await conn.read_response()  # +OK
                try:
                    out[i] = await node.parse_response(conn, commands[i][0])
                except ResponseError as e:
                    out[i] = e
        except REDIS_ERRORS as e:
            await conn.disconnect()  # replies may be left unread on it
            for i in idx:
                out[i] = e
        finally:
            node.release(conn)
            if temporary:
                await node.disconnect()
        return [i for i in idx if isinstance(out[i], AskError | TryAgainError)]

    async def _reload(self) -> None:
        """Reload the slot map (a failover moves slots to a replica), at most every RELOAD_INTERVAL_S."""
        if self._reloading is None:
            self._reloading = asyncio.Lock()
        async with self._reloading:
            if time.monotonic() < self._next_reload:
                return
            self._next_reload = time.monotonic() + RELOAD_INTERVAL_S
            self.reloads += 1
            try:
                await self.client.nodes_manager.initialize()
            except REDIS_ERRORS:
                pass  # nothing reachable: the next batch's groups fail and ask again
