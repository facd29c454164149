"""The vLLM connector's planner and mover (they read vLLM's objects duck-typed: no vLLM here)
against a real daemon: a hybrid model's two KV-cache groups (sliding-window and full), in fp8
pages, which vLLM's CPU build cannot run on this host. A load moves only what each group needs
and never vLLM's null block; a prefix whose sliding part is missing is a shorter hit, never a
load without it. An engine also finds its own saves while the daemon is still placing them. The engines
themselves: tests/vllm/test_model_kinds_e2e.py."""

from __future__ import annotations

import signal
from types import SimpleNamespace as NS

import pytest
import torch

from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace
from kvtier.integrations.vllm.connector_link import connector_link
from kvtier.integrations.vllm.connector_scheduler import SchedulerPlanner
from kvtier.integrations.vllm.connector_transfers import GroupPart
from kvtier.integrations.vllm.connector_worker import WorkerMover
from kvtier.integrations.vllm.kv_groups import FULL, NULL_BLOCK, SLIDING, GroupRule, describe_groups
from kvtier.tools.bench_env import pool_toml
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

BS, HEADS, DIM = 16, 2, 32
DTYPE = "float8_e4m3fn"  # one byte a value: a page is 2 x 2 x 16 x 32 = 2 KiB
RULES = [GroupRule(SLIDING, BS, window=2 * BS), GroupRule(FULL, BS)]
NS_ = KeyNamespace(model="m", weights='{"weights":"test-weights"}', engine_version="0.32", block_size=BS, layers=1,
                   kv_heads=HEADS, head_size=DIM, dtype=DTYPE, kv_layout="", device="cpu",
                   groups=describe_groups(RULES))
RANKS = [((0, 1), (0, 1))]
PROMPT_A = [3 + (i * 7) % 500 for i in range(6 * BS + 5)]  # six full blocks and a partial one
PROMPT_C = [3 + (i * 11) % 500 for i in range(6 * BS + 5)]
PROMPT_E = [3 + (i * 13) % 500 for i in range(6 * BS + 5)]


def request(rid: str, prompt: list[int]) -> NS:
    return NS(request_id=rid, prompt_token_ids=prompt, all_token_ids=prompt, num_computed_tokens=0, cache_salt=None,
              lora_request=None, mm_features=None)


def step(new=(), cached=()) -> NS:
    """A SchedulerOutput as the planner reads it: new requests (id, block ids per group, tokens)
    and running ones (id, new block ids per group, computed before, tokens)."""
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=ids, num_computed_tokens=0) for r, ids, _ in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, *_ in cached], new_block_ids=[ids for _, ids, _, _ in cached],
                                       resumed_req_ids=set(), num_computed_tokens=[c for *_, c, _ in cached]),
              num_scheduled_tokens={r: n for r, _, n in new} | {r: n for r, _, _, n in cached})


@pytest.fixture
def parts(daemon_factory):
    d = daemon_factory(pools_toml=pool_toml("hy", {"model": "m", "layers": 1, "kv_heads": HEADS, "head_dim": DIM,
                                                  "block_tokens": BS, "dtype": DTYPE}, "cpu", 0, 64))
    settings = ConnectorSettings(pool="hy", runtime_dir=str(d.runtime_dir), )
    link = connector_link("hy", settings.runtime_dir, 16, 0.2, 5.0, puts=True)
    caches = {name: torch.empty((40, 2, HEADS, BS, DIM), dtype=torch.float8_e4m3fn) for name in ("l0", "l1")}
    for c in caches.values():
        c.view(torch.uint8).random_(0, 120)  # finite fp8 values
    mover = WorkerMover(settings, NS_, link, (0, 1), (0, 1), [["l0"], ["l1"]])
    mover.register(caches)
    wait_until(link.client, timeout=10, message="the link connects")
    yield settings, link, mover, caches, d
    link.close()


def planner(settings, link) -> SchedulerPlanner:
    return SchedulerPlanner(settings, NS_, link, RANKS, load=True, save=True, rules=RULES)


