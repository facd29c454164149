"""KvtierHiCacheStorage built and driven as SGLang 0.5.23 does, against real daemons and Redis.

SGLang's own classes: HiCacheStorageConfig, StorageBackendFactory.create_backend("dynamic", ...),
the HiCacheStorage interface. The pages are CPU tensors shaped as SGLang's MHA host pool lays
them out (host_pool.py says why that pool is a copy of SGLang's addressing).
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.integrations.pool_spec import PoolMismatch
from kvtier.integrations.sglang import KvtierHiCacheStorage
from kvtier.integrations.sglang.hicache_config import ConfigError
from kvtier.integrations.weights import WeightsUnknown
from kvtier.store.redis_blocks import redis_block_key
from tests.sglang.conftest import PAGE, POOL, host_pool, pool_toml
from tests.support.checkpoints import copy_checkpoint, write_checkpoint
from tests.support.waiting import wait_until


def chain(n: int, seed: str) -> list[str]:
    """SGLang-style page keys: hex SHA-256 chained page by page."""
    keys, h = [], seed.encode()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        keys.append(h.hex())
    return keys


def page_values(host, n: int, seed: int) -> list[torch.Tensor]:
    """n flat pages of random bytes, as SGLang's generic backup hands them (get_data_page)."""
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=g).to(host.kv_buffer.dtype))
    return [host.get_data_page(i * PAGE).clone() for i in range(n)]


def stored(be, keys: list[str]) -> bool:
    return be.batch_exists(keys) == len(keys)


def test_factory_builds_the_backend_as_sglang_does(node_factory, backend_factory) -> None:
    node = node_factory()
    be = backend_factory(node.runtime_dir, host_pool())
    assert isinstance(be, KvtierHiCacheStorage) and isinstance(be, HiCacheStorage)
    assert be.kvtier_stats()["connected"] is True


def test_set_get_round_trip_of_cpu_pages(node_factory, backend_factory) -> None:
    node = node_factory()
    host = host_pool()
    be = backend_factory(node.runtime_dir, host)
    keys = chain(6, "round-trip")  # every test its own keys: the module's Redis outlives each test
    vals = page_values(host, 6, seed=1)
    assert be.batch_set(keys, vals) is True
    wait_until(lambda: stored(be, keys), 10, message="pages stored")
    out = [host.get_dummy_flat_data_page() for _ in keys]
    got = be.batch_get(keys, out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(o, v) for o, v in zip(out, vals))
    # the single-page calls
    one = chain(1, "single")
    assert be.set(one[0], vals[0]) is True
    wait_until(lambda: be.exists(one[0]), 10, message="single page stored")
    target = host.get_dummy_flat_data_page()
    assert be.get(one[0], target) is target and torch.equal(target, vals[0])
    assert be.kvtier_stats()["pages_read_local"] >= 7


def test_batch_exists_counts_the_leading_run(node_factory, backend_factory) -> None:
    node = node_factory()
    host = host_pool()
    be = backend_factory(node.runtime_dir, host)
    keys = chain(8, "leading-run")
    vals = page_values(host, 8, seed=2)
    present = [0, 1, 2, 3, 5, 6]  # page 4 never stored
    assert be.batch_set([keys[i] for i in present], [vals[i] for i in present])
    wait_until(lambda: be.batch_exists(keys[:4]) == 4 and be.batch_exists(keys[5:7]) == 2, 10)
    assert be.batch_exists(keys) == 4
    assert be.batch_exists(keys[4:]) == 0
    out = [host.get_dummy_flat_data_page() for _ in keys]
    got = be.batch_get(keys, out)
    assert [g is not None for g in got] == [True] * 4 + [False] * 4  # from the first miss on, None


