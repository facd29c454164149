"""kvtier's KV events decoded with vLLM's own classes (vllm.distributed.kv_events, vLLM 0.32):
what llm-d's indexer and Dynamo's router read from a vLLM engine, read here from kvtier."""

from __future__ import annotations

import shutil

import msgspec
import pytest
import torch
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvtier.client import SyncClient
from kvtier.core.kv_events import block_hash
from tests.support.kv_events import Subscriber, endpoints, events_toml, replay
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL


@pytest.fixture
def ipc():
    pub, rep, d = endpoints()
    yield pub, rep
    shutil.rmtree(d, ignore_errors=True)


def test_vllm_decodes_every_field(node_factory, ipc) -> None:
    pub, rep = ipc
    node = node_factory("evv", extra=events_toml(pub, rep))
    decode = msgspec.msgpack.Decoder(type=KVEventBatch)
    sub = Subscriber(pub)
    try:
        first = decode.decode(replay(rep, 0)[0][2])
        assert isinstance(first, KVEventBatch) and first.data_parallel_rank == 0 and first.ts > 0
        assert first.events == [AllBlocksCleared()]
        with SyncClient(node.runtime_dir) as c:
            tokens = [7 + i for i in range(BS * 3)]
            keys = c.block_keys(POOL, tokens, salt=b"vllm-events")
            p = c.pool(POOL)
            assert c.put(POOL, keys, torch.zeros((3, *p.shape), dtype=p.dtype), token_ids=tokens).staged == 3
            hashes = [block_hash(k) for k in keys]

            def stored(evs, medium):
                return [e for e in evs if isinstance(e, BlockStored) and e.medium == medium]

            def batches():
                sub.drain()
                return [decode.decode(m[2]) for m in sub.messages]

            def both_media():
                evs = [e for b in batches() for e in b.events]
                cpu, redis = stored(evs, MEDIUM_CPU), stored(evs, MEDIUM_STORAGE)
                full = sum(len(e.block_hashes) for e in cpu) >= 3 and sum(len(e.block_hashes) for e in redis) >= 3
                return (evs, cpu, redis) if full else None

            evs, cpu, redis = wait_until(both_media, 15, message="BlockStored for CPU and STORAGE")
        for e in cpu + redis:
            assert e.block_size == BS and e.lora_id is None and e.lora_name is None
            assert len(e.token_ids) == BS * len(e.block_hashes)
            assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in e.block_hashes)
        assert [h for e in cpu for h in e.block_hashes][:3] == hashes
        assert [t for e in cpu for t in e.token_ids][:BS * 3] == tokens
        assert cpu[0].parent_block_hash is None
        assert all(isinstance(b.ts, float) and b.data_parallel_rank == 0 for b in batches())
        assert all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in evs)
    finally:
        sub.close()


def test_a_real_engine_publishes_and_where_names_it(node_factory, tiny_model, tmp_path, ipc) -> None:
    """vLLM on CPU with --kv-events-config: kvtier ingests its events, and `where` names that engine
    (tier engine) for the prompt's full blocks."""
    from kvtier.tools.vllm_engine import EngineProcess
    from tests.vllm.conftest import PROMPTS

    pub, rep = ipc
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": rep,
              "topic": "kv@test@tiny"}
    node = node_factory("evi", extra=f'[prefix_index]\nenabled = true\n[ingest]\nengines = "vllm0 {pub} {rep}"\n'
                                     f'pool = "{POOL}"\n')
    prompt = PROMPTS["P1"]  # 11 full blocks of 32 tokens, and a partial one
    with EngineProcess(tiny_model, tmp_path / "engine.log", kv_events_config=events) as eng:
        eng.generate(prompt)
        with SyncClient(node.runtime_dir) as c:
            keys = c.block_keys(POOL, prompt)
            holder = f"{node.node}/vllm0"

            def named():
                w = c.where(POOL, keys)
                return any(r.node == holder and r.length == len(keys) and set(r.tiers) == {"engine"} for r in w.nodes)

            wait_until(named, 60, interval=0.2, message="where names the engine for the whole prompt")
