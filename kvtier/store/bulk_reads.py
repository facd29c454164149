"""Pipelined GETs of block values that land straight in the caller's buffers.

redis-py reads a 2 MiB reply through three copies: the socket into its stream buffer, that into
hiredis's reader, and that into a new `bytes`; the caller then copies it where it belongs. Here
an `asyncio.BufferedProtocol` hands the event loop the destination itself, so the kernel's copy
from the socket is the only one. On this 2-core machine a cold cross-node read-through (land,
verify) runs at 1.05-1.4x redis-py's GETs plus the copy into place, and the tier's verified get
at 1.06-1.08x of redis-py's bare GETs, which land nowhere and verify nothing (docs/performance.md).
Each value goes to two places the caller names (the parser: bulk_protocol.py): its 92-byte
header and its payload (a tensor row, an arena slot, a scratch buffer).

Only what a pipeline of GETs (and the ASKING, AUTH and SELECT around them) can answer is
understood, and strictly: `$<n>` bulk replies, `$-1` (absent), `+` status lines and `-` errors.
The bytes are untrusted: a reply of another length is drained and reported as such (never
written past its destination), a line longer than MAX_LINE or anything else closes the
connection, and every reply still expected fails with the error. The values are verified by the
caller afterwards (header, key, layout, checksum), as any value read from Redis is.

Connections are opened from a redis-py connection's own settings (host and port or unix path,
TLS context, username, password, db), so the URL means the same here as everywhere else.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import (
    ConnectionError,
    ResponseError,
    TimeoutError,
)

from kvtier.store.bulk_protocol import MAX_LINE, BulkProtocol, BulkUnusable, Landing, Outcome, WrongLength
from kvtier.store.ops import Op

__all__ = ["MAX_LINE", "BulkConnection", "BulkPool", "BulkProtocol", "BulkUnusable", "Endpoint", "Landing",
           "WrongLength", "land", "pack"]


def pack(*commands: Sequence[bytes | str | int]) -> bytes:
    out = bytearray()
    for cmd in commands:
        out += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            b = arg if isinstance(arg, bytes) else str(arg).encode()
            out += b"$%d\r\n%s\r\n" % (len(b), b)
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect, from a redis-py connection's settings."""

    host: str | None
    port: int | None
    path: str | None
    username: str | None
    password: str | None
    db: int
    ssl: Any  # ssl.SSLContext or None
    timeout: float
    connect_timeout: float

    @classmethod
    def of(cls, conn: Any) -> Endpoint:
        """From a redis-py asyncio Connection (not connected: its settings are what is read)."""
        ctx = conn.ssl_context.get() if hasattr(conn, "ssl_context") else None
        return cls(getattr(conn, "host", None), getattr(conn, "port", None), getattr(conn, "path", None) or None,
                   conn.username, conn.password, int(conn.db or 0), ctx, float(conn.socket_timeout or 5.0),
                   float(conn.socket_connect_timeout or conn.socket_timeout or 5.0))


class BulkConnection:
    def __init__(self, proto: BulkProtocol, endpoint: Endpoint) -> None:
        self.proto = proto
        self.endpoint = endpoint

    @classmethod
    async def open(cls, ep: Endpoint) -> BulkConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(ep.connect_timeout):
                if ep.path:
                    _t, proto = await loop.create_unix_connection(BulkProtocol, ep.path, ssl=ep.ssl)
                else:
                    assert ep.host is not None and ep.port is not None
                    _t, proto = await loop.create_connection(BulkProtocol, ep.host, ep.port, ssl=ep.ssl,
                                                             server_hostname=ep.host if ep.ssl else None)
        except OSError as e:
            raise ConnectionError(f"Error connecting to {ep.path or f'{ep.host}:{ep.port}'}: {e}") from e
        except builtins.TimeoutError as e:
            raise TimeoutError(f"Timeout connecting to {ep.path or f'{ep.host}:{ep.port}'}") from e
        conn = cls(proto, ep)
        setup: list[list[bytes | str | int]] = []
        if ep.password is not None:
            setup.append([Op.AUTH, *([ep.username] if ep.username else []), ep.password])
        if ep.db:
            setup.append([Op.SELECT, ep.db])
        if setup:
            replies = await proto.call(pack(*setup), [None] * len(setup), ep.timeout)
            bad = next((r for r in replies if isinstance(r, Exception)), None)
            if bad is not None:
                conn.close()
                raise BulkUnusable(f"connection setup refused: {bad}")
        return conn

    @property
    def broken(self) -> bool:
        return self.proto.failed is not None

    async def get_into(self, names: Sequence[bytes | str], landings: Sequence[Landing],
                       asking: bool = False) -> list[Outcome]:
        """GET each name into its landing, pipelined (each after ASKING when `asking`)."""
        cmds: list[list[bytes | str | int]] = []
        expect: list[Landing | None] = []
        for name, land in zip(names, landings):
            if asking:
                cmds.append([Op.ASKING])
                expect.append(None)
            cmds.append([Op.GET, name])
            expect.append(land)
        replies = await self.proto.call(pack(*cmds), expect, self.endpoint.timeout)
        return [r for r, e in zip(replies, expect) if e is not None]  # type: ignore[misc]

    def close(self) -> None:
        if self.proto.transport is not None:
            self.proto.transport.abort()


class BulkPool:
    """A few BulkConnections to one server, opened on demand; a broken one is dropped."""

    def __init__(self, endpoint: Callable[[], Awaitable[Endpoint]], size: int) -> None:
        self._endpoint = endpoint
        self._free: list[BulkConnection] = []
        self._size = size
        self._gate: asyncio.Semaphore | None = None

    async def get_into(self, names: Sequence[bytes | str], landings: Sequence[Landing],
                       asking: bool = False) -> list[Outcome]:
        """One pipeline on a pooled connection; a connection-level failure is every value's error.
        A pooled connection that fails (the server restarted, or failed over, since it was last
        used) is replaced once by a new one, as redis-py's own retry would."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._size)
        async with self._gate:
            while True:
                conn = self._free.pop() if self._free else None
                fresh = conn is None
                try:
                    if conn is None:
                        conn = await BulkConnection.open(await self._endpoint())
                    out = await conn.get_into(names, landings, asking)
                except (ConnectionError, TimeoutError, OSError) as e:
                    if conn is not None:
                        conn.close()
                    if not fresh and not isinstance(e, BulkUnusable):
                        continue  # a stale pooled connection: once more on a new one
                    err = e if isinstance(e, ConnectionError | TimeoutError) else ConnectionError(str(e))
                    return [err] * len(names)
                except BaseException:
                    if conn is not None:
                        conn.close()
                    raise
                if not conn.broken:
                    self._free.append(conn)
                    return out
                conn.close()
                failed = conn.proto.failed
                if not fresh and not isinstance(failed, BulkUnusable) and all(o is failed for o in out):
                    continue  # it died before answering anything: a stale connection, as above
                return out

    def close(self) -> None:
        for c in self._free:
            c.close()
        self._free.clear()


def land(raw: object, landing: Landing) -> Outcome:
    """A value redis-py read (a GET's reply) put where a bulk read would have put it."""
    if raw is None or isinstance(raw, Exception):
        return raw
    if not isinstance(raw, bytes):
        return ResponseError(f"a GET answered {type(raw).__name__}")
    if len(raw) != landing.size:
        return WrongLength(len(raw))
    h = len(landing.head)
    landing.head[:] = raw[:h]
    landing.body[:] = raw[h:]
    return True
