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
