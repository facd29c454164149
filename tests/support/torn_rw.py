"""Writer and reader processes for the cross-process torn-read test (tests/integration/test_torn_reads.py).

    python -m tests.support.torn_rw writer ARENA CTRL BLOCK_BYTES SEED [FIRST_VERSION]
    python -m tests.support.torn_rw reader ARENA BLOCK_BYTES READS SEED DEADLINE_S [BATCH]

A reader with BATCH > 1 reads BATCH (slot, key) picks at a time through `SlotTable.read_rows`, the
clients' batch path, rather than one at a time through `read_into`.

Both print one JSON line of counters on stdout when done. Every payload is a function of (key,
version): u64 words [0, 4) hold the key, word 4 the version v, and word i >= 5 holds
BODY[key][i] ^ mix(v). So a reader can tell a correct block from a torn, stale or foreign one
with no side channel. Versions divisible by SHORT_EVERY are written one word short: the header's
length is then wrong and every read of them must miss.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

import numpy as np

from kvtier.shm.segment import ShmSegment
from kvtier.shm.slot_batch import read_rows
from kvtier.shm.slots import HEADER_OFF, SLOT_HDR, Kind, SlotTable, checksum

NKEYS = 6
SHORT_EVERY = 8
STOP_CHECK_EVERY = 256  # writes between looks at the stop flag
_U64 = (1 << 64) - 1

KEYS = [hashlib.sha256(b"kvtier/torn/%d" % i).digest() for i in range(NKEYS)]
KEY_INDEX = {k: i for i, k in enumerate(KEYS)}


def mix(v: int) -> int:
    return (v * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _U64


def bodies(block_bytes: int) -> list[np.ndarray]:
    words = block_bytes // 8
    out = []
    for i in range(NKEYS):
        rng = np.random.default_rng(1000 + i)
        b = rng.integers(0, _U64, words, dtype=np.uint64, endpoint=True)
        b[:4] = np.frombuffer(KEYS[i], dtype=np.uint64)
        out.append(b)
    return out


def _writer(arena: str, ctrl_name: str, block_bytes: int, seed: int, first_version: int = 0) -> dict:
    """Rewrites random slots with random keys until told to stop. Two writers on one arena (the
    daemon and a client writing a granted slot, or a client that keeps writing one) number
    their versions apart (`first_version`), so every payload still says who wrote it."""
    table = SlotTable.open(ShmSegment.attach(arena, writable=True), Kind.ARENA, block_bytes=block_bytes)
    ctrl = ShmSegment.attach(ctrl_name)
    body = bodies(block_bytes)
    buf = np.empty(block_bytes // 8, np.uint64)
    raw = buf.view(np.uint8)
    rng = random.Random(seed)
    v, short = first_version, 0
    while True:
        if v % STOP_CHECK_EVERY == 0 and ctrl.buf[0]:
            break
        v += 1
        slot = rng.randrange(table.n)
        ki = rng.randrange(NKEYS)  # a slot is reused for whichever key comes next
        np.bitwise_xor(body[ki], np.uint64(mix(v)), out=buf)
        buf[:4] = body[ki][:4]
        buf[4] = v
        if v % SHORT_EVERY:
            table.write(slot, KEYS[ki], raw)
        else:
            table.write(slot, KEYS[ki], raw[:-8])
            short += 1
    return {"writes": v - first_version, "short_writes": short}


def _pick(rng: random.Random, n: int, buf: memoryview, i: int) -> tuple[int, bytes]:
    """A slot, and the key to ask it for: every other read the key its header names right now
    (what a directory hint would say), else a key from the pool (usually not the one there)."""
    slot = rng.randrange(n)
    if i & 1:
        off = HEADER_OFF + SLOT_HDR * slot + 16
        return slot, bytes(buf[off : off + 32])
    return slot, KEYS[rng.randrange(NKEYS)]


def _reader(arena: str, block_bytes: int, reads: int, seed: int, deadline_s: float, batch: int = 1) -> dict:
    table = SlotTable.open(ShmSegment.attach(arena), Kind.ARENA, block_bytes=block_bytes)
    body = bodies(block_bytes)
    out = np.empty(block_bytes, np.uint8)
    out64 = out.view(np.uint64)
    tmp = np.empty_like(out64)
    raw = np.empty_like(out)
    raw64 = raw.view(np.uint64)
    buf = table.seg.buf
    payloads = table.payloads()
    rng = random.Random(seed)
    n = table.n
    c = dict(reads=0, ok=0, miss=0, hinted=0, hinted_ok=0, false=0, fresh=0, raw_checked=0, raw_torn=0)
    last_v = [0] * n
    false_examples: list[str] = []
    deadline = time.monotonic() + deadline_s
    i = 0
    rows = np.empty((batch, block_bytes), np.uint8)
    pending: list[tuple[int, bytes, int | None, np.ndarray]] = []  # batch mode: (slot, key, csum, bytes)
    while i < reads:
        if i % 4096 == 0 and time.monotonic() > deadline:
            break
        if batch > 1 and not pending:
            picks = [_pick(rng, n, buf, i + j) for j in range(batch)]
            got = read_rows(table, np.array([s for s, _ in picks], np.int64), [k for _, k in picks], rows,
                            range(batch))
            # The checksum a success verified is the slot's: recompute it from the copy below.
            pending = [(s, k, checksum(rows[j]) if ok else None, rows[j]) for j, ((s, k), ok) in
                       enumerate(zip(picks, got))][::-1]
        if batch > 1:
            slot, key, csum, got_bytes = pending.pop()
            np.copyto(out, got_bytes)
            hinted = bool(i & 1)
        else:
            slot, key = _pick(rng, n, buf, i)
            hinted = bool(i & 1)
            csum = table.read_into(slot, key, out)
        c["hinted"] += hinted
        i += 1
        if csum is None:
            c["miss"] += 1
            if i % 16 == 0:
                # Control: an unprotected copy of the same slot. Torn copies seen here show the
                # writer really was overwriting slots under the readers.
                np.copyto(raw, payloads[slot, :block_bytes])
                c["raw_checked"] += 1
                rk = KEY_INDEX.get(bytes(raw[:32]))
                if rk is not None:
                    np.bitwise_xor(raw64, body[rk], out=tmp)
                    if not (tmp[5:-1] == np.uint64(mix(int(raw64[4])))).all():
                        c["raw_torn"] += 1
            continue
        c["ok"] += 1
        c["hinted_ok"] += hinted
        v = int(out64[4])
        ki = KEY_INDEX.get(key)
        good = ki is not None and v > 0 and v % SHORT_EVERY != 0 and bytes(out[:32]) == key
        if good:
            good = csum == checksum(out)
        if good:
            np.bitwise_xor(out64, body[ki], out=tmp)
            good = bool((tmp[5:] == np.uint64(mix(v))).all())
        if not good:
            c["false"] += 1
            if len(false_examples) < 5:
                false_examples.append(f"slot {slot} key {key.hex()[:16]} version {v}")
        elif v != last_v[slot]:
            c["fresh"] += 1  # a success on a version this reader had not seen in this slot
            last_v[slot] = v
    c["reads"] = i
    c["false_examples"] = false_examples
    return c


def main(argv: list[str]) -> None:
    if argv[0] == "writer":
        res = _writer(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]) if len(argv) > 5 else 0)
    else:
        res = _reader(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), float(argv[5]),
                      int(argv[6]) if len(argv) > 6 else 1)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
