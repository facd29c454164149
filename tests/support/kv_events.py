"""A router's end of kvtier's KV events: a SUB socket, and the replay request (vLLM's protocol)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import msgpack
import zmq

END_SEQ = -1


def endpoints() -> tuple[str, str, Path]:
    """ipc endpoints in a short private directory (unix socket paths are limited to ~107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvev-"))
    return f"ipc://{d}/pub.sock", f"ipc://{d}/replay.sock", d


def events_toml(pub: str, replay: str, extra: str = "") -> str:
    return f'[events]\nenabled = true\nendpoint = "{pub}"\nreplay_endpoint = "{replay}"\n{extra}'


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.messages: list[tuple[bytes, int, bytes]] = []

    def drain(self, timeout: float = 0.05) -> None:
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.messages.append((topic, int.from_bytes(seq, "big", signed=True), payload))

    def events(self) -> list[dict]:
        return [e for _, _, p in self.messages for e in msgpack.unpackb(p)[1]]

    def wait_for(self, predicate, timeout: float = 10.0, what: str = "") -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            self.drain()
            evs = self.events()
            if predicate(evs):
                return evs
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or predicate}: got {evs[-5:]}")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def replay(endpoint: str, start_seq: int, timeout: float = 5.0) -> list[tuple[bytes, int, bytes]]:
    """Ask the ROUTER for every buffered message from start_seq on; up to the end marker."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(endpoint)
        s.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
        out = []
        while True:
            if not s.poll(int(timeout * 1000)):
                raise AssertionError("no end marker from the replay socket")
            _, topic, seq, payload = s.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == END_SEQ:
                return out
            out.append((topic, n, payload))
    finally:
        s.close(linger=0)
        ctx.term()


def send_raw(endpoint: str, frames: list[bytes]) -> bool:
    """Send arbitrary frames to the replay socket; True if anything came back within 0.5 s."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.connect(endpoint)
        s.send_multipart(frames)
        return bool(s.poll(500))
    finally:
        s.close(linger=0)
        ctx.term()


class FakeEngine:
    """An engine's KV-event publisher as vLLM's ZmqEventPublisher speaks it: PUB for the events,
    ROUTER answering replay requests from a buffer (a thread serves them)."""

    def __init__(self, pub: str, replay: str | None) -> None:
        import threading

        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(pub)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests = 0
        self._stop = threading.Event()
        self._router = None
        if replay:
            self._router = self.ctx.socket(zmq.ROUTER)
            self._router.bind(replay)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def publish(self, seq: int, events: list, *, send: bool = True, raw: list[bytes] | None = None) -> None:
        payload = msgpack.packb([time.time(), events, 0])
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart(raw or [b"kv@node@model", seq.to_bytes(8, "big", signed=True), payload])

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self) -> None:
        assert self._router is not None
        while not self._stop.is_set():
            if not self._router.poll(100):
                continue
            ident, _, start = self._router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self._router.send_multipart([ident, b"", b"kv@node@model", seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        if self._router is not None:
            self._thread.join(2)
            self._router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def block_stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 16) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
