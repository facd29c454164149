"""The grant ring: cpu arena slots the daemon hands a client ahead of its puts, in the client's
staging segment (its header page, past the client's counters).

A client with grants writes a new block straight into its final arena slot (seqlocked, flags
READY, with its checksum) and names the slot in its put; the daemon checks the header and flips
it to VALID without touching the payload (kvtier/tiers/grants.py). Staging stays the path for
what finds no grant.

Layout at GRANT_OFF: base u64 | head u64 | epoch u64 | tail u64 | RING slots u32.
- The daemon writes slots[head % RING ...], then head (a later pwrite), never reads the slots:
  it keeps its own book of what it granted, and the page is the client's to scribble on.
- The client reads epoch, then base and head, takes slots[tail:head] and writes tail.
- A daemon that starts (a new epoch) writes base = head = where the old ring ended, then the
  epoch: a client that sees a new epoch drops the grants it held and reads on from base.
One writer per word; x86 keeps the stores in order, as the slot seqlock already assumes.
"""

from __future__ import annotations

import os
import struct

import numpy as np

GRANT_OFF = 2560
RING = 256
# A grant expires: the client starts no write into one it took from the ring more than
# GRANT_USE_S ago, and the daemon takes back one it has seen taken (the client's tail past it)
# more than GRANT_EXPIRE_S ago and not named by a put since (a put lost with the bus, a client
# that stopped putting). The gap is the longest a write may take without its slot being taken
# from under it. A grant still in the ring is never expired: the client may take it any time.
GRANT_USE_S = 20.0
GRANT_EXPIRE_S = 60.0
_HEAD = struct.Struct("<QQQQ")  # base head epoch tail
_BASE_HEAD = struct.Struct("<QQ")
_U64 = struct.Struct("<Q")
EPOCH_OFF = GRANT_OFF + 16
TAIL_OFF = GRANT_OFF + 24
SLOTS_OFF = GRANT_OFF + _HEAD.size


class GrantRing:
    """The client's end, on its own mapping of the staging segment."""

    def __init__(self, buf: memoryview) -> None:
        self._words = np.frombuffer(buf, dtype="<u8", count=4, offset=GRANT_OFF)
        self._slots = np.frombuffer(buf, dtype="<u4", count=RING, offset=SLOTS_OFF)

    @property
    def epoch(self) -> int:
        return int(self._words[2])

    def waiting(self) -> int:
        """Grants in the ring not taken yet (0 when the words make no sense): what
        StagingWriter.grants_waiting reports, for a caller waiting for the daemon's first grants."""
        words = self._words
        n = int(words[1]) - max(int(words[3]), int(words[0]))  # head - tail, from this daemon's base on
        return n if 0 < n <= RING else 0

    def take(self, known_epoch: int) -> tuple[int, list[int], bool]:
        """(epoch, slots granted since the last take, whether the epoch changed since
        `known_epoch`: then the caller drops what it held, which the old daemon granted)."""
        words = self._words
        epoch = int(words[2])  # first: a new epoch's base and head were written before it
        base, head, tail = int(words[0]), int(words[1]), int(words[3])
        renewed = epoch != known_epoch
        if renewed:
            tail = max(tail, base)
        n = head - tail
        if n <= 0 or n > RING:
            words[3] = max(tail, head) if n > RING or renewed else tail
            return epoch, [], renewed
        idx = np.arange(tail, head) % RING
        slots: list[int] = self._slots[idx].tolist()
        words[3] = head
        return epoch, slots, renewed


class RingFile:
    """The daemon's end, through the staging file's descriptor (never mapped: see
    kvtier/shm/staging_files.py). Every figure read from it is the client's and untrusted."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def state(self) -> tuple[int, int, int, int] | None:
        """(base, head, epoch, tail) as the page holds them now; None if the file shrank."""
        raw = os.pread(self.fd, _HEAD.size, GRANT_OFF)
        return _HEAD.unpack(raw) if len(raw) == _HEAD.size else None

    def begin(self, epoch: int) -> int | None:
        """This daemon's first use of the ring: start it afresh under `epoch` past whatever an
        earlier daemon granted. The head, or None if the file is unusable."""
        st = self.state()
        if st is None:
            return None
        _base, head, _epoch, tail = st
        start = max(head, tail) & ((1 << 62) - 1)  # any figure the client left: a start past it
        os.pwrite(self.fd, _BASE_HEAD.pack(start, start), GRANT_OFF)
        os.pwrite(self.fd, _U64.pack(epoch), EPOCH_OFF)
        return start

    def room(self, head: int) -> int:
        """How many more grants fit, given the daemon's own head; 0 when the client's tail makes
        no sense (behind the ring, or ahead of the head)."""
        raw = os.pread(self.fd, 8, TAIL_OFF)
        if len(raw) != 8:
            return 0
        (tail,) = _U64.unpack(raw)
        return RING - (head - tail) if 0 <= head - tail <= RING else 0

    def push(self, head: int, slots: list[int]) -> int:
        """Append `slots` (at most room()) after `head`: the slots first, then the new head."""
        raw = np.asarray(slots, dtype="<u4")
        pos = head % RING
        first = min(len(slots), RING - pos)  # up to the ring's end, then the rest from its start
        os.pwrite(self.fd, raw[:first].tobytes(), SLOTS_OFF + 4 * pos)
        if first < len(slots):
            os.pwrite(self.fd, raw[first:].tobytes(), SLOTS_OFF)
        head += len(slots)
        os.pwrite(self.fd, _U64.pack(head), GRANT_OFF + 8)
        return head
