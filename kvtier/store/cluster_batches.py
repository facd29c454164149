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
import time
from collections.abc import Sequence

import redis.asyncio.cluster
from redis.exceptions import AskError, MovedError, RedisClusterException, SlotNotCoveredError, TryAgainError

from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.store.commands import Command, Outcome, key_of
from kvtier.store.master_health import MasterHealth, ReloadPacing

MAX_REDIRECTS = 5  # rounds of MOVED/ASK/TRYAGAIN per batch before the redirect is the outcome
UNCOVERED = ""  # in a round's failures: the command's slot had no master


class ClusterBatches:
    def __init__(self, client: redis.asyncio.cluster.RedisCluster) -> None:
        self.client = client
        self.redirects = 0
        self.reloads = 0
        self.skipped = 0
        self._health = MasterHealth()
        self._pacing = ReloadPacing()
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
            await self._round(commands, again, out)
        return out

    def _owner(self, command: Command) -> str | None:
        try:
            node = self.client.get_node_from_key(key_of(command))
        except RedisClusterException:  # SlotNotCoveredError: no master serves it now
            return None
        return None if node is None else node.name

    async def _round(self, commands: Sequence[Command], todo: list[int], out: list[Outcome]) -> dict[int, str]:
        """Send `todo`, following redirects, outcomes into `out`. Returns the commands that met an
        outage (or no master), each with the master it was meant for (UNCOVERED: none)."""
        failed: dict[int, str] = {}
        for _ in range(MAX_REDIRECTS):
            asks: dict[tuple[str, int], list[int]] = {}
            again: list[int] = []
            for i, sent_to in await self._send(commands, todo, out):
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

    async def _send(self, commands: Sequence[Command], todo: list[int], out: list[Outcome]) -> list[tuple[int, str]]:
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
        await asyncio.gather(*(self._group(name, commands, idx, out) for name, idx in groups.items()))
        return sent + [(i, name) for name, idx in groups.items() for i in idx]

    async def _group(self, name: str, commands: Sequence[Command], idx: list[int], out: list[Outcome]) -> None:
        """One master's share. Redirects are left as outcomes (`allow_redirections=False`)."""
        pipe = self.client.pipeline(transaction=False)
        for i in idx:
            pipe.execute_command(*commands[i])
        try:
            replies = await pipe.execute(raise_on_error=False, allow_redirections=False)
        except Exception as e:  # a Redis error, or another from inside redis-py (bus/failures.py)
            replies = [e] * len(idx)
        for i, r in zip(idx, replies):
            out[i] = r
        self._judge(name, replies)

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
                await conn.send_packed_command(conn.pack_commands(
                    [part for i in idx for part in (("ASKING",), commands[i])]))
                for i in idx:
                    await conn.read_response()  # +OK
                    try:
                        out[i] = await node.parse_response(conn, commands[i][0])
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
