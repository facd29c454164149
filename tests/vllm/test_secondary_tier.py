"""KvtierSecondaryTier against real parts: vLLM's factory, manager classes and shared offload
region, real `kvtier daemon` processes and a real redis-server. The only stand-in is vLLM's spec
object (a MagicMock whose .config is a real OffloadingConfig), as in vLLM's own test_fs_tier.py."""

from __future__ import annotations

import hashlib
import os
import uuid
from unittest.mock import MagicMock

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.integrations.vllm.secondary_tier import KvtierSecondaryTier
from kvtier.runtime import DESCRIPTOR, read_json
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable
from kvtier.store.redis_blocks import redis_block_key
from tests.support.checkpoints import copy_checkpoint, write_checkpoint
from tests.support.waiting import wait_until

CHUNK = 64 << 10  # bytes per vLLM offload chunk in these tests (a page multiple, as vLLM needs)
NUM_CHUNKS = 16
POOL = "vchunks"
POOLS_TOML = f"""
[pools.{POOL}]
model = "vllm-chunks"
dtype = "uint8"
layers = 1
kv_heads = 1
block_tokens = 1
head_dim = {CHUNK // 2}
device = "cpu"
gpu_blocks = 0
cpu_blocks = 64

[pools.small]
model = "vllm-chunks"
dtype = "uint8"
layers = 1
kv_heads = 1
block_tokens = 1
head_dim = 512
device = "cpu"
gpu_blocks = 0
cpu_blocks = 8
"""
WRITE_THROUGH = '[policy]\nredis_write = "write-through"\n'  # stored chunks reach Redis at once
TIER = {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm.secondary_tier"}
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_spec(events: bool = False, model: str = "test-model") -> MagicMock:
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=events, extra_config={},
        engine_id="test-engine", model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(enable_kv_cache_events=events, self_describing_kv_events=False)
    return spec


def okey(i: int, salt: str = "") -> bytes:
    return make_offload_key(hashlib.sha256(f"{salt}block-{i}".encode()).digest(), 0)


def chunk_bytes(view: memoryview, cid: int) -> bytes:
    return np.asarray(view).view(np.uint8)[cid].tobytes()


def fill(view: memoryview, cids, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for cid in cids:
        data = rng.integers(0, 256, CHUNK, dtype=np.uint8)
        np.asarray(view).view(np.uint8)[cid] = data
        out.append(data.tobytes())
    return out


def job(job_id: int, keys, cids, load: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys), chunk_ids=np.array(cids, dtype=np.int64), is_promotion=load,
                       req_context=ReqContext(req_id="jobs"))


def finish(tier, n: int = 1, timeout: float = 15.0) -> list:
    got: list = []

    def poll() -> bool:
        got.extend(tier.get_finished_jobs())
        return len(got) >= n

    wait_until(poll, timeout=timeout, message=f"{n} finished job(s)")
    return sorted(got, key=lambda r: r.job_id)


def resolve(tier, keys, timeout: float = 10.0) -> list[LookupResult]:
    """Look up as vLLM's scheduler does: a step at a time, until no answer is RETRY."""
    ctx = ReqContext(req_id=f"lookup-{uuid.uuid4().hex[:6]}")
    try:
        def answers():
            res = [tier.lookup(k, ctx) for k in keys]
            tier.on_schedule_end(STEP)
            return res if LookupResult.RETRY not in res else None

        return wait_until(answers, timeout=timeout, message="lookups resolved")
    finally:
        tier.on_request_finished(ctx)


@pytest.fixture
def primaries():
    """Real vLLM primary regions (/dev/shm/vllm_offload_<engine>.mmap), released at the end."""
    made: list[tuple[SharedOffloadRegion, memoryview]] = []

    def make() -> memoryview:
        region = SharedOffloadRegion(engine_id=f"kvtier-test-{uuid.uuid4().hex[:8]}", num_chunks=NUM_CHUNKS,
                                     rank=None, kv_bytes_per_chunk=CHUNK, cpu_page_size=CHUNK)
        view = region.create_kv_memoryview()
        made.append((region, view))
        return view

    yield make
    for region, view in made:
        try:
            view.release()
        except BufferError:
            pass
        region.cleanup()


@pytest.fixture
def tiers():
    made: list[KvtierSecondaryTier] = []

    def make(view: memoryview, runtime_dir, spec=None, **kw) -> KvtierSecondaryTier:
        """A tier as vLLM's factory builds it. Its spec names no checkpoint on disk ("test-model"),
        so the weights' identity is the operator's weights_id unless a test passes weights_id=None
        (then the spec's model must be a checkpoint directory)."""
        cfg = {**TIER, "pool": POOL, "runtime_dir": str(runtime_dir), "store_timeout_s": 5.0,
               "weights_id": "test-weights", **kw}
        if cfg["weights_id"] is None:
            del cfg["weights_id"]
        tier = SecondaryTierFactory.create_secondary_tier(cfg, view, spec or make_spec())
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.shutdown()


def store_through(tier, keys, cids, redis_server) -> None:
    """Store chunks through `tier` (a node under WRITE_THROUGH) and wait until Redis holds them."""
    tier.submit_store(job(1, keys, cids, load=False))
    assert finish(tier)[0].success
    r = redis_server.client()
    try:
        wait_until(lambda: all(r.exists(redis_block_key(POOL, tier.keys(k))) for k in keys), timeout=10,
                   message="the chunks written through to redis")
    finally:
        r.close()


def test_factory_store_then_load_into_other_chunks(daemon_factory, primaries, tiers):
    d = daemon_factory(node="a", pools_toml=POOLS_TOML)
    view = primaries()
    tier = tiers(view, d.runtime_dir, make_spec(events=True), enable_kv_events=True, locality="LOCAL")
    assert isinstance(tier, KvtierSecondaryTier) and tier.available and tier.medium is Medium.STORAGE
    keys = [okey(i) for i in range(4)]
    data = fill(view, [0, 1, 2, 3], seed=1)

    tier.submit_store(job(1, keys, [0, 1, 2, 3], load=False))
    (res,) = finish(tier)
    assert res.success and res.transfer_bytes == 4 * CHUNK
    (event,) = list(tier.take_events())
    assert event.medium is Medium.STORAGE and event.locality is Locality.LOCAL and not event.removed
    assert event.keys == keys
    assert tier.lookup(keys[0], ReqContext(req_id="r")) is LookupResult.HIT  # resident here: no round trip

    # Load into other chunk ids, not consecutive (two runs), in another order.
    fill(view, range(8, 16), seed=99)
    tier.submit_load(job(2, [keys[2], keys[0], keys[1], keys[3]], [8, 10, 11, 12], load=True))
    (res,) = finish(tier)
    assert res.success and res.successful_keys is None
    assert [chunk_bytes(view, c) for c in (8, 10, 11, 12)] == [data[2], data[0], data[1], data[3]]

    # A key never stored: the lookup misses (after a background round trip), a load of it fails,
    # and in a mixed job the other chunk still loads and is reported on its own.
    missing = okey(1000)
    assert resolve(tier, [missing, keys[1]]) == [LookupResult.MISS, LookupResult.HIT]
    tier.submit_load(job(3, [missing], [13], load=True))
    tier.submit_load(job(4, [keys[3], missing], [14, 15], load=True))
    r3, r4 = finish(tier, 2)
    assert not r3.success and r3.successful_keys is None
    assert not r4.success and list(r4.successful_keys) == [keys[3]]
    assert chunk_bytes(view, 14) == data[3]
    assert tier.lookup(missing, ReqContext(req_id="r2")) is LookupResult.MISS  # remembered: no re-promotion
    c = tier.counters.snapshot()
    assert c["store_chunks_ok"] == 4 and c["load_chunks_ok"] == 5 and c["load_chunks_failed"] == 2
    stats = tier.get_stats()
    assert stats is not None and not stats.is_empty() and tier.get_stats() is None  # deltas, then nothing new
    defs = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [{**TIER, "pool": POOL}]})
    assert set(stats.data["data"]) <= set(defs)  # vLLM can export every counter the tier reports


