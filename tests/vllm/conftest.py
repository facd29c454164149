"""Fixtures for the tests against a real vLLM (the CPU build, in .venv-vllm: `make test` runs them).

Without vLLM these tests fail at collection, never skip: a skipped engine test is not coverage.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "tests/vllm need vLLM: run them with .venv-vllm/bin/python -m pytest tests/vllm "
        "(make test-vllm creates that venv)") from e

from kvtier.tools.bench_env import pool_toml as bench_pool_toml
from kvtier.tools.daemon_process import DaemonProcess
from kvtier.tools.engine_logs import connector_count_lines
from kvtier.tools.engine_zygote import engine_zygote
from kvtier.tools.vllm_engine import TINY_POOL, EngineProcess, make_model
from kvtier.tools.vllm_engine import connector_config as engine_connector_config
from tests.support.daemon_proc import node_daemons
from tests.support.redis_proc import RedisProcess

# vLLM's CPU build binds each engine's worker process to one core, core 0 for every engine on a
# 2-core host, from its first import on: two test files side by side started their engines on one
# core while the other waited. Unbound, with the one OpenMP thread the binding gave it (so the same
# arithmetic), a worker runs where a core is free: two engines started at once were ready in 24.6 s
# rather than 29.2 s (stopped 7 s after rather than 9 s). The bench smoke test's engines inherit it.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's LLM runs in three processes by default on the CPU build: the caller, the engine core and
# its worker, each importing vLLM (about 6 s of CPU each here). In process (vLLM's documented
# switch), an engine is ready in 6 s rather than 17-19 s and stops in 1.7 s rather than 3.7 s:
# the suite took 212 s rather than 433 s. The connector's two halves then share one process, so
# the split that `vllm serve` runs, each half in its own process and the scheduler's metadata
# serialized to the worker, is kept where it is covered: test_connector_e2e.py's engines and
# test_serving_path_e2e.py's engine A (SEPARATE_PROCESSES: decode-block saves, pins, loads
# beside decoders), tensor parallelism (its two workers are processes either way) and the bench
# smoke test's AsyncLLM engines (always in their own processes).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
SEPARATE_PROCESSES = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default: engine core and worker apart

POOL = "tiny"
BS = 32  # vLLM block size = the pool's block_tokens
_rng = random.Random(7)
PREFIX = [_rng.randrange(3, 512) for _ in range(10 * BS)]  # ten full blocks shared by the P prompts


def _tail(n: int = 40) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


# P*: the shared prefix and a 40-token tail (360 tokens: 11 full blocks, the last one partial).
# Q*: unrelated prompts of the same shape.
PROMPTS = {"P1": PREFIX + _tail(), "P2": PREFIX + _tail(), "P3": PREFIX + _tail(),
           "Q1": _tail(360), "Q2": _tail(360)}


def connector_counts(log: str, half: str = "scheduler") -> dict[str, int]:
    """A connector half's last count line; {} when it logged none."""
    lines = connector_count_lines(log, half)
    return lines[-1] if lines else {}


def loaded(worker: dict[str, int], where: str) -> int | None:
    """The blocks a connector worker loaded in all (its counts), if all came from `where`
    ("local": this node's shared memory; "remote": Redis) and none failed; None otherwise. vLLM's
    `cached` counts what the connector promised, even when a load fails and vLLM recomputes. A
    hybrid's block counts once for each group's part."""
    n = worker.get("loaded_blocks")
    return n if n == worker.get(f"load_{where}_blocks") and "load_failed_blocks" not in worker else None


def pool_toml(name: str = POOL, cpu_blocks: int = 256, gpu_blocks: int = 64, **layout) -> str:
    return bench_pool_toml(name, {"model": "tiny-llama", **TINY_POOL, **layout}, "cpu", gpu_blocks, cpu_blocks)


def connector_config(pool: str, runtime_dir: Path, role: str = "kv_both", **extra) -> dict:
    """The connector's config for these tests, with its cost model off: on the tiny model
    recomputing a block costs about what loading it does, so the cost model (measured figures)
    may leave a load out, and a test of where blocks come from must see every one it could load.
    The cost model is tested on its own (tests/unit/test_load_cost.py,
    tests/integration/test_connector_loads.py)."""
    return engine_connector_config(pool, runtime_dir, role, **{"cost_model": False, **extra})


SHARED_WAIT_S = 600.0  # the longest a worker waits on another making a shared fixture (an engine run)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory this test session's xdist workers share (their own base directories' parent),
    or the session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def forked_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Engines forked from one process that has imported vLLM (kvtier/tools/engine_zygote.py): an
    in-process engine started in 2 s rather than 7-8 s here, vLLM's import being most of a start.
    The bench smoke test's engines fork from it too. Of an engine whose halves run apart
    (SEPARATE_PROCESSES, AsyncLLM) only the first process forks: vLLM spawns the engine core and
    its worker afresh, so the halves still meet across real process boundaries."""
    with engine_zygote(tmp_path_factory.getbasetemp() / "zygote.log"):
        yield


@pytest.fixture(scope="session")
def tiny_model(session_dir: Path) -> Path:
    """The tiny Llama, made once a session: every worker's engines run the same weights."""
    path = session_dir / "tiny-llama"
    with FileLock(f"{path}.lock", timeout=SHARED_WAIT_S):
        if not path.exists():  # made aside and renamed, so it is whole when it exists
            path.with_suffix(".tmp").mkdir(exist_ok=True)
            make_model(path.with_suffix(".tmp")).rename(path)
    return path


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, session_dir: Path) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no connector: what every run with kvtier must equal.
    Computed once a session, by the first worker that asks (an engine start costs about 25 s of
    CPU on 2 cores): the model and the prompts are fixed, so the outputs are too."""
    path = session_dir / "baseline.json"
    with FileLock(f"{path}.lock", timeout=SHARED_WAIT_S):
        if not path.exists():
            # A process of its own, not forked: what forked engines are held to (test_engine_zygote.py).
            with EngineProcess(tiny_model, session_dir / "baseline.log", prefix_caching=False, fork=False) as eng:
                out = {name: eng.generate(p)["tokens"] for name, p in PROMPTS.items()}
            path.with_suffix(".tmp").write_text(json.dumps({"prompts": PROMPTS, "outputs": out}))
            path.with_suffix(".tmp").rename(path)
        saved = json.loads(path.read_text())
    assert saved["prompts"] == PROMPTS, "the baseline was computed for other prompts"
    return saved["outputs"]


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A redis-server of this module's own (fault tests stop theirs)."""
    with RedisProcess.serving(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def node_factory(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisProcess
                 ) -> Iterator[Callable[..., DaemonProcess]]:
    """Real daemons ("nodes") on the module's Redis, writing blocks through to it at once so that
    another node finds them; each is stopped (or killed) at teardown."""
    with node_daemons(tmp_path_factory.mktemp("nodes"), module_redis.url, pool_toml) as make:
        yield make
