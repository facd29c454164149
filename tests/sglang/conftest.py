"""Fixtures for the tests against SGLang's own HiCache classes (.venv-sglang: `make test` runs them).

Without SGLang these tests fail at collection, never skip: a skipped engine test is not coverage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "tests/sglang need SGLang: run them with .venv-sglang/bin/python -m pytest tests/sglang "
        "(make test-sglang creates that venv)") from e

from kvtier.tools.daemon_process import DaemonProcess
from tests.sglang.host_pool import MHAHostPool
from tests.support.daemon_proc import node_daemons
from tests.support.redis_proc import RedisProcess

POOL = "sgl"
PAGE = 16  # SGLang's --page-size = the pool's block_tokens
LAYERS, HEADS, DIM = 2, 2, 32  # float16: 2 x 2 x 2 x 16 x 32 x 2 = 8 KiB per page


def pool_toml(name: str = POOL, block_tokens: int = PAGE, cpu_blocks: int = 256, layers: int = LAYERS,
              heads: int = HEADS) -> str:
    return f"""
[pools.{name}]
model = "sgl-test"
layers = {layers}
kv_heads = {heads}
head_dim = {DIM}
block_tokens = {block_tokens}
dtype = "float16"
device = "cpu"
gpu_blocks = 0
cpu_blocks = {cpu_blocks}
"""


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    with RedisProcess.serving(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def node_factory(tmp_path_factory: pytest.TempPathFactory, module_redis: RedisProcess
                 ) -> Iterator[Callable[..., DaemonProcess]]:
    """Real daemons ("nodes") on the module's Redis, writing through to it so that another node
    finds their blocks; each is stopped (or killed) at teardown."""
    with node_daemons(tmp_path_factory.mktemp("nodes"), module_redis.url, pool_toml) as make:
        yield make


def storage_config(runtime_dir: Path | str, *, tp_rank: int = 0, tp_size: int = 1, model: str = "org/model",
                   mla: bool = False, page_first: bool = True, **extra: Any) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds (_generate_storage_config), with our extra config.
    No SGLang scheduler publishes its server args here, so the weights' identity comes from the
    extra config: `model_path` (a checkpoint kvtier reads) or, by default, a weights_id per model."""
    if "model_path" not in extra:
        extra.setdefault("weights_id", f"test-weights:{model}")
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first, model_name=model,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierHiCacheStorage", "pool": POOL, "runtime_dir": str(runtime_dir),
                      "connect_timeout_s": 3.0, "call_timeout_s": 3.0, "remote_timeout_s": 1.0,
                      "retry_s": 0.2, **extra})


@pytest.fixture
def backend_factory() -> Iterator[Callable[..., Any]]:
    """Backends built as SGLang builds them: the factory, then register_mem_pool_host."""
    made: list[Any] = []

    def make(runtime_dir: Path | str, host: MHAHostPool | None = None, **kw: Any) -> Any:
        be = StorageBackendFactory.create_backend("dynamic", storage_config(runtime_dir, **kw), host)
        made.append(be)
        if host is not None:
            be.register_mem_pool_host(host)
        return be

    yield make
    for be in made:
        be.close()


def host_pool(pages: int = 16, layout: str = "page_first", page_size: int = PAGE) -> MHAHostPool:
    return MHAHostPool(pages * page_size, page_size, LAYERS, HEADS, DIM, layout=layout)