def test_a_second_node_loads_the_chunks_through_redis(daemon_factory, primaries, tiers, redis_server):
    a = daemon_factory(node="a", pools_toml=POOLS_TOML, extra=WRITE_THROUGH)
    b = daemon_factory(node="b", pools_toml=POOLS_TOML, extra=WRITE_THROUGH)
    view_a, view_b = primaries(), primaries()
    tier_a, tier_b = tiers(view_a, a.runtime_dir), tiers(view_b, b.runtime_dir)
    keys = [okey(i, "xnode") for i in range(5)]
    data = fill(view_a, range(5), seed=2)
    store_through(tier_a, keys, range(5), redis_server)
    assert tier_b.keys(keys[0]) == tier_a.keys(keys[0])  # same deployment, same namespace: same key
    assert resolve(tier_b, keys) == [LookupResult.HIT] * 5  # not local on b: found in Redis

    tier_b.submit_load(job(7, keys, [11, 12, 13, 14, 15], load=True))
    (res,) = finish(tier_b)
    assert res.success
    assert [chunk_bytes(view_b, c) for c in range(11, 16)] == data
    assert tier_b.counters.snapshot()["load_chunks_prefetched"] == 5
    assert tier_b.lookup(keys[0], ReqContext(req_id="again")) is LookupResult.HIT  # now resident on b


