"""Typed events on the bus. Events carry keys and locations only, never block bytes.

Three families (docs/architecture.md, "Bus"):
- client events (inference worker -> daemon): Access, Put, Prefetch, RemoteRead, Pin;
- tier commands (-> one tier worker's stream): Store, StoreBatch, Promote, Demote, Copy, Evict,
  Retain (the redis worker's);
- tier facts (tier worker -> facts stream): Stored, StoredBatch, Removed.

A batch (StoreBatch, StoredBatch) is the per-block event for a run of blocks, as one event: a put
of 64 blocks costs one command and one fact, not 64 of each, on the wire and in the handlers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import ClassVar, NamedTuple, NewType

from kvtier.keys import BlockKey

# The token ids of a put's blocks, block after block, each a little-endian u32 (routers' KV
# events carry them; the daemon never needs them to place a block).
TokenIds = NewType("TokenIds", bytes)

# 2: facts carry a typed cause (Cause) and a removed fact its why (Reason | Failure), where 1 had
# strings such as `promote_failed:verify`; 3: clients report reads straight from Redis
# (RemoteRead); 4: a put may carry its blocks' token ids (for routers' KV events); 5: the disk
# tier (Tier.DISK = 2, Redis moved to 3). A daemon rejects (dead-letters) another version's entries.
SCHEMA_VERSION = 5


class Tier(enum.IntEnum):
    """Ordered from fastest to slowest; a lower value is an upper tier."""

    GPU = 0
    CPU = 1
    DISK = 2  # this node's block file (kvtier/disk/); capacity 0 when the pool has none
    REDIS = 3

    @property
    def label(self) -> str:
        return _TIER_LABELS[self]  # (not self.name.lower(): the enum's name property is slow on a hot path)


_TIER_LABELS = MappingProxyType({t: t.name.lower() for t in Tier})


class Cause(enum.StrEnum):
    """The command a fact answers: its op. A `removed` fact also says why (`Reason`, `Failure`)."""

    STORE = "store"
    PROMOTE = "promote"
    DEMOTE = "demote"
    COPY = "copy"
    EVICT = "evict"


class Reason(enum.StrEnum):
    """Why a block leaves a tier: carried by an `evict` and by the `removed` fact it leads to."""

    CLEAN = "clean"  # a lower tier holds it
    DEMOTED = "demoted"  # written back: the lower tier reported it stored
    UNREUSED = "unreused"  # the frequency filter's documented drop (redis_admit_after_hits)
    MAKE_ROOM = "make_room"  # a full tier's worker dropped it for a new block; a lower tier holds it
    FAULT = "fault"  # the tier's device failed (the disk tier turned off): the block is gone from it


class Failure(enum.StrEnum):
    """Why a store or transfer did not complete: a `removed` fact with that command's cause."""

    BAD_STAGING = "bad_staging"  # the staging segment or slot could not be read
    VERIFY = "verify"  # the staged bytes changed or failed their checksum
    NO_ROOM = "no_room"  # no free slot and nothing clean to evict
    REDIS = "redis"  # the Redis write failed
    SOURCE_MISS = "source_miss"  # the source tier no longer holds a valid copy
    DISK = "disk"  # the disk tier failed the write (EIO, ENOSPC, EROFS), or is off


class StagedBlock(NamedTuple):
    """One block a client wrote into its staging segment, or (`granted`) straight into a cpu
    arena slot the daemon granted it (kvtier/tiers/grants.py): then `slot` and `gen` are the
    arena slot's. A NamedTuple, immutable as the events holding it are: a put's client makes two
    a block and the daemon decodes one, and a frozen dataclass costs 2.5 times as much to make
    (425 ns against 175)."""

    key: BlockKey
    parent: BlockKey | None
    slot: int
    gen: int
    granted: bool = False


# StagedBlock from its five fields as one tuple (keys checked by the caller), without the
# NamedTuple's generated __new__, a Python call: 104 ns a block against 150, in the loops that
# make a put's blocks.
staged_block: Callable[[tuple[bytes, bytes | None, int, int, bool]], StagedBlock] = partial(tuple.__new__,
                                                                                          StagedBlock)


# --- client events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Access:
    """A batch of blocks a client read; feeds the LRU and the promotion counters."""

    TYPE: ClassVar[str] = "access"
    pool: str
    keys: tuple[BlockKey, ...]  # blocks read successfully
    missed: int  # blocks asked for past the hit prefix


@dataclass(frozen=True, slots=True)
class Put:
    """New blocks are waiting in the client's staging segment `segment`."""

    TYPE: ClassVar[str] = "put"
    pool: str
    segment: str
    blocks: tuple[StagedBlock, ...]
    tokens: TokenIds | None = None  # block_tokens ids per block, in block order, when the client gave them
    # The daemon's grant epoch the granted blocks were written under (0: none granted); a block
    # granted by an earlier daemon is refused, never adopted.
    epoch: int = 0
    tenant: str = ""  # whose blocks these are, for fair share (core/tenants.py); "" the default tenant


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Bring this chain up to the cpu tier (from Redis) ahead of use."""

    TYPE: ClassVar[str] = "prefetch"
    pool: str
    keys: tuple[BlockKey, ...]  # one chain: keys[i] is the parent of keys[i + 1]
    head_parent: BlockKey | None  # the parent of keys[0]; None when keys[0] starts the chain


@dataclass(frozen=True, slots=True)
class RemoteRead:
    """A client read this chain straight from Redis (read-through): the daemon may bring it up."""

    TYPE: ClassVar[str] = "remote_read"
    pool: str
    keys: tuple[BlockKey, ...]  # one chain: keys[i] is the parent of keys[i + 1]
    head_parent: BlockKey | None  # the parent of keys[0]; None when keys[0] starts the chain


@dataclass(frozen=True, slots=True)
class Pin:
    """Keep this chain on the node for `ttl_s` seconds, charged to `tenant`'s pin budget
    (core/pins.py); 0 lets the tenant's pins of it go."""

    TYPE: ClassVar[str] = "pin"
    pool: str
    keys: tuple[BlockKey, ...]  # one chain, head first
    ttl_s: int
    tenant: str


