"""What operators read (issue 25): sizes, a stopped daemon, the bench's note, throttled log lines,
the bus's summaries, and the client counters in a staging segment (real shared memory)."""

from __future__ import annotations

import os
import uuid

import structlog

from kvtier.bus.consumer import SUMMARY_S, _Summary
from kvtier.logs import LogThrottle
from kvtier.shm.segment import ShmSegment
from kvtier.shm.staging import CLIENT_COUNTS, CLIENT_COUNTS_OFF, MAX_COUNT_STEP, StagingWriter
from kvtier.shm.staging_files import StagingFile
from kvtier.status import human_bytes, liveness
from kvtier.tools.bench import idle_note
from kvtier.tools.bench_report import copy_note, render


def test_sizes_are_shown_in_the_unit_that_shows_them() -> None:
    assert [human_bytes(n) for n in (512, 8192, 12288, 1 << 20, 5 << 19, 3 << 30)] == \
        ["512 B", "8 KiB", "12 KiB", "1 MiB", "2.5 MiB", "3 GiB"]


def test_liveness_tells_a_stopped_or_silent_daemon_from_a_running_one() -> None:
    stats = {"pid": 42, "node": "n1", "written_at": 1000.0, "stats_interval_s": 1.0}
    assert liveness(stats, 1001.0, alive=True) is None
    assert liveness(stats, 1001.0, alive=False).startswith("daemon not running (last seen ")
    assert "pid 42, node n1" in liveness(stats, 1001.0, alive=False)
    assert liveness(stats, 1009.0, alive=True) is None, "under 10 s: not stale yet"
    assert liveness(stats, 1011.0, alive=True).startswith("daemon not writing its stats")
    slow = {**stats, "stats_interval_s": 5.0}
    assert liveness(slow, 1020.0, alive=True) is None and liveness(slow, 1026.0, alive=True) is not None


def test_the_bench_says_its_ratios_need_an_idle_machine() -> None:
    rows = [{"meets": True}, {"meets": None}]
    assert "otherwise idle machine (load average now 0.50 on 2 cores)" in idle_note(rows, 0.5, 2)
    assert "marked NO" not in idle_note(rows, 0.5, 2)
    assert "2 row(s) marked NO" in idle_note(rows + [{"meets": False}] * 2, 3.0, 2)


def test_the_bench_says_which_block_copy_ran() -> None:
    assert copy_note(True).startswith("Block copies: compiled (kvtier/shm/native/copy_hash.c")
    slow = copy_note(False)
    assert slow.startswith("Block copies: numpy and python-xxhash:")
    assert "did not build" in slow and "C compiler" in slow


def test_a_throttled_event_logs_once_then_a_count_per_interval() -> None:
    with structlog.testing.capture_logs() as logs:
        quiet = LogThrottle(structlog.get_logger(), every_s=3600)
        for _ in range(5):
            quiet.warning("redis.down", per="a", error="x")
        quiet.warning("redis.down", per="b", error="y")  # another kind: its own line
        quiet.info("put.dropped")
        quiet.info("put.dropped")
        quiet.flush()
        quiet.flush()  # nothing held back any more
    got = [(x["event"], x["log_level"], x.get("suppressed"), x.get("error")) for x in logs]
    assert got == [("redis.down", "warning", 0, "x"), ("redis.down", "warning", 0, "y"),
                   ("put.dropped", "info", 0, None), ("redis.down", "warning", 4, None),
                   ("put.dropped", "info", 1, None)]


def test_the_bus_summary_adds_up_batches_and_resets_once_a_minute() -> None:
    s = _Summary(since=0.0)
    assert s.add(10, 0, False, 2.0, 1.0) is None
    assert s.add(5, 1, True, 7.5, SUMMARY_S - 1) is None
    line = s.add(1, 0, False, 1.0, SUMMARY_S + 1)
    assert line == {"seconds": SUMMARY_S + 1, "batches": 3, "handled": 16, "dead": 1, "reclaimed": 1, "max_ms": 7.5}
    assert s.add(1, 0, False, 1.0, SUMMARY_S + 2) is None and s.batches == 1


def test_a_clients_drops_are_collected_once_and_its_word_is_bounded() -> None:
    node = f"ut-{uuid.uuid4().hex[:8]}"
    w = StagingWriter.create(node, 4, 4096, bytes(32), daemon_uid=os.geteuid(), shm_gid=None)
    f = StagingFile.open(w.seg.name)
    try:
        assert f.collect_drops() == (0, False)
        w.count_dropped(3)
        w.count_dropped(2)
        assert f.collect_drops() == (5, False)
        assert f.collect_drops() == (0, False), "counted once"
        again = StagingFile.open(w.seg.name)  # a restarted daemon: only what is new
        w.count_dropped(1)
        assert again.collect_drops() == (1, False)
        again.close()
        # Hostile values: a count that went back counts nothing; a huge step is capped.
        CLIENT_COUNTS.pack_into(w.seg.buf, CLIENT_COUNTS_OFF, 2, 6, 0)
        assert f.collect_drops() == (0, False)
        CLIENT_COUNTS.pack_into(w.seg.buf, CLIENT_COUNTS_OFF, 1 << 62, 0, 0)
        assert f.collect_drops() == (MAX_COUNT_STEP, False)
        # Closing with uncounted drops leaves the segment, marked closed, for the daemon.
        CLIENT_COUNTS.pack_into(w.seg.buf, CLIENT_COUNTS_OFF, 9, 6, 0)
        name = w.seg.name
        w.close()
        assert ShmSegment.exists(name)
        assert f.collect_drops() == (3, True)
    finally:
        f.close()
        ShmSegment.unlink_name(w.seg.name)
    quiet = StagingWriter.create(node, 4, 4096, bytes(32), daemon_uid=os.geteuid(), shm_gid=None)
    quiet.close()
    assert not ShmSegment.exists(quiet.seg.name), "nothing to count: unlinked at once"


def test_the_bench_shows_a_third_digit_where_two_would_round_a_miss_onto_its_target() -> None:
    rows = [{"path": p, "figure": "", "bound": "", "ratio": x, "target": t, "meets": ok}
            for p, x, t, ok in (("just under", 0.2981, ">= 0.3x", False), ("clear", 0.3241, ">= 0.3x", True),
                                ("just over", 1.996, "<= 2x", True), ("measured", 4.1049, "(measured)", None))]
    table = render(rows)
    assert "| just under |  |  | 0.298 | >= 0.3x | NO |" in table
    assert "| clear |  |  | 0.32 | >= 0.3x | yes |" in table
    assert "| just over |  |  | 1.996 | <= 2x | yes |" in table
    assert "| measured |  |  | 4.10 | (measured) | — |" in table