def test_the_weights_decide_not_the_served_name(node_factory, backend_factory, tmp_path) -> None:
    """Two checkpoints served under one name share no page; the same weights copied to another
    directory, served under another name, share every page."""
    node = node_factory()
    a = write_checkpoint(tmp_path / "a", seed=1)
    b = write_checkpoint(tmp_path / "b", seed=2)
    copy = copy_checkpoint(a, tmp_path / "elsewhere" / "a")
    host = host_pool()
    be_a = backend_factory(node.runtime_dir, host, model="llama", model_path=str(a))
    be_b = backend_factory(node.runtime_dir, host_pool(), model="llama", model_path=str(b))
    be_copy = backend_factory(node.runtime_dir, host_pool(), model="llama-v2", model_path=str(copy))
    keys = chain(4, "weights")
    vals = page_values(host, 4, seed=9)
    assert be_a.batch_set(keys, vals)
    wait_until(lambda: stored(be_a, keys), 10)
    assert be_b.batch_exists(keys) == 0
    assert be_b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 4
    assert be_copy.batch_exists(keys) == 4
    got = be_copy.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None and torch.equal(g, v) for g, v in zip(got, vals))
    # Weights kvtier cannot find are refused at attach, never keyed by the served name alone.
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text("{}")
    with pytest.raises(WeightsUnknown, match="no weights files"):
        backend_factory(node.runtime_dir, host_pool(), model="llama", model_path=str(tmp_path / "no-weights"))
    with pytest.raises(WeightsUnknown, match="set model_path or weights_id"):
        backend_factory(node.runtime_dir, host_pool(), model="org/not-cached", model_path="org/not-cached")


def test_tp_rank_model_and_mla_isolation(node_factory, backend_factory) -> None:
    node = node_factory()
    host = host_pool()
    rank0 = backend_factory(node.runtime_dir, host, tp_rank=0, tp_size=2)
    rank1 = backend_factory(node.runtime_dir, host_pool(), tp_rank=1, tp_size=2)
    other_model = backend_factory(node.runtime_dir, host_pool(), tp_rank=0, tp_size=2, model="org/other")
    other_tp = backend_factory(node.runtime_dir, host_pool(), tp_rank=0, tp_size=1)
    keys = chain(4, "iso")
    assert rank0.batch_set(keys, page_values(host, 4, seed=3))
    wait_until(lambda: stored(rank0, keys), 10)
    assert rank1.batch_exists(keys) == 0
    assert other_model.batch_exists(keys) == 0
    assert other_tp.batch_exists(keys) == 0
    assert rank1.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 4

    # MLA: every TP rank holds the page whole; rank 0 writes it, rank 1 (not a writer) reads it.
    mla0 = backend_factory(node.runtime_dir, host, tp_rank=0, tp_size=2, mla=True)
    mla1 = backend_factory(node.runtime_dir, host_pool(), tp_rank=1, tp_size=2, mla=True)
    mkeys = chain(3, "mla")
    vals = page_values(host, 3, seed=4)
    written = mla0.kvtier_stats()["pages_written"]
    assert mla1.batch_set(mkeys, vals) is True  # not the writer: SGLang's rank 0 writes these
    assert mla1.kvtier_stats()["pages_written"] == 0 and mla0.batch_exists(mkeys) == 0
    assert mla0.batch_set(mkeys, vals) is True
    assert mla0.kvtier_stats()["pages_written"] == written + 3
    wait_until(lambda: stored(mla1, mkeys), 10, message="rank 1 sees rank 0's MLA pages")
    out = [host.get_dummy_flat_data_page() for _ in mkeys]
    assert all(g is not None for g in mla1.batch_get(mkeys, out))
    assert all(torch.equal(o, v) for o, v in zip(out, vals))
    assert rank0.batch_exists(mkeys) == 0  # MLA and MHA namespaces differ


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_v1_matches_the_generic_path(node_factory, backend_factory, layout: str) -> None:
    node = node_factory()
    src, dst = host_pool(layout=layout), host_pool(layout=layout)
    be = backend_factory(node.runtime_dir, src, page_first=layout == "page_first", interface_v1=1)
    keys = chain(5, "v1" + layout)
    page_values(src, 5, seed=5)
    idx = torch.arange(0, 5 * PAGE)  # pages 0..4 of the host pool
    assert be.batch_set_v1(keys, idx) == [True] * 5
    wait_until(lambda: stored(be, keys), 10)
    # read into other host slots: pages land at host index 8*PAGE.. in place
    be.register_mem_pool_host(dst)
    at = torch.arange(8 * PAGE, 13 * PAGE)
    assert be.batch_get_v1(keys, at) == [True] * 5
    for i in range(5):
        assert torch.equal(dst.get_data_page((8 + i) * PAGE), src.get_data_page(i * PAGE))
    assert not dst.get_data_page(0).any()  # nothing written outside the asked pages
    # the generic path reads what the zero-copy path wrote, byte for byte
    flat = [dst.get_dummy_flat_data_page() for _ in keys]
    assert all(g is not None for g in be.batch_get(keys, flat))
    assert all(torch.equal(f, src.get_data_page(i * PAGE)) for i, f in enumerate(flat))


