"""What the client's calls answer, and what it counts."""

from __future__ import annotations

import enum
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


class DropReason(enum.StrEnum):
    """Why a put did not hand all its blocks over (`PutResult.reason`)."""

    NONE = ""  # every block was staged
    STAGING_FULL = "staging_full"  # no free staging slot: the daemon has not stored the earlier puts yet
    STAGING_TIMEOUT = "staging_timeout"  # still none when the put's `wait_s` ran out
    DAEMON_GONE = "daemon_gone"  # the daemon is not running
    BUS_UNREACHABLE = "bus_unreachable"  # the put event could not be published (the bus Redis)


@dataclass(frozen=True, slots=True)
class PutResult:
    """`staged` blocks were handed to the daemon: stored (visible) once it has verified them, and
    stored before a graceful stop completes. The leading `staged` blocks of the put, in order; the
    `dropped` rest were not handed over, for `reason`. (The daemon may still drop a staged block
    it has no room for: its `puts_dropped` counter.)"""

    staged: int
    dropped: int
    reason: DropReason = DropReason.NONE


@dataclass(slots=True)
class ReadCounts:
    """One read's own figures, for a caller that shares its client with other threads (where the
    client's running totals in ClientStats mix everyone's calls): pass one to get / get_with."""

    local: int = 0  # blocks read from this node's shared memory
    remote: int = 0  # blocks read straight from Redis


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
