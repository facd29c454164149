"""The daemon's KV-event publisher: vLLM's ZMQ wire format (PUB for the events, ROUTER for replay).

Wire (vllm.distributed.kv_events.ZmqEventPublisher at vLLM 0.32): every message is three frames,
topic, an 8-byte big-endian sequence number (one counter for the daemon, from 0 at each start),
and a msgpack EventBatch `[ts, [events], data_parallel_rank]` (core/kv_events.py builds it). A
ROUTER socket answers `[identity, b"", start_seq]` with every buffered message from start_seq on,
as `[identity, b"", topic, seq, payload]`, then the end marker `[identity, b"", b"", seq -1, b""]`.

One thread owns the sockets (ZMQ sockets are not thread-safe). The event loop hands it batches
through an inproc PUSH socket and never waits: a full queue drops the batch, counted. The thread
sleeps in a poll on that socket and the replay socket: an idle publisher costs no wake-ups.
Replay requests are untrusted bytes: anything but three frames with an 8-byte sequence is
dropped and counted, never answered, never raised.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from typing import Any

import msgpack
import zmq

from kvtier.config import EventsConfig
from kvtier.core.events import Tier
from kvtier.core.kv_events import all_blocks_cleared, block_stored, event_batch, facts_to_events, medium_of

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b"stop"


class KvEventPublisher:
    def __init__(self, cfg: EventsConfig, log: Any) -> None:
        self.cfg = cfg
        self.log = log.bind(component="kv_events")
        self.sent = 0
        self.dropped = 0
        self.replays = 0
        self.bad_requests = 0
        self._ctx = zmq.Context()
        self._inproc = f"inproc://kvtier-kv-events-{uuid.uuid4().hex}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inproc)
        self._push = self._ctx.socket(zmq.PUSH)  # used by the event loop's thread only
        self._push.set_hwm(cfg.max_queue)
        self._push.connect(self._inproc)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._seq = 0
        self._thread: threading.Thread | None = None
        try:
            self._pub.bind(cfg.endpoint)
            self._tighten(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
                self._tighten(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"[events] cannot bind {e}: is another daemon or engine publishing there?") from e

    @staticmethod
    def _tighten(endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)  # the owner only, like the daemon's other sockets

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()
        self.log.info("kv_events.publishing", endpoint=self.cfg.endpoint, replay=self.cfg.replay_endpoint or None)

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.cfg.endpoint, "replay_endpoint": self.cfg.replay_endpoint or None,
                "sent": self.sent, "dropped": self.dropped, "replays": self.replays,
                "bad_requests": self.bad_requests}

    # --- the event loop's side ----------------------------------------------------------------

    def publish(self, topic: str, events: list[dict[str, Any]]) -> None:
        """Queue one batch; never blocks. A full queue drops it (counted)."""
        if not events:
            return
        payload = msgpack.packb(event_batch(time.time(), events, self.cfg.data_parallel_rank), use_bin_type=True)
        try:
            self._push.send_multipart([topic.encode("utf-8"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            try:
                self._push.send(_STOP, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            self._thread.join(2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._push, self._pull, self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # --- the publisher thread -----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and ready.get(self._replay):
                self._serve_replay()
            if ready.get(self._pull):
                frames = self._pull.recv_multipart()
                if len(frames) == 1:  # _STOP
                    return
                topic, payload = frames
                seq = self._seq.to_bytes(8, "big")
                self._seq += 1
                self._pub.send_multipart([topic, seq, payload])
                self._buffer.append((self._seq - 1, topic, payload))
                self.sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_requests += 1
            self.log.warning("kv_events.bad_replay_request", frames=len(frames),
                             detail="want [identity, b'', 8-byte start_seq]; dropped")
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        self.replays += 1
        for seq, topic, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", b"", END_SEQ, b""])


class RouterEvents:
    """Tier facts -> KV events on the publisher, one topic per pool (the model's name in it).

    Token ids are not known to the daemon yet (a put does not carry them), so BlockStored goes
    out with `token_ids: []`: routers that index by kvtier's hashes can use it, routers that
    recompute hashes from tokens (llm-d, Dynamo) cannot (docs/integrations/events.md)."""

    ANNOUNCE_CHUNK = 1000  # events per message when a start re-announces what a warm arena holds

    def __init__(self, publisher: KvEventPublisher, pools: dict[str, Any], node: str, topic: str) -> None:
        self.publisher = publisher
        self.pools = pools
        self.topics = {name: topic.replace("{node}", node).replace("{model}", rt.layout.model)
                       for name, rt in pools.items()}

    def _gpu_on_device(self, pool: str) -> bool:
        return self.pools[pool].gpu_ipc is not None

    def announce_start(self) -> None:
        """A new publisher (sequence from 0): routers drop what they knew of this node, then hear
        of every block a warm restart kept in the local tiers."""
        for name, rt in self.pools.items():
            self.publisher.publish(self.topics[name], [all_blocks_cleared()])
            bs = rt.layout.block_tokens
            for tier in (Tier.GPU, Tier.CPU):
                index = rt.placement.tiers.get(tier)
                if index is None:
                    continue
                medium = medium_of(tier, self._gpu_on_device(name))
                chunk: list[dict[str, Any]] = []
                for e in index.ready():
                    chunk.append(block_stored([e.key], e.parent, (), bs, medium))
                    if len(chunk) >= self.ANNOUNCE_CHUNK:
                        self.publisher.publish(self.topics[name], chunk)
                        chunk = []
                self.publisher.publish(self.topics[name], chunk)

    def emit(self, pool: str, facts: list[Any]) -> None:
        rt = self.pools[pool]
        self.publisher.publish(self.topics[pool], facts_to_events(facts, rt.layout.block_tokens,
                                                                  self._gpu_on_device(pool), lambda k: None))