def test_two_nodes_share_pages_through_redis(node_factory, backend_factory, module_redis) -> None:
    a, b = node_factory("a"), node_factory("b")
    host_a, host_b = host_pool(), host_pool()
    be_a = backend_factory(a.runtime_dir, host_a)
    be_b = backend_factory(b.runtime_dir, host_b)
    keys = chain(6, "shared")
    vals = page_values(host_a, 6, seed=6)
    assert be_a.batch_set(keys, vals)
    wait_until(lambda: be_b.batch_exists(keys) == 6, 15, message="node B finds node A's pages in Redis")
    assert be_b.kvtier_stats()["pages_read_local"] == 0
    out = [host_b.get_dummy_flat_data_page() for _ in keys]
    got = be_b.batch_get(keys, out)
    assert all(g is not None for g in got)
    assert all(torch.equal(o, v) for o, v in zip(out, vals))
    assert be_b.kvtier_stats()["pages_read_remote"] == 6

    # A value corrupted in Redis is a miss on node B, never wrong bytes.
    bad = chain(3, "corrupt")
    assert be_a.batch_set(bad, page_values(host_a, 3, seed=7))
    wait_until(lambda: be_b.batch_exists(bad) == 3, 15)
    name = redis_block_key(POOL, be_b._keys(be_b.link.client(), [bad[1]])[0])
    r = module_redis.client()
    v = bytearray(r.get(name))
    v[-1] ^= 0xFF
    r.set(name, bytes(v))
    out = [host_b.get_dummy_flat_data_page() for _ in bad]
    got = be_b.batch_get(bad, out)
    assert got[0] is not None and got[1] is None and got[2] is None


def test_daemon_down_then_back(node_factory, backend_factory, tmp_path) -> None:
    # No daemon at all: the backend is built, every call misses, nothing raises.
    host = host_pool()
    be = backend_factory(tmp_path / "nowhere", host)
    keys = chain(3, "down")
    vals = page_values(host, 3, seed=8)
    assert be.batch_exists(keys) == 0 and be.exists(keys[0]) is False
    assert be.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 3
    assert be.batch_set(keys, vals) is False
    assert be.batch_set_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
    assert be.batch_get_v1(keys, torch.arange(3 * PAGE)) == [False] * 3
    assert be.kvtier_stats()["connected"] is False and be.kvtier_stats()["daemon_unavailable"] >= 1

    # A daemon killed under a connected backend: misses, then a reconnect once it is back.
    node = node_factory("k")
    be = backend_factory(node.runtime_dir, host)
    assert be.batch_set(keys, vals)
    wait_until(lambda: stored(be, keys), 10)
    node.kill()
    wait_until(lambda: be.kvtier_stats()["connected"] is False, 10, message="the backend notices")
    assert be.batch_exists(keys) == 0 and be.batch_set(keys, vals) is False
    node.start()
    wait_until(lambda: be.kvtier_stats()["connected"] is True, 20, message="the backend reconnects")
    assert be.batch_set(keys, vals)
    wait_until(lambda: stored(be, keys), 10)
    out = [host.get_dummy_flat_data_page() for _ in keys]
    assert all(g is not None for g in be.batch_get(keys, out))
    assert all(torch.equal(o, v) for o, v in zip(out, vals))


