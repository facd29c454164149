"""Pipelined GETs of block values that land straight in the caller's buffers.

redis-py reads a 2 MiB reply through three copies: the socket into its stream buffer, that into
hiredis's reader, and that into a new `bytes`; the caller then copies it where it belongs. Here
an `asyncio.BufferedProtocol` hands the event loop the destination itself, so the kernel's copy
from the socket is the only one. On this 2-core machine a cold cross-node read-through (land,
verify) runs at 1.05-1.4x redis-py's GETs plus the copy into place, and the tier's verified get
at 1.06-1.08x of redis-py's bare GETs, which land nowhere and verify nothing (docs/performance.md).
Each value goes to two places the caller names: its 92-byte
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
import collections
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoPermissionError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

MAX_LINE = 1024  # a reply line (error, status, bulk length) longer than this is hostile
SCRATCH = 1 << 16


@dataclass(slots=True)
class Landing:
    """Where one value goes: its first len(head) bytes to `head`, the rest to `body`."""

    head: memoryview
    body: memoryview

    @property
    def size(self) -> int:
        return len(self.head) + len(self.body)


class BulkUnusable(ConnectionError):
    """This server cannot be read this way (its replies broke the protocol, or the connection's
    setup was refused): read it through redis-py instead."""


class WrongLength(Exception):
    """The value is not the size its landing expects: it was drained, not written."""

    def __init__(self, length: int) -> None:
        super().__init__(f"value is {length} bytes")
        self.length = length


Outcome = bool | None | Exception  # True: landed; None: absent; else the error


def _error(line: bytes) -> Exception:
    """The redis-py exception for an error reply (the ones block reads can meet)."""
    text = line.decode("utf-8", "replace")
    kind, _, rest = text.partition(" ")
    if kind == "MOVED":
        return MovedError(rest)
    if kind == "ASK":
        return AskError(rest)
    if kind == "TRYAGAIN":
        return TryAgainError(rest)
    if kind == "CLUSTERDOWN":
        return ClusterDownError(rest)
    if kind == "NOPERM":
        return NoPermissionError(text)
    if kind in ("WRONGPASS", "NOAUTH"):
        return AuthenticationError(text)  # a ConnectionError: the connection is of no use
    return ResponseError(text)


class _Expect:
    """One reply expected: a value (into `landing`), or a status (None)."""

    __slots__ = ("landing", "outcome")

    def __init__(self, landing: Landing | None) -> None:
        self.landing = landing
        self.outcome: Outcome | bytes = None


class BulkProtocol(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self._scratch = bytearray(SCRATCH)
        self._line = bytearray()
        self._queue: collections.deque[_Expect] = collections.deque()
        self._value: _Expect | None = None
        self._want = 0  # bytes of the current bulk value still to come
        self._got = 0  # bytes of it received
        self._drain = False  # the current value is not landing anywhere: read into scratch
        self._crlf = 0  # bytes of the value's closing CRLF still to come
        self.transport: asyncio.Transport | None = None
        self.failed: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # --- asyncio's side -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection lost: {exc}" if exc else "connection closed by server"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._value is not None and self._want and not self._drain:
            return self._target()
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._value is not None and self._want and not self._drain:
                self._landed(nbytes)
                return
            self._parse(memoryview(self._scratch)[:nbytes])
        except Exception as e:  # a fault here must end this connection, not the event loop's callback
            self._fail(BulkUnusable(f"reading a reply failed: {type(e).__name__}: {e}"))

    # --- parsing --------------------------------------------------------------------------

    def _target(self) -> memoryview:
        """Where the next bytes of the current value go: the rest of its head, else of its body."""
        assert self._value is not None and self._value.landing is not None
        land, got = self._value.landing, self._got
        return land.head[got:] if got < len(land.head) else land.body[got - len(land.head):]

    def _landed(self, n: int) -> None:
        self._got += n
        self._want -= n
        if not self._want:
            self._crlf = 2

    def _parse(self, data: memoryview) -> None:
        i = 0
        while i < len(data) and self.failed is None:
            if self._value is not None and self._want:  # the start of a value, in scratch
                take = min(self._want, len(data) - i)
                if self._drain:
                    self._drained(take)
                else:
                    target = self._target()  # the rest of the head, or of the body
                    take = min(take, len(target))
                    target[:take] = data[i:i + take]
                    self._landed(take)
                i += take
                continue
            if self._crlf:
                take = min(self._crlf, len(data) - i)
                if bytes(data[i:i + take]) != b"\r\n"[2 - self._crlf:2 - self._crlf + take]:
                    return self._fail(BulkUnusable("protocol error: a value does not end with CRLF"))
                self._crlf -= take
                i += take
                if not self._crlf:
                    self._reply_done()
                continue
            j = bytes(data[i:]).find(b"\n")  # a reply line
            if j < 0:
                self._line += data[i:]
                if len(self._line) > MAX_LINE:
                    return self._fail(BulkUnusable("protocol error: reply line too long"))
                return
            self._line += data[i:i + j + 1]
            i += j + 1
            line, self._line = bytes(self._line), bytearray()
            if len(line) > MAX_LINE or not line.endswith(b"\r\n"):
                return self._fail(BulkUnusable("protocol error: bad reply line"))
            self._line_done(line[:-2])

    def _drained(self, n: int) -> None:
        self._want -= n
        if not self._want:
            self._crlf = 2

    def _line_done(self, line: bytes) -> None:
        if not self._queue:
            return self._fail(BulkUnusable("protocol error: a reply nobody asked for"))
        exp = self._queue[0]
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            exp.outcome = _error(rest)
            return self._reply_done()
        if kind == b"+":
            exp.outcome = rest if exp.landing is None else BulkUnusable("protocol error: a status for a value")
            return self._reply_done()
        if kind != b"$" or exp.landing is None:
            return self._fail(BulkUnusable(f"protocol error: unexpected reply {line[:40]!r}"))
        try:
            n = int(rest)
        except ValueError:
            return self._fail(BulkUnusable("protocol error: bad bulk length"))
        if n == -1:
            exp.outcome = None
            return self._reply_done()
        if n < 0 or n > 2 * exp.landing.size + MAX_LINE:
            return self._fail(BulkUnusable(f"protocol error: a {n}-byte reply where {exp.landing.size} fit"))
        self._value, self._want, self._got = exp, n, 0
        self._drain = n != exp.landing.size
        exp.outcome = WrongLength(n) if self._drain else True
        if n == 0:
            self._crlf = 2

    def _reply_done(self) -> None:
        self._queue.popleft()
        self._value = None
        self._want = self._got = 0
        self._drain = False
        if not self._queue and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.failed is None:
            self.failed = error
        for exp in self._queue:
            if not isinstance(exp.outcome, Exception):
                exp.outcome = error
        if self.transport is not None:
            self.transport.abort()  # nothing more is read into anyone's buffers
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # --- the caller's side ----------------------------------------------------------------

    async def call(self, packed: bytes, expect: Sequence[Landing | None], timeout: float) -> list[Outcome | bytes]:
        """Send `packed` (the commands), wait for one reply per entry of `expect`."""
        if self.failed is not None or self.transport is None:
            raise self.failed or ConnectionError("not connected")
        exps = [_Expect(land) for land in expect]
        self._queue.extend(exps)
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(packed)
        try:
            async with asyncio.timeout(timeout):
                await self._waiter
        except builtins.TimeoutError:
            self._fail(TimeoutError("Timeout reading from socket"))  # and nothing lands later
            raise TimeoutError("Timeout reading from socket") from None
        except BaseException:  # cancelled: never write into the caller's buffers later
            self._fail(ConnectionError("cancelled while reading"))
            raise
        return [exp.outcome for exp in exps]


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
            setup.append(["AUTH", *([ep.username] if ep.username else []), ep.password])
        if ep.db:
            setup.append(["SELECT", ep.db])
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
                cmds.append(["ASKING"])
                expect.append(None)
            cmds.append(["GET", name])
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
