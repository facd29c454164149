"""Engines forked from the zygote (kvtier/tools/engine_zygote.py, the session's `forked_engines`)
answer as an engine started afresh does, report how they ended, and an engine the zygote cannot
start as its own (another interpreter, another import environment) is refused, to start afresh."""

from __future__ import annotations

import os
import sys

from kvtier.tools.engine_zygote import ZYGOTE_ENV, ForkedEngine, fork_engine
from kvtier.tools.vllm_engine import EngineProcess
from tests.vllm.conftest import PROMPTS


def test_a_forked_engine_answers_as_one_started_afresh_and_exits_cleanly(tiny_model, baseline, tmp_path):
    with EngineProcess(tiny_model, tmp_path / "forked.log", prefix_caching=False) as e:
        assert isinstance(e.proc, ForkedEngine)
        assert e.proc.pid != os.getpid() and e.proc.poll() is None
        out = {name: e.generate(p)["tokens"] for name, p in PROMPTS.items()}
    assert out == baseline  # the baseline's engine was a process of its own (fork=False)
    assert e.proc.returncode == 0
    assert "KVTIER-READY" not in e.log_text()  # answers went to the driver, not the log


def test_a_killed_forked_engine_reports_the_signal(tiny_model, tmp_path):
    e = EngineProcess(tiny_model, tmp_path / "killed.log", prefix_caching=False)
    assert isinstance(e.proc, ForkedEngine)
    e.proc.kill()
    assert e.proc.wait(30) == -9
    e.stop()


def test_an_engine_of_another_interpreter_or_import_environment_is_refused(tmp_path):
    assert os.environ.get(ZYGOTE_ENV)
    cmd = [sys.executable, "-m", "kvtier.tools.vllm_engine", "serve", "--model", str(tmp_path)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}
    with open(tmp_path / "refused.log", "ab") as log:
        assert fork_engine(["/usr/bin/python3", *cmd[1:]], env, log) is None
        assert fork_engine(cmd, {**env, "VLLM_CPU_KVCACHE_SPACE": "4"}, log) is None
        assert fork_engine(cmd, {**env, "OMP_NUM_THREADS": "2"}, log) is None
    assert (tmp_path / "refused.log").read_bytes() == b""  # nothing was started
