"""Engines' KV events (vLLM's and SGLang's ZMQ publishers), read as untrusted bytes. Pure: no I/O.

A message is [topic, 8-byte big-endian sequence, msgpack EventBatch [ts, [events], dp_rank]].
Events come as tagged maps (`{"type": "BlockStored", ...}`, vLLM 0.32 and SGLang 0.5.23) or in
the legacy array form (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, ...]`). Anything else is refused with a reason; nothing here raises another
error, whatever the bytes.

`EngineState` follows one engine: engines name blocks by their own hashes, so it keeps each
stored block's kvtier key (recomputed from the event's token ids, chained from its parent's) to
withdraw it later, and detects gaps (ask for a replay) and restarts (sequence back to 0, or
AllBlocksCleared: forget everything the engine held).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvtier.keys import BlockKey

MAX_PAYLOAD = 16 << 20
MAX_EVENTS = 100_000
LEGACY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


class BadMessage(ValueError):
    """A message that is not a KV event batch: dropped, with this reason, and counted."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[int | bytes, ...]
    parent: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int | bytes, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


EngineEvent = Stored | Removed | Cleared


def _hash(v: object, where: str) -> int | bytes:
    if isinstance(v, bool) or not isinstance(v, (int, bytes)):
        raise BadMessage(f"{where}: a block hash is an integer or bytes, got {type(v).__name__}")
    if isinstance(v, bytes) and len(v) > 64:
        raise BadMessage(f"{where}: a {len(v)}-byte block hash")
    return v


def _event(raw: object) -> EngineEvent | None:
    """One event, or None for a kind we do not use; BadMessage if it is malformed."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # legacy array form
        names = LEGACY_FIELDS.get(raw[0])
        if names is None:
            return None
        raw = {"type": raw[0], **dict(zip(names, raw[1:]))}
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise BadMessage("an event is a tagged map or a tagged array")
    kind = raw["type"]
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not hashes or len(hashes) > MAX_EVENTS:
        raise BadMessage(f"{kind}.block_hashes: a non-empty list is required")
    hs = tuple(_hash(h, f"{kind}.block_hashes") for h in hashes)
    medium = raw.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise BadMessage(f"{kind}.medium: a string or null")
    if kind == "BlockRemoved":
        return Removed(hs, medium)
    parent = raw.get("parent_block_hash")
    tokens = raw.get("token_ids")
    size = raw.get("block_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= 1 << 16:
        raise BadMessage("BlockStored.block_size: a positive integer")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32
                                               for t in tokens):
        raise BadMessage("BlockStored.token_ids: a list of token ids in [0, 2**32)")
    return Stored(hs, None if parent is None else _hash(parent, "BlockStored.parent_block_hash"), tuple(tokens),
                  size, medium)


def decode_message(frames: Sequence[bytes]) -> tuple[int, list[EngineEvent]]:
    """(sequence, events) of one published message; BadMessage with the reason otherwise."""
    if len(frames) != 3:
        raise BadMessage(f"{len(frames)} frames, want [topic, seq, payload]")
    _topic, seq, payload = frames
    if len(seq) != 8:
        raise BadMessage(f"a {len(seq)}-byte sequence number, want 8")
    if len(payload) > MAX_PAYLOAD:
        raise BadMessage(f"a {len(payload)}-byte payload")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_bin_len=MAX_PAYLOAD,
                                max_str_len=1 << 20, max_array_len=1 << 20, max_map_len=1 << 10, max_ext_len=0)
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise BadMessage(f"not msgpack: {type(e).__name__}") from e
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise BadMessage("the payload is [ts, [events], data_parallel_rank]")
    if len(batch[1]) > MAX_EVENTS:
        raise BadMessage(f"{len(batch[1])} events in one batch")
    events = [e for e in (_event(raw) for raw in batch[1]) if e is not None]
    return int.from_bytes(seq, "big", signed=True), events


@dataclass
class EngineState:
    """One engine's view: its blocks' kvtier keys, and where its sequence is."""

    block_tokens: int
    keys_for: Callable[[BlockKey | None, Sequence[int]], list[BlockKey]]  # (parent key, tokens) -> chain keys
    capacity: int = 1 << 20  # engine blocks remembered (oldest forgotten first)
    last_seq: int = -1
    blocks: collections.OrderedDict[int | bytes, BlockKey] = field(default_factory=collections.OrderedDict)
    unmatched: int = 0  # stored blocks whose kvtier key could not be known (no tokens, other size)

    def gap(self, seq: int) -> bool:
        """Whether messages between the last one and `seq` were missed (ask for a replay)."""
        return self.last_seq >= 0 and seq > self.last_seq + 1

    def restarted(self, seq: int) -> bool:
        """A live message whose sequence went back: the engine started again (its blocks are gone)."""
        return self.last_seq >= 0 and seq <= self.last_seq

    def apply(self, seq: int, events: list[EngineEvent], *, replayed: bool = False
              ) -> tuple[list[BlockKey], list[BlockKey], bool]:
        """(kvtier keys now held, keys no longer held, cleared-all) for one message in order. A
        replayed message at or before the last one applied is a duplicate, and skipped."""
        added: list[BlockKey] = []
        gone: list[BlockKey] = []
        cleared = False
        if seq <= self.last_seq:
            if replayed:
                return added, gone, cleared
            gone.extend(self.blocks.values())  # live and going back: a restart
            self.blocks.clear()
            cleared = True
        self.last_seq = seq
        for ev in events:
            if isinstance(ev, Cleared):
                gone.extend(self.blocks.values())
                self.blocks.clear()
                cleared = True
            elif isinstance(ev, Removed):
                for h in ev.hashes:
                    k = self.blocks.pop(h, None)
                    if k is not None:
                        gone.append(k)
            elif ev.block_size != self.block_tokens or len(ev.token_ids) != len(ev.hashes) * ev.block_size:
                self.unmatched += len(ev.hashes)
            else:
                parent = None if ev.parent is None else self.blocks.get(ev.parent)
                if ev.parent is not None and parent is None:
                    self.unmatched += len(ev.hashes)  # its chain began before we listened
                    continue
                keys = self.keys_for(parent, ev.token_ids)
                for h, k in zip(ev.hashes, keys):
                    self.blocks[h] = k
                    self.blocks.move_to_end(h)
                    added.append(k)
                while len(self.blocks) > self.capacity:
                    self.blocks.popitem(last=False)
        return added, gone, cleared


def decode_any(frames: Sequence[Any]) -> tuple[int, list[EngineEvent]]:
    """decode_message for frames of any type (a non-bytes frame is a BadMessage)."""
    if not all(isinstance(f, bytes) for f in frames):
        raise BadMessage("frames must be bytes")
    return decode_message(frames)
