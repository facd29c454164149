"""Hybrid sliding-window (SWA) models through HiCache's v2 calls, driven as SGLang 0.5.23's
HybridCacheController drives a backend (research: its SWA component and hybrid controller):
KV pages on the v1 calls, the SWA pool's pages on batch_set_v2 / batch_get_v2, and
batch_exists_v2 checking both, with SGLang's own PoolTransfer / PoolTransferResult classes and
real daemons and Redis. The SWA host pool is the MHA host pool's addressing with the SWA
layers' geometry (SGLang builds both pools from the same class)."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvtier.integrations.sglang.hicache_sidecars import restorable_lengths
from tests.sglang.conftest import DIM, PAGE, host_pool, pool_toml
from tests.sglang.host_pool import MHAHostPool
from tests.sglang.test_hicache_backend import chain, page_values, stored
from tests.support.waiting import wait_until

SWA_POOL = "sgl-swa"
SWA_LAYERS, SWA_HEADS = 3, 1  # float16: 2 x 3 x 1 x 16 x 32 x 2 = 6 KiB per page


def pools() -> str:
    return pool_toml() + pool_toml(SWA_POOL, layers=SWA_LAYERS, heads=SWA_HEADS)


def swa_host(pages: int = 8) -> MHAHostPool:
    return MHAHostPool(pages * PAGE, PAGE, SWA_LAYERS, SWA_HEADS, DIM)


def attach(backend_factory, node, swa: MHAHostPool, **kw):
    """As SGLang attaches a hybrid: the KV anchor, then every pool of the group through v2."""
    kv = host_pool()
    be = backend_factory(node.runtime_dir, kv, swa_pool=SWA_POOL, **kw)
    be.register_mem_host_pool_v2(kv, PoolName.KV)
    be.register_mem_host_pool_v2(swa, PoolName.SWA)
    be.on_host_pools_registered()
    return be, kv


def pages_of(first: int, n: int) -> torch.Tensor:
    return torch.arange(first * PAGE, (first + n) * PAGE, dtype=torch.int64)


def window(n: int) -> PoolTransfer:
    """The exists call's SWA transfer: placeholder keys, only their count (the window) counts."""
    return PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * n, hit_policy=PoolHitPolicy.TRAILING_PAGES)


def test_restorable_lengths_need_the_whole_window():
    present = [True, True, True, False, True, True]
    assert restorable_lengths(6, 2, present) == [1, 2, 3, 6]
    assert restorable_lengths(6, 1, present) == [1, 2, 3, 5, 6]
    assert restorable_lengths(4, 2, present) == [1, 2, 3]  # never past the KV run
    assert restorable_lengths(6, 6, present) == [1, 2, 3]