def test_the_weights_decide_not_the_models_name(daemon_factory, primaries, tiers, tmp_path):
    """The tier's key holds the checkpoint's content, read from the directory vLLM names: other
    weights share no chunk; the same weights in another directory share every one; weights it
    cannot read are refused at start (vLLM's start fails with the fix), never keyed by name."""
    d = daemon_factory(node="a", pools_toml=POOLS_TOML)
    a = write_checkpoint(tmp_path / "a", seed=1)
    copy = copy_checkpoint(a, tmp_path / "elsewhere")
    b = write_checkpoint(tmp_path / "b", seed=2)
    view = primaries()
    tier_a = tiers(view, d.runtime_dir, make_spec(model=str(a)), weights_id=None)
    tier_b = tiers(primaries(), d.runtime_dir, make_spec(model=str(b)), weights_id=None)
    tier_copy = tiers(primaries(), d.runtime_dir, make_spec(model=str(copy)), weights_id=None)
    keys = [okey(i, "weights") for i in range(3)]
    fill(view, range(3), seed=5)
    tier_a.submit_store(job(1, keys, range(3), load=False))
    assert finish(tier_a)[0].success
    assert resolve(tier_copy, keys) == [LookupResult.HIT] * 3
    assert resolve(tier_b, keys) == [LookupResult.MISS] * 3
    assert tier_b.keys(keys[0]) != tier_a.keys(keys[0]) == tier_copy.keys(keys[0])
    with pytest.raises(ValueError, match="set weights_id in the tier's options"):
        tiers(primaries(), d.runtime_dir, make_spec(model="org/not-cached"), weights_id=None)


def test_more_chunks_than_the_node_holds_go_through_redis_and_come_back(daemon_factory, primaries, tiers):
    """A cpu tier of 8 chunks, 16 stored: the daemon writes what has no local room to Redis (or
    sheds it there); each comes back, byte-exact, through a prefetch on the same node."""
    d = daemon_factory(node="a", pools_toml=POOLS_TOML.replace("cpu_blocks = 64", "cpu_blocks = 8"))
    view = primaries()
    tier = tiers(view, d.runtime_dir)
    keys = [okey(i, "spill") for i in range(NUM_CHUNKS)]
    data = fill(view, range(NUM_CHUNKS), seed=6)
    tier.submit_store(job(1, keys, range(NUM_CHUNKS), load=False))
    assert finish(tier)[0].success
    for i in range(0, NUM_CHUNKS, 2):
        fill(view, [0, 1], seed=100 + i)
        tier.submit_load(job(10 + i, keys[i:i + 2], [0, 1], load=True))
        assert finish(tier)[0].success, f"chunks {i}, {i + 1}"
        assert [chunk_bytes(view, 0), chunk_bytes(view, 1)] == data[i:i + 2]
    assert tier.counters.snapshot()["load_chunks_prefetched"] > 0


