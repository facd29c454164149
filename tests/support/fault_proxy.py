"""A TCP fault proxy between kvtier and Redis, for fault tests: loopback only, in its own thread.

It listens on 127.0.0.1 (a free port) and forwards to the test's redis-server (a unix socket or
a TCP address). `mode` may be changed at any time and applies to traffic from then on:

- "pass":      forward both ways.
- "delay":     hold every chunk `delay_s` before forwarding it (a slow or overloaded Redis).
- "blackhole": accept and read, forward nothing, answer nothing (a hung Redis or a dead route).
- "reset":     close every connection at once, new ones included (a crashing or restarting Redis).
- "limit":     forward `limit_bytes` more bytes per direction per connection, then cut it there
               (a connection that dies halfway through a command or a reply).

Switching to "reset" also drops connections that are open now; the others keep their
connections, so a blackhole hangs requests already in flight, as a real one does.
"""

from __future__ import annotations

import asyncio
import threading

MODES = ("pass", "delay", "blackhole", "reset", "limit")


class FaultProxy:
    def __init__(self, upstream_unix: str | None = None, upstream_tcp: tuple[str, int] | None = None) -> None:
        if (upstream_unix is None) == (upstream_tcp is None):
            raise ValueError("give exactly one upstream")
        self._unix = upstream_unix
        self._tcp = upstream_tcp
        self.mode = "pass"
        self.delay_s = 0.5
        self.limit_bytes = 1024
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def set(self, mode: str, **kw) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        for k, v in kw.items():
            setattr(self, k, v)
        self.mode = mode
        if mode == "reset":
            self._loop.call_soon_threadsafe(self._drop_all)

    def stop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(10)

    # --- the proxy's own loop ----------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _shutdown(self) -> None:
        self._drop_all()
        if self._server is not None:
            self._server.close()
        self._loop.stop()

    def _drop_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == "reset":
            writer.transport.abort()
            return
        try:
            if self._unix is not None:
                up_r, up_w = await asyncio.open_unix_connection(self._unix)
            else:
                up_r, up_w = await asyncio.open_connection(*self._tcp)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        for w in (writer, up_w):
            self._writers.discard(w)
            w.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        budget: int | None = None  # bytes this direction may still carry in "limit" mode
        while True:
            data = await src.read(65536)
            if not data:
                break
            mode = self.mode
            if mode == "blackhole":
                continue  # swallowed: the other side waits for ever
            if mode == "reset":
                break
            if mode == "delay":
                await asyncio.sleep(self.delay_s)
            if mode == "limit":
                budget = self.limit_bytes if budget is None else budget
                if budget <= 0:
                    break
                data = data[:budget]
                budget -= len(data)
            else:
                budget = None
            dst.write(data)
            await dst.drain()
            if budget == 0:
                break  # the connection dies right here, halfway through whatever it carried
        dst.transport.abort()