def test_a_prefix_is_restorable_only_where_its_swa_window_is_stored(node_factory, backend_factory):
    a, b = node_factory("swa-a", pools=pools()), node_factory("swa-b", pools=pools())
    swa_a = swa_host()
    be_a, kv_a = attach(backend_factory, a, swa_a)
    keys = chain(6, "swa")
    assert be_a.batch_set(keys, page_values(kv_a, 6, seed=1))  # KV: the v1 calls
    swa_vals = page_values(swa_a, 6, seed=2)
    # SWA pages of 0-2 and 4-5 backed up; page 3's window had been evicted (a hole).
    for first, n in ((0, 3), (4, 2)):
        t = PoolTransfer(name=PoolName.SWA, keys=keys[first:first + n], host_indices=pages_of(first, n),
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert be_a.batch_set_v2([t]) == {"swa": [True] * n}
    # Handed over is not yet visible: the daemon drains the staging slots.
    wait_until(lambda: stored(be_a, keys) and be_a.batch_exists_v2(keys, [window(2)]).restorable_prefix_pages
               == [1, 2, 3, 6], 10, message="the KV pages and SWA pages stored")
    res = be_a.batch_exists_v2(keys, [window(2)])
    assert isinstance(res, PoolTransferResult)
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (6, [1, 2, 3, 6])
    assert res.extra_pool_hit_pages == {"kv": 6, "swa": 6}
    # A window of 3 pages: 6 needs 3-5, and 3 is missing.
    assert be_a.batch_exists_v2(keys, [window(3)]).restorable_prefix_pages == [1, 2, 3]

    # Node B finds them through Redis, and reads the hit's trailing window into its own pool.
    swa_b = swa_host()
    be_b, _ = attach(backend_factory, b, swa_b)
    wait_until(lambda: be_b.batch_exists_v2(keys, [window(2)]).restorable_prefix_pages == [1, 2, 3, 6], 15,
               message="node B sees node A's KV and SWA pages in Redis")
    t = PoolTransfer(name=PoolName.SWA, keys=keys[4:6], host_indices=pages_of(0, 2))
    assert be_b.batch_get_v2([t]) == {"swa": [True, True]}
    assert all(torch.equal(swa_b.get_data_page(i * PAGE), swa_vals[4 + i]) for i in range(2))
    # The hole is a miss from there on, never other bytes.
    before = swa_b.kv_buffer.clone()
    t = PoolTransfer(name=PoolName.SWA, keys=keys[3:5], host_indices=pages_of(2, 2))
    assert be_b.batch_get_v2([t]) == {"swa": [False, False]}
    assert torch.equal(swa_b.kv_buffer, before)


def test_the_kv_pages_bound_the_hit_whatever_the_swa_pool_holds(node_factory, backend_factory):
    node = node_factory("swa-kv", pools=pools())
    swa = swa_host()
    be, kv = attach(backend_factory, node, swa)
    keys = chain(5, "kv-bound")
    assert be.batch_set(keys[:2], page_values(kv, 2, seed=3))
    t = PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=pages_of(0, 5))
    assert be.batch_set_v2([t]) == {"swa": [True] * 5}
    wait_until(lambda: stored(be, keys[:2]) and be.batch_exists_v2(keys, [window(5)]).kv_hit_pages == 2, 10)
    res = be.batch_exists_v2(keys, [window(2)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (2, [1, 2])


def test_sidecars_kvtier_does_not_store_are_a_miss(node_factory, backend_factory):
    """No swa_pool configured, or a pool kvtier does not carry (an MTP draft window): the span is a
    miss, never a load without its sidecar."""
    node = node_factory("swa-none", pools=pools())
    kv = host_pool()
    be = backend_factory(node.runtime_dir, kv)  # no swa_pool
    be.register_mem_host_pool_v2(swa_host(), PoolName.SWA)
    keys = chain(3, "no-swa")
    assert be.batch_set(keys, page_values(kv, 3, seed=4))
    wait_until(lambda: stored(be, keys), 10)
    assert be.batch_exists_v2(keys, [window(1)]).kv_hit_pages == 0
    t = PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=pages_of(0, 3))
    assert be.batch_set_v2([t]) == {"swa": [False] * 3}
    assert be.batch_get_v2([t]) == {"swa": [False] * 3}

    be2, _ = attach(backend_factory, node, swa_host())
    draft = PoolTransfer(name=PoolName.DRAFT_SWA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert be2.batch_set_v2([t]) == {"swa": [True] * 3}
    wait_until(lambda: be2.batch_exists_v2(keys, [window(1)]).kv_hit_pages == 3, 10,
               message="the SWA pages stored")  # the span with SWA alone
    assert be2.batch_exists_v2(keys, [window(1), draft]).kv_hit_pages == 0


def test_an_swa_pool_of_the_wrong_size_is_a_counted_miss(node_factory, backend_factory):
    node = node_factory("swa-size", pools=pools())
    be, kv = attach(backend_factory, node, MHAHostPool(8 * PAGE, PAGE, SWA_LAYERS + 1, SWA_HEADS, DIM))
    keys = chain(2, "size")
    t = PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=pages_of(0, 2))
    assert be.batch_set_v2([t]) == {"swa": [False, False]}
    assert be.kvtier_stats()["bad_pages"] >= 1  # PoolMismatch, logged with the pool it needs
