"""Batches of single-key block commands across a Redis Cluster's masters.

Commands are grouped by the master that serves each key's slot (the client's slot map), and
each group is one pipeline; the groups are sent at once. A master that is down or hung fails
only its own group: redis-py would fail the whole pipeline, after retries that close every
connection of the client. A master that failed is left alone for a while and its commands get
its error at once (store/master_health.py), so a hung one does not hold up every batch.

After an outage, or a key whose slot no master serves, the slot map is reloaded (paced by
master_health.ReloadPacing), and what failed goes once more if its slot now has another master
(a failover to a replica), so service resumes without a restart.

Redirects are followed here rather than by redis-py: MOVED patches the slot map and the command
goes again; ASK (a slot half-way through a reshard) sends ASKING and the command on one
connection of the importing node, pipelined. redis-py's asyncio client sends the two on
different pooled connections and loops until `TTL exhausted` (scripts/repro/cluster_ask_asking.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from typing import TypeAlias

import redis.asyncio.cluster
from redis.exceptions import AskError, MovedError, RedisClusterException, SlotNotCoveredError, TryAgainError

from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.store.bulk_reads import BulkPool, Endpoint, land
from kvtier.store.commands import Command, Outcome, bounded_gather, key_of, pipelines, run_part
from kvtier.store.master_health import MasterHealth, ReloadPacing
from kvtier.store.ops import Op

BULK_CONNECTIONS = 8  # bulk-read connections kept per master
MAX_REDIRECTS = 5  # rounds of MOVED/ASK/TRYAGAIN per batch before the redirect is the outcome
UNCOVERED = ""  # in a round's failures: the command's slot had no master
Shape: TypeAlias = tuple[int | None, int]  # a batch's pipelines: commands per pipeline, how many at once


class ClusterBatches:
    def __init__(self, client: redis.asyncio.cluster.RedisCluster) -> None:
        self.client = client
        self.redirects = 0
        self.reloads = 0
        self.skipped = 0
        self._health = MasterHealth()
        self._pacing = ReloadPacing()
        self._reloading: asyncio.Lock | None = None  # made in the loop that first needs it
        self._bulk: dict[str, BulkPool] = {}  # per master

    async def run(self, commands: Sequence[Command], *, per_pipeline: int | None = None,
                  width: int = 1) -> list[Outcome]:
        if not commands:
            return []
        shape = (per_pipeline, width)
        out: list[Outcome] = [None] * len(commands)
        try:
            await self.client.initialize()  # a no-op once the slot map is loaded
        except REDIS_ERRORS as e:  # no node reachable
            return [e] * len(commands)
        failed = await self._round(commands, list(range(len(commands))), out, shape)
        if not failed:
            self._pacing.settled()
            return out
        await self._reload()
        # A failover hands a failed master's slots to its replica: what failed there goes once
        # more, to the new owner, rather than waiting for the next batch to find it.
        now = time.monotonic()
        again = [i for i, sent_to in failed.items()
                 if (owner := self._owner(commands[i])) not in (None, sent_to) and not self._health.down(owner, now)]
        if again:
            await self._round(commands, again, out, shape)
        return out

    def _owner(self, command: Command) -> str | None:
        try:
            node = self.client.get_node_from_key(key_of(command))
        except RedisClusterException:  # SlotNotCoveredError: no master serves it now
            return None
        return None if node is None else node.name

    async def _round(self, commands: Sequence[Command], todo: list[int], out: list[Outcome],
                     shape: Shape) -> dict[int, str]:
        """Send `todo`, following redirects, outcomes into `out`. Returns the commands that met an
        outage (or no master), each with the master it was meant for (UNCOVERED: none)."""
        failed: dict[int, str] = {}
        for _ in range(MAX_REDIRECTS):
            asks: dict[tuple[str, int], list[int]] = {}
            again: list[int] = []
            for i, sent_to in await self._send(commands, todo, out, shape):
                r = out[i]
                if isinstance(r, MovedError):  # the slot has moved for good: patch the map, send again
                    await self._moved(r)
                    again.append(i)
                elif isinstance(r, AskError):  # half-migrated: this key is on the importing node
                    asks.setdefault((r.host, r.port), []).append(i)
                elif isinstance(r, TryAgainError):
                    again.append(i)
                elif isinstance(r, SlotNotCoveredError) or is_outage(r):
                    failed[i] = sent_to
            self.redirects += len(again) + sum(map(len, asks.values()))
            for (host, port), idx in asks.items():
                again += await self._asking(host, port, commands, idx, out, failed)
            if not again:
                break
            todo = again
        return failed

    async def _send(self, commands: Sequence[Command], todo: list[int], out: list[Outcome],
                    shape: Shape) -> list[tuple[int, str]]:
        """Each command in `todo` to the master its slot map names, one pipeline per master, all at
        once; outcomes go to `out`. Per command, the master it was meant for."""
        now = time.monotonic()
        groups: dict[str, list[int]] = {}
        sent: list[tuple[int, str]] = []
        for i in todo:
            owner = self._owner(commands[i])
            if owner is None:
                out[i] = SlotNotCoveredError(f"no master serves the slot of {key_of(commands[i])!r}")
                sent.append((i, UNCOVERED))
            elif (error := self._health.down(owner, now)) is not None:
                out[i] = error  # left alone for now: its last error, at once
                self.skipped += 1
                sent.append((i, owner))
            else:
                groups.setdefault(owner, []).append(i)
        await asyncio.gather(*(self._master(name, commands, idx, out, shape) for name, idx in groups.items()))
        return sent + [(i, name) for name, idx in groups.items() for i in idx]

    async def _master(self, name: str, commands: Sequence[Command], idx: list[int], out: list[Outcome],
                      shape: Shape) -> None:
        """One master's share, in pipelines of the batch's shape; then judge the master by it."""
        per_pipeline, width = shape
        bulk = self._bulk_pool(name)
        pipe = functools.partial(self.client.pipeline, transaction=False)
        # Redirects are left as outcomes (`allow_redirections=False`): followed in _round.
        await bounded_gather(width, [run_part(pipe, {"allow_redirections": False}, bulk, commands, part, out)
                                     for part in pipelines(idx, per_pipeline)])
        self._judge(name, [out[i] for i in idx])

    def _bulk_pool(self, name: str) -> BulkPool | None:
        """The bulk-read connections to this master (store/bulk_reads.py), made on first use."""
        pool = self._bulk.get(name)
        if pool is None:
            node = self.client.get_node(node_name=name)
            if node is None:
                return None

            async def endpoint(node: redis.asyncio.cluster.ClusterNode = node) -> Endpoint:
                return Endpoint.of(node.connection_class(**node.connection_kwargs))

            pool = self._bulk[name] = BulkPool(endpoint, BULK_CONNECTIONS)
        return pool

    def _judge(self, name: str, replies: Sequence[Outcome]) -> None:
        outage = next((r for r in replies if is_outage(r)), None)
        if outage is not None:
            self._health.failed(name, outage, time.monotonic())
        else:
            self._health.ok(name)

    async def _moved(self, e: MovedError) -> None:
        try:
            await self.client.nodes_manager.move_slot(e)
        except (KeyError, *REDIS_ERRORS):  # the map changed under it (a reload): it is reloaded anyway
            pass

    async def _asking(self, host: str, port: int, commands: Sequence[Command], idx: list[int],
                      out: list[Outcome], failed: dict[int, str]) -> list[int]:
        """ASKING then the command, for each command, pipelined on one connection to the importing
        node (ASKING holds for the next command on its connection only). Returns the commands to
        send again: MOVED (the migration finished meanwhile) or TRYAGAIN."""
        node = self.client.get_node(host=host, port=port)
        temporary = node is None  # an importing node that serves no slot yet (scale-out)
        if node is None:
            node = redis.asyncio.cluster.ClusterNode(host, port, **self.client.nodes_manager.connection_kwargs)
        read = 0
        try:
            conn = node.acquire_connection()
            try:
                # A GET_INTO goes as a plain GET here (ASK is rare: the bytes are landed after).
                wire = [(Op.GET, commands[i][1]) if commands[i][0] is Op.GET_INTO else commands[i] for i in idx]
                await conn.send_packed_command(conn.pack_commands([p for c in wire for p in ((Op.ASKING,), c)]))
                for i, c in zip(idx, wire):
                    await conn.read_response()  # +OK
                    try:
                        reply = await node.parse_response(conn, c[0])
                        out[i] = land(reply, commands[i][2]) if commands[i][0] is Op.GET_INTO else reply
                    except REDIS_ERRORS as e:
                        if is_outage(e):
                            raise
                        out[i] = e  # the command's own error reply
                    read += 1
            except BaseException:
                await conn.disconnect()  # replies may be left unread on it
                raise
            finally:
                node.release(conn)
        except Exception as e:  # the connection failed: what was not read yet failed with it
            for i in idx[read:]:
                out[i] = e
                failed[i] = node.name
        finally:
            if temporary:
                with contextlib.suppress(Exception):
                    await node.disconnect()
        again = []
        for i in idx:
            if isinstance(out[i], MovedError):
                await self._moved(out[i])
                again.append(i)
            elif isinstance(out[i], AskError | TryAgainError):
                again.append(i)
        return again

    async def _reload(self) -> None:
        """Reload the slot map, as ReloadPacing allows."""
        if self._reloading is None:
            self._reloading = asyncio.Lock()
        async with self._reloading:
            if not self._pacing.due(time.monotonic()):
                return
            self.reloads += 1
            with contextlib.suppress(*REDIS_ERRORS):  # nothing reachable: a later batch asks again
                await self.client.nodes_manager.initialize()
            for name in [n for n in self._bulk if self.client.get_node(node_name=n) is None]:
                self._bulk.pop(name).close()  # a node gone from the map

    async def aclose(self) -> None:
        for pool in self._bulk.values():
            pool.close()
        self._bulk.clear()