# --- tier commands -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Store:
    """Admit a block from a client's staging segment into `tier`."""

    TYPE: ClassVar[str] = "store"
    pool: str
    tier: Tier
    key: BlockKey
    parent: BlockKey | None
    segment: str
    slot: int
    gen: int
    granted: bool = False  # slot and gen are of the cpu arena slot granted to the segment's client


@dataclass(frozen=True, slots=True)
class StoreBatch:
    """A `Store` of each of `blocks` (one put's blocks bound for `tier`, in chain order)."""

    TYPE: ClassVar[str] = "store_batch"
    pool: str
    tier: Tier
    segment: str
    blocks: tuple[StagedBlock, ...]

    def stores(self) -> list[Store]:
        return [self.store(b) for b in self.blocks]

    def store(self, b: StagedBlock) -> Store:
        """The store command of one of its blocks."""
        return Store(self.pool, self.tier, b.key, b.parent, self.segment, b.slot, b.gen, b.granted)


@dataclass(frozen=True, slots=True)
class Promote:
    """Copy `key` up from `src` (slot/gen locate it there; Redis ignores them) into `dst`."""

    TYPE: ClassVar[str] = "promote"
    pool: str
    key: BlockKey
    parent: BlockKey | None
    src: Tier
    dst: Tier
    src_slot: int
    src_gen: int


@dataclass(frozen=True, slots=True)
class Demote:
    """Copy `key` down from `src` into `dst`; the source drops it only once `dst` has stored it."""

    TYPE: ClassVar[str] = "demote"
    pool: str
    key: BlockKey
    parent: BlockKey | None
    src: Tier
    dst: Tier
    src_slot: int
    src_gen: int


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy `key` from `src` into `dst` and keep both (write-through to Redis)."""

    TYPE: ClassVar[str] = "copy"
    pool: str
    key: BlockKey
    parent: BlockKey | None
    src: Tier
    dst: Tier


@dataclass(frozen=True, slots=True)
class Evict:
    """Drop `key` from `tier`. The worker refuses unless a lower tier holds it or `reason` allows a drop."""

    TYPE: ClassVar[str] = "evict"
    pool: str
    key: BlockKey
    tier: Tier
    reason: Reason


@dataclass(frozen=True, slots=True)
class Retain:
    """For the redis worker: keep these blocks' Redis copies for at least `ttl_s` more seconds
    (a session pin). Never shortens a TTL, never creates a block."""

    TYPE: ClassVar[str] = "retain"
    pool: str
    keys: tuple[BlockKey, ...]
    ttl_s: int


# --- tier facts ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """`key` is now visible in `tier` at `slot` (slot -1 for Redis), by the command `cause`."""

    TYPE: ClassVar[str] = "stored"
    pool: str
    key: BlockKey
    parent: BlockKey | None
    tier: Tier
    slot: int
    cause: Cause


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """A `Stored` of each block: keys[i] (parent parents[i]) is now visible in `tier` at slots[i]."""

    TYPE: ClassVar[str] = "stored_batch"
    pool: str
    tier: Tier
    cause: Cause
    keys: tuple[BlockKey, ...]
    parents: tuple[BlockKey | None, ...]
    slots: tuple[int, ...]

    def facts(self) -> list[Stored] | None:
        """The facts it stands for; None when its columns differ in length (a malformed event)."""
        if not len(self.keys) == len(self.parents) == len(self.slots):
            return None
        return [Stored(self.pool, k, p, self.tier, s, self.cause)
                for k, p, s in zip(self.keys, self.parents, self.slots)]


@dataclass(frozen=True, slots=True)
class Removed:
    """`key` left `tier` by an evict (`why` is its Reason), or never made it there: the command
    `cause` failed (`why` is a Failure)."""

    TYPE: ClassVar[str] = "removed"
    pool: str
    key: BlockKey
    tier: Tier
    cause: Cause
    why: Reason | Failure


Command = Store | Promote | Demote | Copy | Evict  # what the policy sends a tier worker
Event = (Access | Put | Prefetch | RemoteRead | Pin | Store | StoreBatch | Promote | Demote | Copy | Evict | Retain
         | Stored | StoredBatch | Removed)
EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls for cls in (Access, Put, Prefetch, RemoteRead, Pin, Store, StoreBatch, Promote, Demote, Copy, Evict,
                              Retain, Stored, StoredBatch, Removed)
}


@dataclass(frozen=True, slots=True)
class Envelope:
    """What goes on the wire: the event plus who sent it, in which life (epoch), in which order."""

    event: Event
    producer: str
    epoch: int
    seq: int