def test_redis_down(node_factory, backend_factory, tmp_path) -> None:
    from tests.support.redis_proc import RedisProcess

    with RedisProcess.serving(tmp_path / "r") as redis:
        a, b = node_factory("ra", redis_url=redis.url), node_factory("rb", redis_url=redis.url)
        host = host_pool()
        be_a = backend_factory(a.runtime_dir, host)
        be_b = backend_factory(b.runtime_dir, host_pool())
        local, remote_only = chain(3, "local"), chain(3, "remote")
        vals = page_values(host, 3, seed=9)
        assert be_a.batch_set(remote_only, vals) and be_b.batch_set(local, vals)
        wait_until(lambda: be_b.batch_exists(remote_only) == 3 and stored(be_b, local), 15)
        redis.stop(kill=True)
        # node B's own pages still read; node A's (only in Redis) miss within the bounded time
        out = [host.get_dummy_flat_data_page() for _ in local]
        assert all(g is not None for g in be_b.batch_get(local, out))
        assert all(torch.equal(o, v) for o, v in zip(out, vals))
        assert be_b.batch_exists(remote_only) == 0
        assert be_b.batch_get(remote_only, [host.get_dummy_flat_data_page() for _ in remote_only]) == [None] * 3
        assert be_b.batch_set(chain(2, "new"), vals[:2]) is False  # the hand-over goes through Redis
        assert be_b.kvtier_stats()["errors"] == 0  # each failure was a miss, not a surprise


def test_page_size_mismatch_is_refused_at_attach(node_factory, backend_factory) -> None:
    node = node_factory("m", pools=pool_toml(block_tokens=32))
    with pytest.raises(PoolMismatch, match="page size is 16 tokens .* block_tokens = 32"):
        backend_factory(node.runtime_dir, host_pool())
    node2 = node_factory("m2")
    wide = host_pool()
    wide.size_per_token *= 2  # pages of twice the pool's bytes
    with pytest.raises(PoolMismatch, match="bytes"):
        backend_factory(node2.runtime_dir, wide)
    with pytest.raises(PoolMismatch, match="not served"):
        backend_factory(node2.runtime_dir, host_pool(), pool="nope")


def test_bad_extra_config_is_refused_at_attach(tmp_path, backend_factory) -> None:
    with pytest.raises(ConfigError, match="call_timeout_s"):
        backend_factory(tmp_path, None, call_timeout_s=-1)


def test_bad_pages_are_refused_not_stored(node_factory, backend_factory) -> None:
    node = node_factory("bp")
    host = host_pool()
    be = backend_factory(node.runtime_dir, host)
    keys = chain(2, "bad")
    short = [torch.zeros(10, dtype=torch.float16), torch.zeros(10, dtype=torch.float16)]
    assert be.batch_set(keys, short) is False
    assert be.batch_set(keys, None) is False
    assert be.batch_exists([b"not-a-str"]) == 0  # type: ignore[list-item]
    assert be.kvtier_stats()["bad_pages"] == 3
    assert be.batch_exists(keys) == 0


def test_get_into_strided_targets_lands_in_place(node_factory, backend_factory) -> None:
    node = node_factory("st")
    host = host_pool()
    be = backend_factory(node.runtime_dir, host)
    keys = chain(2, "strided")
    vals = page_values(host, 2, seed=10)
    assert be.batch_set(keys, vals)
    wait_until(lambda: stored(be, keys), 10)
    dst = host_pool()
    targets = [dst.get_data_page(i * PAGE, flat=False) for i in range(2)]  # views into its kv_buffer
    got = be.batch_get(keys, targets)
    assert got[0] is targets[0] and got[1] is targets[1]
    assert all(torch.equal(dst.get_data_page(i * PAGE), vals[i]) for i in range(2))


def test_clear_forgets_the_namespace_on_every_node(node_factory, backend_factory) -> None:
    a, b = node_factory("ca"), node_factory("cb")
    host = host_pool()
    be_a = backend_factory(a.runtime_dir, host, model="org/clear")
    be_b = backend_factory(b.runtime_dir, host_pool(), model="org/clear")
    other = backend_factory(a.runtime_dir, host_pool(), model="org/kept")
    keys = chain(4, "clear")
    vals = page_values(host, 4, seed=11)
    assert be_a.batch_set(keys, vals) and other.batch_set(keys, vals)
    wait_until(lambda: be_b.batch_exists(keys) == 4 and stored(other, keys), 15)
    assert be_a.clear() is True
    assert be_a.batch_exists(keys) == 0  # at once on the node that cleared
    wait_until(lambda: be_b.batch_exists(keys) == 0, 10, message="node B follows the new epoch")
    assert be_b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None] * 4
    assert other.batch_exists(keys) == 4  # another namespace in the same pool is untouched
    # the namespace fills again after a clear
    assert be_b.batch_set(keys, vals)
    wait_until(lambda: be_a.batch_exists(keys) == 4, 15)
    out = [host.get_dummy_flat_data_page() for _ in keys]
    assert all(g is not None for g in be_a.batch_get(keys, out))
    assert all(torch.equal(o, v) for o, v in zip(out, vals))


