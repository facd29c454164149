"""DaemonProcess.log_events, which the fault tests count the daemon's log lines with: a line being
written as they read (no newline yet) and a line a SIGKILL tore are left out, not an error."""

from __future__ import annotations

import json

from kvtier.tools.daemon_process import DaemonProcess


def test_complete_lines_are_parsed_and_a_line_still_being_written_is_left_out(tmp_path):
    log = tmp_path / "daemon.log"
    d = DaemonProcess(None, tmp_path, log_path=log)
    assert d.log_events() == []  # no log yet
    first, second = {"event": "daemon.ready", "n": 1}, {"event": "arena.reattached", "discarded": 2}
    log.write_text(json.dumps(first) + "\n" + "not json: the tools' own lines\n" + json.dumps(second) + "\n"
                   + '{"node": "n-0", "po')
    assert d.log_events() == [first, second]
    with log.open("a") as f:
        f.write('ol": "t", "event": "pool.up"}\n')
    assert d.log_events() == [first, second, {"node": "n-0", "pool": "t", "event": "pool.up"}]


def test_a_line_torn_by_a_kill_is_skipped(tmp_path):
    log = tmp_path / "daemon.log"
    log.write_text('{"event": "a"}\n{"event": "torn by SIG\n{"event": "b"}\n')
    assert [x["event"] for x in DaemonProcess(None, tmp_path, log_path=log).log_events()] == ["a", "b"]
