"""Fixtures for the tests against a real vLLM (the CPU build, in .venv-vllm: `make test` runs them).

Without vLLM these tests fail at collection, never skip: a skipped engine test is not coverage.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "tests/vllm need vLLM: run them with .venv-vllm/bin/python -m pytest tests/vllm "
        "(make test-vllm creates that venv)") from e

from kvtier.tools.bench_env import pool_toml as bench_pool_toml
from kvtier.tools.daemon_process import DaemonProcess
from kvtier.tools.vllm_engine import TINY_POOL, EngineProcess, make_model
from kvtier.tools.vllm_engine import connector_config as engine_connector_config
from tests.support.daemon_proc import node_daemons
from tests.support.redis_proc import RedisProcess

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


def pool_toml(name: str = POOL, cpu_blocks: int = 256, gpu_blocks: int = 64, **layout) -> str:
    return bench_pool_toml(name, {"model": "tiny-llama", **TINY_POOL, **layout}, "cpu", gpu_blocks, cpu_blocks)


def connector_config(pool: str, runtime_dir: Path, role: str = "kv_both", **extra) -> dict:
    """The connector's config for these tests, with its cost model off: on the tiny model
    recomputing a block costs about what loading it does, so the cost model (measured figures)
    may leave a load out, and a test of where blocks come from must see every one it could load.
    The cost model is tested on its own (tests/unit/test_load_cost.py,
    tests/integration/test_connector_loads.py)."""
    return engine_connector_config(pool, runtime_dir, role, **{"cost_model": False, **extra})


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs of an engine with no connector: what every run with kvtier must equal."""
    log = tmp_path_factory.mktemp("engines") / "baseline.log"
    with EngineProcess(tiny_model, log, prefix_caching=False) as eng:
        return {name: eng.generate(p)["tokens"] for name, p in PROMPTS.items()}


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