def test_a_hybrid_prefix_loads_each_groups_part_and_only_the_window(parts):
    settings, link, mover, caches, _ = parts
    a = planner(settings, link)
    assert a.matched_tokens(request("a", PROMPT_A), 0) == (0, False)
    plan = a.build(step(new=[("a", ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), len(PROMPT_A))]))
    assert [(p.group, p.first, p.block_ids) for p in plan.saves[0].parts] == [
        (0, 0, (1, 2, 3, 4, 5, 6)), (1, 0, (11, 12, 13, 14, 15, 16))]  # every computed block of both
    mover.save(plan.saves)

    b = planner(settings, link)  # another engine on the node
    wait_until(lambda: b.matched_tokens(request("b", PROMPT_A), 0) == (6 * BS, True), timeout=10,
               message="both groups' parts stored")
    # vLLM keeps the sliding group's blocks 4-6 (window 32 tokens: first_kept(6) = 4), nulls before.
    null_before = caches["l0"][NULL_BLOCK].clone()
    sliding = [NULL_BLOCK] * 4 + [21, 22, 23]
    b.after_alloc(request("b", PROMPT_A), (sliding, [31, 32, 33, 34, 35, 36, 37]), 6 * BS)
    plan = b.build(step())  # an asynchronous load: the request is not among the step's scheduled ones
    [load] = plan.loads
    assert load.asynchronous and not load.remote and load.deadline_s > 0
    assert load.parts == (GroupPart(0, 4, (21, 22)), GroupPart(1, 0, (31, 32, 33, 34, 35, 36)))
    assert mover.start_loads(plan.loads) == set()  # handed to the loader thread
    done = wait_until(lambda: (r := mover.finished_loads())[0] and r, timeout=10, message="the load reported done")
    assert done == ({"b"}, set())
    raw = {n: c.view(torch.uint8) for n, c in caches.items()}
    assert torch.equal(raw["l0"][21:23], raw["l0"][5:7])  # sliding blocks 4, 5
    assert torch.equal(raw["l1"][31:37], raw["l1"][11:17])  # full blocks 0-5
    assert torch.equal(caches["l0"][NULL_BLOCK].view(torch.uint8), null_before.view(torch.uint8))
    counts = link.counters.snapshot()
    assert counts["loaded_blocks"] == 8 and counts.get("load_failed_blocks", 0) == 0


def test_a_missing_sliding_part_shortens_the_hit_to_a_whole_window(parts):
    settings, link, mover, caches, _ = parts
    c = planner(settings, link)
    assert c.matched_tokens(request("c", PROMPT_C), 0) == (0, False)
    plan = c.build(step(new=[("c", ([1, 2, 3, 4, 5], [11, 12, 13, 14, 15]), 5 * BS)]))
    mover.save(plan.saves)
    # Next step: vLLM gives the sliding group no block 5 (null): only the full group's part is saved.
    plan = c.build(step(cached=[("c", ([NULL_BLOCK, 6], [16, 17]), 5 * BS, len(PROMPT_C) - 5 * BS)]))
    assert [(p.group, p.first, p.block_ids) for p in plan.saves[0].parts] == [(1, 5, (16,))]
    mover.save(plan.saves)

    d = planner(settings, link)
    client = link.client()
    full = d._keys(client, d._track(request("d", PROMPT_C)), 6)[1]
    wait_until(lambda: client.lookup("hy", full).length == 6, timeout=10, message="the full group's six parts stored")
    # Six blocks need sliding parts 4 and 5; five need 3 and 4, which are held (once visible).
    wait_until(lambda: d.matched_tokens(request("d", PROMPT_C), 0) == (5 * BS, True), timeout=10,
               message="a hit of five blocks, not six")
    assert d.matched_tokens(request("d", PROMPT_C), 0) == (5 * BS, True)


def test_an_engine_loads_its_own_saves_before_the_daemon_places_them(parts):
    """Read your own writes: the daemon is stopped (SIGSTOP) after the save is staged, so nothing is
    placed. The same engine's next request is promised the whole prefix at once, and its load
    reads the blocks from the worker's own staging slots, verified, into the new pages; another
    engine, which saved nothing, misses at once."""
    settings, link, mover, caches, d = parts
    e = planner(settings, link)
    assert e.matched_tokens(request("e1", PROMPT_E), 0) == (0, False)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        plan = e.build(step(new=[("e1", ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]), len(PROMPT_E))]))
        mover.save(plan.saves)
        assert link.counters.snapshot()["saved_blocks"] == 12  # staged, both groups
        assert planner(settings, link).matched_tokens(request("x", PROMPT_E), 0) == (0, False)
        assert e.matched_tokens(request("e2", PROMPT_E), 0) == (6 * BS, True)
        e.after_alloc(request("e2", PROMPT_E), ([NULL_BLOCK] * 4 + [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]), 6 * BS)
        [load] = e.build(step()).loads
        assert not load.remote
        assert mover.start_loads([load]) == set()
        done = wait_until(lambda: (r := mover.finished_loads())[0] and r, timeout=10, message="the load reported done")
        assert done == ({"e2"}, set())  # every block read, with the daemon still stopped
    finally:
        d.proc.send_signal(signal.SIGCONT)
    raw = {n: c.view(torch.uint8) for n, c in caches.items()}
    assert torch.equal(raw["l0"][21:23], raw["l0"][5:7])  # sliding blocks 4, 5
    assert torch.equal(raw["l1"][31:37], raw["l1"][11:17])  # full blocks 0-5
    counts = link.counters.snapshot()
    assert counts["own_save_hits"] == 1 and counts["loaded_blocks"] == 8
    assert counts.get("load_failed_blocks", 0) == 0
    client = link.client()
    assert client.pool("hy").own_reads == 8
    wait_until(lambda: e.matched_tokens(request("e3", PROMPT_E), 0) == (6 * BS, True) and not e.own, timeout=10,
               message="the prefix placed by the daemon, and the engine's notes of it forgotten")
