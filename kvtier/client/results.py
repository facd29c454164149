"""What the client's calls answer, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.events import Tier


@dataclass(frozen=True, slots=True)
class Lookup:
    """`length` leading blocks are resident on this node, `tiers[i]` says where block i is.
    `redis_length` more blocks after those can be read, each from Redis or from this node (only
    `locate` asks Redis): `length + redis_length` is what `get(..., remote=True)` reads."""

    length: int
    tiers: tuple[Tier, ...]
    redis_length: int = 0


@dataclass(frozen=True, slots=True)
class PutResult:
    staged: int  # handed to the daemon; visible once it has verified and stored them
    dropped: int  # not handed over: staging full or the daemon unreachable


@dataclass(slots=True)
class ClientStats:
    reads: int = 0
    read_misses: int = 0
    put_dropped: int = 0
    event_errors: int = 0
    remote_reads: int = 0  # blocks read straight from Redis (get with remote=True)
    remote_failures: int = 0  # read-throughs cut short by a Redis error or timeout
    remote_corrupt: int = 0  # values read through that failed verification (deleted)
    remote_s: float = 0.0  # time spent reading through from Redis
