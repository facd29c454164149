"""Bulk reads (kvtier/store/bulk_reads.py) against a scripted server on a real loopback socket:
values land where they are told, in pieces of any size, and hostile replies never write past a
landing, never desynchronise the stream, and end the connection when they break the protocol."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
from redis.exceptions import AskError, ConnectionError, MovedError, ResponseError, TimeoutError

from kvtier.store.bulk_reads import (
    MAX_LINE,
    BulkConnection,
    BulkUnusable,
    Endpoint,
    Landing,
    WrongLength,
)

HEAD, BODY = 8, 4096


class Scripted:
    """A TCP server on loopback: after each request it writes `reply(request)`, in `chunk`-byte
    pieces (so values arrive split across reads); `then_close` closes the connection after."""

    def __init__(self, reply: Callable[[bytes], bytes], chunk: int = 1 << 20, delay: float = 0.0,
                 then_close: bool = False) -> None:
        self.reply, self.chunk, self.delay, self.then_close = reply, chunk, delay, then_close
        self.server: asyncio.Server | None = None
        self.asked = asyncio.Event()  # a request arrived
        self.closed = asyncio.Event()  # the connection is over (the client closed it, or we did)

    async def __aenter__(self) -> Endpoint:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Endpoint("127.0.0.1", port, None, None, None, 0, None, timeout=2.0, connect_timeout=2.0)

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.asked.set()
                await asyncio.sleep(self.delay)  # a slow server
                out = self.reply(data)
                for i in range(0, len(out), self.chunk):
                    writer.write(out[i:i + self.chunk])
                    await writer.drain()
                if self.then_close:
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            self.closed.set()


def landings(n: int) -> tuple[list[Landing], np.ndarray, np.ndarray]:
    heads = np.full((n, HEAD), 0xEE, dtype=np.uint8)
    bodies = np.full((n, BODY), 0xEE, dtype=np.uint8)
    return [Landing(heads[i].data, bodies[i].data) for i in range(n)], heads, bodies


def value(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 255, HEAD + BODY, dtype=np.uint8).tobytes()


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
async def test_values_land_exactly_whatever_pieces_they_arrive_in(chunk):
    vals = [value(i) for i in range(3)]
    async with Scripted(lambda _req: b"".join(bulk(v) for v in vals[:2]) + b"$-1\r\n" + bulk(vals[2]),
                        chunk=chunk) as ep:
        conn = await BulkConnection.open(ep)
        lands, heads, bodies = landings(4)
        got = await conn.get_into([b"a", b"b", b"c", b"d"], lands)
        assert got == [True, True, None, True]
        for i, v in ((0, vals[0]), (1, vals[1]), (3, vals[2])):
            assert heads[i].tobytes() + bodies[i].tobytes() == v
        assert (heads[2] == 0xEE).all() and (bodies[2] == 0xEE).all(), "an absent value writes nothing"
        assert not conn.broken
        conn.close()


async def test_error_replies_are_their_redis_py_errors_and_the_stream_stays_in_step():
    v = value(9)
    script = b"-ERR boom\r\n-MOVED 3999 127.0.0.1:6381\r\n-ASK 12 127.0.0.1:7000\r\n$10\r\n0123456789\r\n" + bulk(v)
    async with Scripted(lambda _req: script, chunk=5) as ep:
        conn = await BulkConnection.open(ep)
        lands, heads, bodies = landings(5)
        got = await conn.get_into([b"k"] * 5, lands)
        assert type(got[0]) is ResponseError and "boom" in str(got[0])
        assert isinstance(got[1], MovedError) and got[1].slot_id == 3999 and got[1].port == 6381
        assert isinstance(got[2], AskError) and got[2].port == 7000
        assert isinstance(got[3], WrongLength) and got[3].length == 10
        assert (heads[3] == 0xEE).all() and (bodies[3] == 0xEE).all(), "the wrong size is drained, not written"
        assert got[4] is True and heads[4].tobytes() + bodies[4].tobytes() == v, "and the next reply is read right"
        conn.close()


@pytest.mark.parametrize("hostile", [
    b"$999999999\r\n",  # far more than the landing: not read at all
    b"*3\r\n",  # a reply a GET cannot have
    b":5\r\n",
    b"$abc\r\n",
    b"$-7\r\n",
    b"$%d\r\n%sXY" % (HEAD + BODY, b"z" * (HEAD + BODY)),  # a value not ending with CRLF
    b"-" + b"E" * (2 * MAX_LINE),  # a line without end
])
async def test_replies_that_break_the_protocol_end_the_connection_and_fail_every_pending_value(hostile):
    async with Scripted(lambda _req: hostile) as ep:
        conn = await BulkConnection.open(ep)
        lands, heads, bodies = landings(2)
        got = await conn.get_into([b"a", b"b"], lands)
        assert all(isinstance(g, BulkUnusable) for g in got), got
        assert conn.broken
        if not hostile.endswith(b"XY"):
            assert (bodies == 0xEE).all(), "nothing was written into the landings"
        with pytest.raises(ConnectionError):
            await conn.get_into([b"a"], lands[:1])


async def test_a_server_that_closes_mid_value_fails_the_pending_values():
    v = value(3)
    async with Scripted(lambda _req: bulk(v)[:HEAD + 100], then_close=True) as ep:
        conn = await BulkConnection.open(ep)
        lands, _h, _b = landings(2)
        got = await conn.get_into([b"a", b"b"], lands)
        assert all(isinstance(g, ConnectionError) for g in got) and conn.broken


async def test_a_timeout_fails_the_read_and_nothing_lands_after_it():
    v = value(4)
    server = Scripted(lambda _req: bulk(v), delay=0.6)
    async with server as ep:
        ep = Endpoint(ep.host, ep.port, None, None, None, 0, None, timeout=0.2, connect_timeout=2.0)
        conn = await BulkConnection.open(ep)
        lands, heads, bodies = landings(1)
        with pytest.raises(TimeoutError):
            await conn.get_into([b"a"], lands)
        assert conn.broken
        await asyncio.wait_for(server.closed.wait(), 5)  # the late reply went out to a closed connection
        assert (heads == 0xEE).all() and (bodies == 0xEE).all(), "a late reply never lands"


async def test_a_cancelled_read_never_writes_into_the_landing_later():
    v = value(5)
    server = Scripted(lambda _req: bulk(v), delay=0.3)
    async with server as ep:
        conn = await BulkConnection.open(ep)
        lands, heads, bodies = landings(1)
        task = asyncio.ensure_future(conn.get_into([b"a"], lands))
        await asyncio.wait_for(server.asked.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.broken
        await asyncio.wait_for(server.closed.wait(), 5)
        assert (heads == 0xEE).all() and (bodies == 0xEE).all()