def test_a_resident_chunk_that_fails_its_read_comes_from_redis_instead(daemon_factory, primaries, tiers, redis_server):
    """A chunk the lookup found here but whose read fails (evicted meanwhile to make room for a
    sibling's promote, or its bytes damaged: simulated by flipping a byte of its slot) is read
    through from Redis within the job: the load succeeds, byte-exact, and the failure is counted."""
    d = daemon_factory(node="a", pools_toml=POOLS_TOML, extra=WRITE_THROUGH)
    view = primaries()
    tier = tiers(view, d.runtime_dir)
    keys = [okey(i, "reread") for i in range(3)]
    data = fill(view, range(3), seed=8)
    store_through(tier, keys, range(3), redis_server)
    pool = read_json(d.runtime_dir / DESCRIPTOR)["pools"][POOL]
    seg = ShmSegment.attach(f"kvtier.{d.node}.{POOL}.cpu", writable=True, trusted_uid=os.geteuid())
    table = SlotTable.open(seg, Kind.ARENA, bytes.fromhex(pool["fingerprint"]), pool["block_bytes"])
    try:
        want = tier.keys(keys[1])
        slots = [s for s in range(table.n) if bytes(table.headers(s, s + 1)["key"][0]) == want]
        assert len(slots) == 1, "chunk 1 resident in exactly one slot"
        table.payload(slots[0])[7] ^= 0xFF
    finally:
        table.close()
    fill(view, range(8, 11), seed=98)
    tier.submit_load(job(2, keys, [8, 9, 10], load=True))
    (res,) = finish(tier)
    assert res.success, res
    assert [chunk_bytes(view, c) for c in (8, 9, 10)] == data
    assert tier.counters.snapshot()["read_failures"] == 1


def test_a_pool_of_the_wrong_size_or_name_is_a_clear_error(daemon_factory, primaries, tiers):
    d = daemon_factory(node="a", pools_toml=POOLS_TOML)
    view = primaries()
    with pytest.raises(ValueError, match=r"1024 bytes.*65536 bytes") as e:
        tiers(view, d.runtime_dir, pool="small")
    assert 'dtype = "uint8"' in str(e.value) and f"head_dim = {CHUNK // 2}" in str(e.value)
    with pytest.raises(ValueError, match="'nope' is not served"):
        tiers(view, d.runtime_dir, pool="nope")


def test_daemon_down_means_misses_and_failed_jobs_then_it_recovers(daemon_factory, primaries, tiers):
    d = daemon_factory(node="a", pools_toml=POOLS_TOML, start=False)
    view = primaries()
    keys = [okey(i, "down") for i in range(3)]
    data = fill(view, range(3), seed=3)

    tier = tiers(view, d.runtime_dir)  # no daemon yet: the tier starts, degraded
    assert not tier.available
    assert tier.lookup(keys[0], ReqContext(req_id="r")) is LookupResult.MISS
    tier.submit_store(job(1, keys, range(3), load=False))
    assert not finish(tier)[0].success

    d.start()
    wait_until(lambda: tier.available, timeout=10, message="the tier reconnects")
    tier.submit_store(job(2, keys, range(3), load=False))
    assert finish(tier)[0].success

    d.kill()
    wait_until(lambda: not tier.available, timeout=5, message="the tier notices the daemon is gone")
    assert tier.lookup(keys[0], ReqContext(req_id="r2")) is LookupResult.MISS  # though still in the mapped arena
    tier.submit_load(job(3, keys, [8, 9, 10], load=True))
    tier.submit_store(job(4, keys, range(3), load=False))
    assert [r.success for r in finish(tier, 2)] == [False, False]
    assert tier.counters.snapshot()["daemon_unavailable"] >= 3

    d.start()  # a warm restart re-attaches the arena
    wait_until(lambda: tier.available, timeout=10, message="the tier follows the restart")
    tier.submit_load(job(5, keys, [8, 9, 10], load=True))
    assert finish(tier)[0].success
    assert [chunk_bytes(view, c) for c in (8, 9, 10)] == data