def test_hybrid_models_v2_calls_answer_nothing_stored(node_factory, backend_factory) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer, PoolTransferResult

    node = node_factory("v2")
    be = backend_factory(node.runtime_dir, host_pool())
    be.register_mem_host_pool_v2(host_pool(), PoolName.MAMBA)  # warned, not refused
    keys = chain(3, "hybrid")
    t = PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=torch.arange(3))
    res = be.batch_exists_v2(keys, [t])
    assert isinstance(res, PoolTransferResult) and res.kv_hit_pages == 0
    assert be.batch_get_v2([t]) == {"mamba": [False] * 3}
    assert be.batch_set_v2([t]) == {"mamba": [False] * 3}


def test_no_page_until_the_epoch_is_known(node_factory, backend_factory, tmp_path) -> None:
    from tests.support.redis_proc import RedisProcess

    with RedisProcess.serving(tmp_path / "r") as redis:
        node = node_factory("ep", redis_url=redis.url)
        host = host_pool()
        redis.stop(kill=True)
        be = backend_factory(node.runtime_dir, host)  # Redis down: the epoch cannot be read
        keys = chain(2, "epoch")
        vals = page_values(host, 2, seed=12)
        assert be.batch_set(keys, vals) is False and be.batch_exists(keys) == 0
        assert be.kvtier_stats()["epoch_unknown"] >= 2 and be.kvtier_stats()["errors"] == 0
        redis.start()
        wait_until(lambda: be.batch_set(keys, vals), 20, message="stores once the epoch is read")
        wait_until(lambda: stored(be, keys), 10)


def test_prefetch_and_backup_threads_at_once(node_factory, backend_factory) -> None:
    import threading

    node = node_factory("mt")
    host = host_pool(pages=64)
    be = backend_factory(node.runtime_dir, host)
    vals = page_values(host, 64, seed=13)
    chains = [chain(8, f"mt{w}") for w in range(4)]
    expected = {k: vals[w * 8 + i] for w, ks in enumerate(chains) for i, k in enumerate(ks)}
    problems: list[str] = []

    readers_done = threading.Event()

    def writer(w: int) -> None:
        # At least 5 rounds, and on until the readers are done: a clear() that lands after the
        # last write would otherwise leave them nothing under the current epoch to read.
        rounds = 0
        while rounds < 5 or not readers_done.is_set():
            be.batch_set(chains[w], [expected[k] for k in chains[w]])
            rounds += 1

    def reader(w: int) -> None:
        # 20 rounds, and on until this reader got a page (or a deadline): a condition, not a count
        # that a scheduler can starve.
        deadline = time.monotonic() + 30
        rounds = read = 0
        while rounds < 20 or (read == 0 and time.monotonic() < deadline):
            ks = chains[w % 4]
            n = be.batch_exists(ks)
            out = [host.get_dummy_flat_data_page() for _ in ks]
            got = be.batch_get(ks, out)
            for k, g in zip(ks, got):
                if g is not None and not torch.equal(g, expected[k]):
                    problems.append(f"wrong bytes for {k[:8]}")
            if n < 0 or n > len(ks):
                problems.append(f"batch_exists {n}")
            read += sum(g is not None for g in got)
            rounds += 1

    readers = [threading.Thread(target=reader, args=(w,)) for w in range(4)]

    def watch() -> None:
        for t in readers:
            t.join(60)
        readers_done.set()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    threads += readers
    threads.append(threading.Thread(target=lambda: [be.clear() for _ in range(3)]))
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert problems == []
    st = be.kvtier_stats()
    assert st["errors"] == 0 and st["bad_pages"] == 0 and st["pages_written"] > 0
    assert st["pages_read_local"] > 0  # the readers did read pages (and every one was right)
