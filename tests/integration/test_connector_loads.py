"""The vLLM connector's load path (planner and mover read vLLM's objects duck-typed: no vLLM
here) against two real daemons on one real Redis: node B's first lookup promises what only
Redis holds and the worker reads it straight from Redis, asynchronously; a load whose Redis
hangs is given up at its deadline and counted; a lookup that times out is asked again next step
without taking the link down; a finished request's last blocks are saved while vLLM holds them.
The engines themselves: tests/vllm/test_connector_e2e.py and test_serving_path_e2e.py."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from types import SimpleNamespace as NS

import pytest
import torch

from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace
from kvtier.integrations.vllm.connector_link import connector_link
from kvtier.integrations.vllm.connector_scheduler import SchedulerPlanner
from kvtier.integrations.vllm.connector_worker import WorkerMover
from kvtier.integrations.vllm.kv_groups import FULL, GroupRule, describe_groups
from kvtier.tools.bench_env import pool_toml
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

BS, HEADS, DIM = 16, 2, 32
RULES = [GroupRule(FULL, BS)]
NS_ = KeyNamespace(model="m", weights='{"weights":"test-weights"}', engine_version="0.32", block_size=BS, layers=2,
                   kv_heads=HEADS, head_size=DIM, dtype="float16", kv_layout="", device="cpu",
                   groups=describe_groups(RULES))
PROMPT = [3 + (i * 7) % 500 for i in range(6 * BS + 5)]  # six full blocks and a partial one
WRITE_THROUGH = '\n[policy]\nredis_write = "write-through"\n'


def request(rid: str, tokens: list[int], prompt_len: int | None = None, computed: int = 0) -> NS:
    return NS(request_id=rid, prompt_token_ids=tokens[:prompt_len], all_token_ids=tokens, num_computed_tokens=computed,
              cache_salt=None, lora_request=None, mm_features=None, kv_transfer_params=None)


def step(new=(), cached=()) -> NS:
    """A SchedulerOutput as the planner reads it: new requests (id, block ids, tokens) and
    running ones (id, new block ids, computed before, tokens)."""
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=(ids,), num_computed_tokens=0) for r, ids, _ in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, *_ in cached],
                                       new_block_ids=[(ids,) for _, ids, _, _ in cached], resumed_req_ids=set(),
                                       num_computed_tokens=[c for *_, c, _ in cached]),
              num_scheduled_tokens={r: n for r, _, n in new} | {r: n for r, _, _, n in cached})


class Node:
    def __init__(self, daemon, **settings) -> None:
        self.d = daemon
        self.settings = ConnectorSettings(pool="p", runtime_dir=str(daemon.runtime_dir), **settings)
        self.link = connector_link("p", self.settings.runtime_dir, 16, 0.2, 5.0, puts=True)
        self.caches = {f"l{i}": torch.zeros((40, 2, HEADS, BS, DIM), dtype=torch.float16) for i in range(2)}
        self.mover = WorkerMover(self.settings, NS_, self.link, (0, 1), (0, 1), [["l0", "l1"]])
        self.mover.register(self.caches)
        self.planner = SchedulerPlanner(self.settings, NS_, self.link, [((0, 1), (0, 1))], load=True, save=True,
                                        rules=RULES, block_bytes=2 * 2 * HEADS * BS * DIM * 2)
        wait_until(self.link.client, timeout=10, message="the link connects")

    def pages(self, ids) -> torch.Tensor:
        return torch.stack([c[list(ids)] for c in self.caches.values()])


@pytest.fixture
def nodes(daemon_factory, redis_server):
    toml = pool_toml("p", {"model": "m", "layers": 2, "kv_heads": HEADS, "head_dim": DIM, "block_tokens": BS,
                           "dtype": "float16"}, "cpu", 0, 64)
    a = Node(daemon_factory("a", pools_toml=toml, extra=WRITE_THROUGH))
    b = Node(daemon_factory("b", pools_toml=toml, extra=WRITE_THROUGH))
    for c in a.caches.values():
        c.random_(-100, 100)
    yield a, b, redis_server
    a.link.close()
    b.link.close()


@contextmanager
def hung(redis):
    """Redis answers nothing (SIGSTOP) inside the block: it keeps its sockets, as a hung server does."""
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        redis.proc.send_signal(signal.SIGCONT)


def saved_on_a(a: Node) -> None:
    """Node A computes PROMPT (blocks 1-6) and saves its six full blocks; they reach Redis."""
    assert a.planner.matched_tokens(request("a", PROMPT), 0) == (0, False)
    a.planner.after_alloc(request("a", PROMPT), ([1, 2, 3, 4, 5, 6, 7],), 0)
    plan = a.planner.build(step(new=[("a", [1, 2, 3, 4, 5, 6, 7], len(PROMPT))]))
    a.mover.save(plan.saves)
    wait_until(lambda: a.d.pool_stats("p")["tiers"]["redis"]["copied_in"] >= 6, timeout=30,
               message="node A wrote the six blocks to Redis")


def test_a_cold_node_reads_the_prefix_through_from_redis_on_its_first_request(nodes):
    a, b, _ = nodes
    saved_on_a(a)
    r = request("b", PROMPT)
    assert b.planner.matched_tokens(r, 0) == (6 * BS, True)  # the first lookup: the whole prefix, async
    b.planner.after_alloc(r, ([21, 22, 23, 24, 25, 26, 27],), 6 * BS)
    [load] = b.planner.build(step()).loads
    assert load.remote and load.asynchronous
    assert b.mover.start_loads([load]) == set()
    done = wait_until(lambda: (x := b.mover.finished_loads())[0] and x, timeout=10, message="the load is over")
    assert done == ({"b"}, set())
    assert torch.equal(b.pages(range(21, 27)), a.pages(range(1, 7)))  # the bytes node A computed
    counts = b.link.counters.snapshot()
    assert (counts["hit_blocks_redis"], counts["load_remote_blocks"], counts["loaded_blocks"]) == (6, 6, 6)
    b.planner.workers_report(counts)  # what vLLM hands the scheduler: the cost model learns Redis's rate
    assert b.planner.costs.redis.value is not None


def test_a_load_whose_redis_hangs_is_given_up_at_its_deadline_and_counted(nodes):
    a, b, redis = nodes
    saved_on_a(a)
    b.planner.costs.ceiling_s = 0.5  # call_timeout_ms = 500: under the client's 2 s Redis timeout
    r = request("b", PROMPT)
    assert b.planner.matched_tokens(r, 0) == (6 * BS, True)
    b.planner.after_alloc(r, ([21, 22, 23, 24, 25, 26, 27],), 6 * BS)
    [load] = b.planner.build(step()).loads
    assert load.deadline_s == 0.5  # nothing measured yet: the ceiling
    before = b.pages(range(21, 27)).clone()
    with hung(redis):  # the read cannot finish
        b.mover.start_loads([load])
        done = wait_until(lambda: (x := b.mover.finished_loads())[0] and x, timeout=load.deadline_s + 5,
                          message="the load given up")
    assert done == ({"b"}, set(range(21, 27)))  # every block back to vLLM, to recompute
    assert torch.equal(b.pages(range(21, 27)), before)  # and none of them written
    counts = b.link.counters.snapshot()
    assert counts["load_deadline_missed"] == 1 and counts["load_failed_blocks"] == 6
    assert b.link.client() is not None  # a slow read is not a lost daemon
    # vLLM hands a request whose load failed whole back to the lookup (its blocks released): it
    # is recomputed, not promised the same blocks again (an endless load-fail loop otherwise).
    b.planner.loads_over({"b"}, done[1])
    assert b.planner.matched_tokens(r, 0) == (0, False)


def test_a_lookup_that_times_out_is_asked_again_next_step(nodes):
    a, b, redis = nodes
    saved_on_a(a)
    r = request("b", PROMPT)
    with hung(redis):
        assert b.planner.matched_tokens(r, 0) == (None, False)  # ask again next step
        assert b.planner.matched_tokens(r, 0) == (None, False)
    assert b.planner.matched_tokens(r, 0) == (6 * BS, True)  # the third try answers
    counts = b.link.counters.snapshot()
    assert (counts["lookup_timeouts"], counts["lookup_retries"]) == (2, 2)


def test_after_the_last_try_the_request_goes_on_with_what_the_node_holds(nodes):
    a, b, redis = nodes
    saved_on_a(a)
    r = request("b", PROMPT)
    with hung(redis):
        answers = [b.planner.matched_tokens(r, 0) for _ in range(3)]
    assert answers == [(None, False), (None, False), (0, False)]  # nothing here: computed, not held forever


def test_decode_blocks_are_saved_and_a_finished_requests_last_ones_hold_its_blocks(nodes):
    a, _, _ = nodes
    prompt = PROMPT[:2 * BS + 3]
    tokens = prompt + [7] * (3 * BS)  # the answer grows by decoding
    p = a.planner
    assert p.matched_tokens(request("d", tokens, len(prompt)), 0) == (0, False)
    plan = p.build(step(new=[("d", [1, 2, 3], len(prompt))]))
    assert [s.blocks for s in plan.saves] == [2]  # the prompt's full blocks
    # Decoding: 3 * BS tokens later the request is finished; blocks 3 and 4 were completed and
    # confirmed by then, block 5 in its last step.
    plan = p.build(step(cached=[("d", [4, 5], len(prompt) + 2 * BS, 1)]))
    assert [(s.token_ids[-1], s.blocks, s.final) for s in plan.saves] == [(7, 2, False)]
    a.mover.save(plan.saves)
    assert p.finished(request("d", tokens, len(prompt), computed=len(tokens) - 1), ([1, 2, 3, 4, 5, 6],))
    plan = p.build(step())
    [last] = plan.saves
    assert last.final and last.parts[0].first == 4 and last.parts[0].block_ids == (5,)
    a.mover.save(plan.saves)
    assert a.mover.sent == {"d"}  # reported through get_finished: vLLM frees the blocks
    # A request that opted out of decode saves: nothing after its prompt.
    off = request("o", tokens, len(prompt))
    off.kv_transfer_params = {"kvtier": {"save_decode": False}}
    p.matched_tokens(off, 0)
    p.build(step(new=[("o", [8, 9, 10], len(prompt))]))
    assert p.build(step(cached=[("o", [11, 12], len(prompt) + 2 * BS, 1)])).saves == []
    assert not p.finished(request("o", tokens, len(prompt), computed=len(tokens) - 1), ([8, 9, 10, 11, 12, 13],))


def test_blocks_that_load_slower_than_they_recompute_are_left_out_and_counted(nodes):
    a, b, _ = nodes
    saved_on_a(a)
    # What the workers measured: Redis moves a block in 20 ms, the engine computes 32 tokens in 1 ms.
    block = 2 * 2 * HEADS * BS * DIM * 2
    b.planner.workers_report({"load_us": 200_000, "load_local_blocks": 0, "load_remote_blocks": 10,
                              "prefill_tokens": 32_000, "prefill_us": 1_000_000})
    assert b.planner.costs.redis.value == pytest.approx(10 * block / 0.2)
    assert b.planner.matched_tokens(request("b", PROMPT), 0) == (0, False)  # recompute: cheaper
    assert b.link.counters.snapshot()["load_not_worth_blocks"] == 6
