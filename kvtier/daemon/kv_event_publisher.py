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
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np
import zmq

from kvtier.config import EventsConfig
from kvtier.core.events import Tier
from kvtier.core.kv_events import all_blocks_cleared, block_stored, event_batch, facts_to_events, medium_of
from kvtier.errors import KvtierError

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
            raise KvtierError(f"[events] cannot bind {e}: is another daemon or engine publishing there?") from e

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

    A put may carry its blocks' token ids (routers such as llm-d and Dynamo hash tokens
    themselves); they are kept while the block is in a local tier, so that its later events
    (a demote to Redis, say) carry them too, and at most TOKENS_KEPT x the local capacity per pool
    (oldest first out). A block put without them is announced with `token_ids: []`."""

    ANNOUNCE_CHUNK = 1000  # events per message when a start re-announces what a warm arena holds
    TOKENS_KEPT = 2

    def __init__(self, publisher: KvEventPublisher, pools: dict[str, Any], node: str, topic: str) -> None:
        self.publisher = publisher
        self.pools = pools
        self.topics = {name: topic.replace("{node}", node).replace("{model}", rt.layout.model)
                       for name, rt in pools.items()}
        self._tokens: dict[str, collections.OrderedDict[bytes, bytes]] = {n: collections.OrderedDict() for n in pools}
        self.bad_tokens = 0

    def note_tokens(self, pool: str, keys: list[Any], tokens: bytes) -> None:
        """A put's token ids (u32 LE, block after block); of another length than the pool's
        blocks need, they are ignored (counted): the put itself stands."""
        rt = self.pools[pool]
        size = 4 * rt.layout.block_tokens
        if len(tokens) != size * len(keys):
            self.bad_tokens += 1
            return
        store = self._tokens[pool]
        for i, k in enumerate(keys):
            store[k] = tokens[i * size:(i + 1) * size]
            store.move_to_end(k)
        while len(store) > self.TOKENS_KEPT * max(rt.local_blocks, 1):
            store.popitem(last=False)

    def _tokens_of(self, pool: str, key: bytes) -> list[int] | None:
        t = self._tokens[pool].get(key)
        return None if t is None else np.frombuffer(t, dtype="<u4").tolist()

    def stats(self) -> dict[str, Any]:
        return {**self.publisher.stats(), "bad_tokens": self.bad_tokens}

    def _gpu_on_device(self, pool: str) -> bool:
        return self.pools[pool].gpu_ipc is not None

    def announce_start(self) -> None:
        """A new publisher (sequence from 0): routers drop what they knew of this node, then hear
        of every block a warm restart kept in the local tiers."""
        for name, rt in self.pools.items():
            self.publisher.publish(self.topics[name], [all_blocks_cleared()])
            for tier in (Tier.GPU, Tier.CPU):
                index = rt.placement.tiers.get(tier)
                if index is not None:
                    self.announce(name, tier, index.ready())

    def announce(self, pool: str, tier: Tier, entries: Iterable[Any]) -> None:
        """BlockStored for blocks that appeared without a fact: those a warm restart restores
        (at the start, and as the arena's population brings its chunks back)."""
        bs = self.pools[pool].layout.block_tokens
        medium = medium_of(tier, self._gpu_on_device(pool))
        chunk: list[dict[str, Any]] = []
        for e in entries:
            chunk.append(block_stored([e.key], e.parent, (), bs, medium))
            if len(chunk) >= self.ANNOUNCE_CHUNK:
                self.publisher.publish(self.topics[pool], chunk)
                chunk = []
        if chunk:
            self.publisher.publish(self.topics[pool], chunk)

    def emit(self, pool: str, facts: list[Any]) -> None:
        rt = self.pools[pool]
        self.publisher.publish(self.topics[pool], facts_to_events(facts, rt.layout.block_tokens,
                                                                  self._gpu_on_device(pool),
                                                                  lambda k: self._tokens_of(pool, k)))
        store = self._tokens[pool]
        for f in facts:  # a block no local tier holds any more will not be announced again
            if f.key in store and rt.placement.where(f.key) in (None, Tier.REDIS):
                del store[f.key]
