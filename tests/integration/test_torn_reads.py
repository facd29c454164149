"""Torn reads across processes: two writer processes keep rewriting the same slots of a real
shared-memory arena at once, reusing each slot for different keys, while three reader processes
read it as fast as they can through `SlotTable.read_into`, and one of them in batches through
`SlotTable.read_rows` (the clients' get path). Two writers per slot is what granted slots allow
(kvtier/tiers/grants.py): a client writes its granted slot while the daemon flips or empties it,
or a client keeps writing one it no longer holds. Any read that reports success must return exactly the block
it asked for: right key, full length, matching checksum, and the bytes the writer wrote for that
(key, version). The worker processes live in tests/support/torn_rw.py.

KVTIER_TORN_READS sets the total number of reads (default 10**6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.layout import BlockLayout
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable, segment_bytes
from tests.support.torn_rw import SHORT_EVERY
from tests.support.waiting import wait_until

READS = int(os.environ.get("KVTIER_TORN_READS", 1_000_000))
READERS = 3
BATCHES = (1, 8, 1)  # reads per call: the middle reader goes through read_rows
SLOTS = 4
SECOND_WRITER_FROM = 1 << 40  # the second writer's versions start here
BLOCK_BYTES = 8 << 10  # the integration pool's block size
READ_DEADLINE_S = max(40.0, READS / 20_000)  # far above the measured rate; a stall fails, not hangs
ROOT = Path(__file__).resolve().parents[2]
PREFIX = f"kvtier.test-torn-{uuid.uuid4().hex[:8]}."


def _spawn(*args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.support.torn_rw", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out)


@pytest.mark.slow
def test_no_false_success_under_a_rewriting_writer_process() -> None:
    fp = BlockLayout("m", 2, 2, 32, 16, "float16").fingerprint
    arena = ShmSegment.create(PREFIX + "arena", segment_bytes(SLOTS, BLOCK_BYTES))
    ctrl = ShmSegment.create(PREFIX + "ctrl", 4096)  # byte 0: the writer's stop flag
    table = SlotTable.format(arena, Kind.ARENA, SLOTS, BLOCK_BYTES, fp)
    procs: list[subprocess.Popen] = []
    try:
        writer = _spawn("writer", arena.name, ctrl.name, BLOCK_BYTES, 7)
        second = _spawn("writer", arena.name, ctrl.name, BLOCK_BYTES, 8, SECOND_WRITER_FROM)
        procs += [writer, second]
        # Readers start once every slot has been written a few times, so none reads an empty arena.
        wait_until(lambda table=table: min(table.gen(s) for s in range(SLOTS)) >= 6 or writer.poll() is not None,
                   timeout=30, message="the writer has filled every slot")
        assert writer.poll() is None and second.poll() is None, (writer.stderr.read(), second.stderr.read())
        per_reader = -(-READS // READERS)
        readers = [_spawn("reader", arena.name, BLOCK_BYTES, per_reader, 100 + i, READ_DEADLINE_S, batch)
                   for i, batch in enumerate(BATCHES)]
        procs += readers
        results = [_result(r, READ_DEADLINE_S + 30) for r in readers]
        ctrl.buf[0] = 1
        w, w2 = _result(writer, 30), _result(second, 30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del table
        for seg in (arena, ctrl):
            seg.close()
            seg.unlink()

    total = {k: sum(r[k] for r in results) for k in results[0] if k != "false_examples"}
    print(f"torn reads: {total} writers: {w} {w2}")
    examples = [e for r in results for e in r["false_examples"]]
    assert total["reads"] >= READS, f"only {total['reads']} reads before the deadline: {total}"
    assert total["false"] == 0, f"{total['false']} false successes, e.g. {examples}"
    # The race was real: reads succeeded and missed, successes saw many different versions,
    # the writer reused slots for other keys thousands of times, and unprotected copies of
    # the same slots came out torn.
    assert total["ok"] > 0 and total["miss"] > 0 and total["hinted_ok"] > 0, total
    assert total["fresh"] >= 1000, total
    for x in (w, w2):
        assert x["writes"] >= 10_000 and x["short_writes"] == x["writes"] // SHORT_EVERY, x
    assert total["raw_torn"] > 0, total
    batched = results[BATCHES.index(8)]
    assert batched["ok"] > 0 and batched["miss"] > 0 and batched["false"] == 0, batched
    assert not any(p.name.startswith(PREFIX) for p in Path("/dev/shm").iterdir())