def test_redis_outage_fails_jobs_and_misses_without_raising(daemon_factory, primaries, tiers, redis_server):
    d = daemon_factory(node="a", pools_toml=POOLS_TOML)
    view = primaries()
    tier = tiers(view, d.runtime_dir, lookup_timeout_s=3.0)
    fill(view, range(2), seed=4)
    redis_server.stop(kill=True)
    try:
        tier.submit_store(job(1, [okey(1, "outage"), okey(2, "outage")], [0, 1], load=False))
        assert not finish(tier)[0].success  # the put event cannot be published
        assert resolve(tier, [okey(3, "outage")]) == [LookupResult.MISS]
        assert tier.counters.snapshot()["redis_errors"] >= 1
    finally:
        redis_server.start()


def test_under_vllms_tiering_manager_a_chunk_evicted_from_the_primary_comes_back(daemon_factory, tiers):
    """TieringOffloadingManager + CPUPrimaryTierOffloadingManager over a real SharedOffloadRegion:
    store (cascade to kvtier), drop the primary, then a lookup promotes the chunk back."""
    d = daemon_factory(node="a", pools_toml=POOLS_TOML)
    region = SharedOffloadRegion(engine_id=f"kvtier-mgr-{uuid.uuid4().hex[:8]}", num_chunks=NUM_CHUNKS, rank=None,
                                 kv_bytes_per_chunk=CHUNK, cpu_page_size=CHUNK)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=NUM_CHUNKS, mmap_region=region)
    view = primary.get_kv_memoryview()
    tier = tiers(view, d.runtime_dir)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    keys = [okey(i, "mgr") for i in range(3)]
    ctx = ReqContext(req_id="req-1")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    spec = out.store_spec
    assert isinstance(spec, CPULoadStoreSpec)
    data = fill(view, spec.chunk_ids, seed=5)  # what the GPU -> CPU copy would have written
    manager.complete_store(keys, ctx)  # cascades a store job to kvtier
    manager.on_request_finished(ctx)

    def settled() -> bool:
        manager.on_schedule_end(STEP)
        return not manager.has_pending_work()

    wait_until(settled, timeout=15, message="the cascade to kvtier finished")
    assert tier.counters.snapshot()["store_chunks_ok"] == 3
    manager.reset_cache()  # the primary forgets everything; kvtier keeps it

    ctx2 = ReqContext(req_id="req-2")
    manager.on_new_request(ctx2)
    assert [manager.lookup(k, ctx2) for k in keys] == [LookupResult.HIT_PENDING] * 3  # promotions queued

    def promoted() -> bool:
        manager.on_schedule_end(STEP)
        return [manager.lookup(k, ctx2) for k in keys] == [LookupResult.HIT] * 3

    wait_until(promoted, timeout=15, message="chunks promoted back into the primary")
    load = manager.prepare_load(keys, ctx2)
    assert [chunk_bytes(view, int(c)) for c in load.chunk_ids] == data
    assert tier.counters.snapshot()["load_chunks_ok"] == 3  # the bytes came back through kvtier
    manager.complete_load(keys, ctx2)
    manager.on_request_finished(ctx2)
    del view
    manager.shutdown()  # shuts the tier down, then releases the primary region
