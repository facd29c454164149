"""The bulk-read connection's protocol: RESP replies of a GET pipeline, parsed strictly, each value
landing straight in the buffers its caller named (an asyncio BufferedProtocol). The connections
and their pool: bulk_reads.py.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
from collections.abc import Sequence
from dataclasses import dataclass

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
            # A reply line: searched in a window no longer than a line may be (copying the whole
            # rest of the buffer to search it cost more than the values' own copies).
            j = bytes(data[i:i + MAX_LINE + 2]).find(b"\n")
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
