"""The daemon hears its node's engines: their KV events (vLLM's, SGLang's ZMQ publishers) feed the
cluster prefix index, so `where` can name an engine's own GPU cache (tier `engine`).

One thread owns the ZMQ sockets: a SUB per engine, and a DEALER on its replay socket when one is
configured. Messages are decoded as untrusted (core/engine_events.py); a malformed one is dropped
with its reason and counted. A gap in an engine's sequence asks its replay socket for what was
missed, holding the live messages until the replay's end marker; an engine that restarted
(sequence back to 0, or AllBlocksCleared) has its entries withdrawn. The index commands go to
the PrefixIndexWriter on the event loop (call_soon_threadsafe): this thread never touches Redis.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.core.engine_events import BadMessage, EngineState, decode_any
from kvtier.core.where import index_commands
from kvtier.keys import BlockKey, chain_keys, root_key

ENGINE_TIER = "engine"
REPLAY_WAIT_MS = 2000  # a replay socket that does not answer: give up on that gap


@dataclass(frozen=True, slots=True)
class EngineSource:
    name: str
    endpoint: str
    replay_endpoint: str | None


def parse_engines(text: str) -> list[EngineSource]:
    """`name endpoint [replay_endpoint]; ...` (config [ingest] engines, already pattern-checked)."""
    out = []
    for part in text.split(";"):
        words = part.split()
        if words:
            out.append(EngineSource(words[0], words[1], words[2] if len(words) > 2 else None))
    return out


class EngineIngest:
    def __init__(self, engines: list[EngineSource], node: str, pool: Any, ttl_s: int,
                 enqueue: Callable[[list[tuple[object, ...]]], None], loop: Any, log: Any) -> None:
        self.engines = engines
        self.node = node
        self.pool = pool  # PoolRuntime: its name, block_tokens and fingerprint (the unsalted chain)
        self.ttl_s = ttl_s
        self._enqueue = enqueue
        self._loop = loop
        self.log = log.bind(component="engine_ingest")
        self.counters: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._refresh = threading.Event()
        self._thread: threading.Thread | None = None
        root = root_key(pool.layout.fingerprint)

        def keys_for(parent: BlockKey | None, tokens: Any) -> list[BlockKey]:
            return chain_keys(parent if parent is not None else root, tokens, pool.layout.block_tokens)

        self.states = {e.name: EngineState(pool.layout.block_tokens, keys_for) for e in engines}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtier-engine-ingest", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(3.0)

    def request_refresh(self) -> None:
        """Re-write every block the engines hold (renews the TTLs), from the ingest thread."""
        self._refresh.set()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "unmatched": sum(s.unmatched for s in self.states.values()),
                "engines": {n: {"last_seq": s.last_seq, "blocks": len(s.blocks)} for n, s in self.states.items()}}

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        subs: dict[Any, EngineSource] = {}
        replays: dict[str, Any] = {}
        poller = zmq.Poller()
        try:
            for e in self.engines:
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.connect(e.endpoint)
                poller.register(s, zmq.POLLIN)
                subs[s] = e
                if e.replay_endpoint:
                    d = ctx.socket(zmq.DEALER)
                    d.connect(e.replay_endpoint)
                    replays[e.name] = d
            self.log.info("engine_ingest.listening", engines=[e.name for e in self.engines])
            while not self._stop.is_set():
                if self._refresh.is_set():
                    self._refresh.clear()
                    for e in self.engines:
                        held = list(self.states[e.name].blocks.values())
                        cmds = index_commands(self.pool.name, f"{self.node}/{e.name}",
                                              [(k, ENGINE_TIER) for k in held], [], self.ttl_s)
                        if cmds:
                            self._loop.call_soon_threadsafe(self._enqueue, cmds)
                for sock, _ in poller.poll(200):
                    e = subs[sock]
                    self._message(e, sock.recv_multipart(), replays.get(e.name))
        finally:
            for s in [*subs, *replays.values()]:
                s.close(linger=0)
            ctx.term()

    def _message(self, e: EngineSource, frames: list[bytes], replay: Any) -> None:
        try:
            seq, events = decode_any(frames)
        except BadMessage as err:
            self.counters["bad_messages"] += 1
            self.log.warning("engine_ingest.bad_message", engine=e.name, reason=str(err))
            return
        state = self.states[e.name]
        if state.gap(seq):
            self.counters["gaps"] += 1
            if replay is not None:
                self._replay(e, replay, state.last_seq + 1)
                if state.last_seq >= seq:
                    return  # the replay brought this message too
            else:
                self.log.warning("engine_ingest.gap", engine=e.name, missed_from=state.last_seq + 1, to=seq - 1,
                                 detail="no replay socket configured: those blocks are not indexed")
        if state.restarted(seq):
            self.counters["restarts"] += 1
        self._apply(e, seq, events)

    def _replay(self, e: EngineSource, sock: Any, start: int) -> None:
        """Ask for every buffered message from `start` on; apply them in order until the end marker."""
        sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        self.counters["replays"] += 1
        while sock.poll(REPLAY_WAIT_MS):
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                self.counters["bad_messages"] += 1
                continue
            seq = int.from_bytes(frames[2], "big", signed=True) if len(frames[2]) == 8 else None
            if seq == -1:
                return
            try:
                seq2, events = decode_any(frames[1:])
            except BadMessage as err:
                self.counters["bad_messages"] += 1
                self.log.warning("engine_ingest.bad_message", engine=e.name, reason=str(err), replay=True)
                continue
            self._apply(e, seq2, events, replayed=True)
        self.log.warning("engine_ingest.replay_unanswered", engine=e.name, start=start)

    def _apply(self, e: EngineSource, seq: int, events: list[Any], replayed: bool = False) -> None:
        added, gone, cleared = self.states[e.name].apply(seq, events, replayed=replayed)
        if cleared:
            self.counters["cleared"] += 1
        self.counters["messages"] += 1
        holder = f"{self.node}/{e.name}"
        cmds = index_commands(self.pool.name, holder, [(k, ENGINE_TIER) for k in added],
                              [(k, ENGINE_TIER) for k in gone], self.ttl_s)
        if cmds:
            self._loop.call_soon_threadsafe(self._enqueue, cmds)
