"""Engines forked from the zygote (kvtier/tools/engine_zygote.py, the session's `forked_engines`)
answer as an engine started afresh does, report how they ended, outlive a zygote that dies, and an
engine the zygote cannot start as its own (another interpreter, another environment) is refused,
to start afresh, with nothing left open."""

from __future__ import annotations

import os
import signal
import sys

from kvtier.tools.engine_zygote import ENGINE_ENV, ZYGOTE_ENV, ForkedEngine, engine_zygote, fork_engine
from kvtier.tools.vllm_engine import EngineProcess
from tests.vllm.conftest import PROMPTS


def test_a_forked_engine_answers_as_one_started_afresh_and_exits_cleanly(tiny_model, baseline, tmp_path):
    with EngineProcess(tiny_model, tmp_path / "forked.log", prefix_caching=False) as e:
        assert isinstance(e.proc, ForkedEngine)
        assert e.proc.poll() is None
        out = {name: e.generate(p)["tokens"] for name, p in PROMPTS.items()}
    assert out == baseline  # the baseline's engine was a process of its own (fork=False)
    assert e.proc.returncode == 0
    assert "KVTIER-READY" not in e.log_text()  # answers went to the driver, not the log


def test_a_killed_forked_engine_reports_the_signal(tiny_model, tmp_path):
    e = EngineProcess(tiny_model, tmp_path / "killed.log", prefix_caching=False)
    assert isinstance(e.proc, ForkedEngine)
    e.proc.kill()
    assert e.proc.wait(30) == -signal.SIGKILL
    e.stop()


def test_an_engine_of_another_interpreter_or_environment_is_refused_with_nothing_left_open(tmp_path):
    assert os.environ.get(ZYGOTE_ENV)
    cmd = [sys.executable, "-m", "kvtier.tools.vllm_engine", "serve", "--model", str(tmp_path / "no-model")]
    env = {**os.environ, **ENGINE_ENV}
    before = open_fds()
    with open(tmp_path / "refused.log", "ab") as log:
        assert fork_engine(["/usr/bin/python3", *cmd[1:]], env, log) is None
        assert fork_engine(cmd, {**env, "VLLM_CPU_KVCACHE_SPACE": "4"}, log) is None
        assert fork_engine(cmd, {**env, "OMP_NUM_THREADS": "2"}, log) is None
        assert opened_since(before) == {log.fileno()}, "the log alone"
        assert (tmp_path / "refused.log").read_bytes() == b""  # nothing was started
        # The control: the same request in this environment forks (and fails on the missing
        # model, which its status says).
        forked = fork_engine(cmd, env, log)
        assert isinstance(forked, ForkedEngine)
        assert forked.wait(120) not in (None, 0)
        forked.stdin.close()
        forked.stdout.close()
    assert opened_since(before) == set()
    assert b"no-model" in (tmp_path / "refused.log").read_bytes()


def test_an_engine_outlives_its_zygote_and_still_stops_when_told(tiny_model, tmp_path):
    with engine_zygote(tmp_path / "zygote.log") as z:  # a zygote of this test's own, killed below
        e = EngineProcess(tiny_model, tmp_path / "orphan.log", prefix_caching=False)
        assert isinstance(e.proc, ForkedEngine)
        z.proc.kill()
        z.proc.wait()
        assert e.proc.poll() is None  # the zygote's end is not the engine's
        assert e.generate(PROMPTS["Q1"])["tokens"]
        e.stop()  # stdin closed: the engine ends, its status lost with the zygote
        assert e.proc.returncode == -1


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each names."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own, another thread's)
            continue
    return out


def opened_since(before: dict[int, str]) -> set[int]:
    """Descriptors open now that were not, or named something else, in `before`: what a call
    left open. (Counting them instead failed once: something else in the test process closed
    two descriptors meanwhile.)"""
    return {fd for fd, target in open_fds().items() if before.get(fd) != target}
