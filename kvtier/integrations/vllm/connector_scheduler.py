"""The connector's scheduler half: how much of a request kvtier holds, and which blocks to move.

Runs in vLLM's scheduler process, on its loop, so it never waits long:
- a lookup in the node's shared-memory directory costs no I/O;
- Redis is asked how much further the prefix goes (bounded by `lookup_timeout_s`); a lookup
  that timed out is asked again next step (`None`: "ask again"), up to `lookup_tries` times;
- the part only Redis holds is promised too (`read_through`): the worker reads it straight
  from Redis into vLLM's pages, with no prefetch round trip;
- blocks this engine itself handed to kvtier and the daemon has not placed yet are promised
  too: the worker reads them from its own staging slots (read your own writes: own_saves.py).
What is promised is what pays, with a deadline (kvtier/core/load_cost.py, from the workers'
figures). Loads are asynchronous (`load_async`): the request waits in WAITING_FOR_REMOTE_KVS
while the others run, and the worker reports it done.

Saves: prompt blocks as they become computed (staged by the worker in the same step); blocks
decoding produced (`save_decode`, opt out per request with kv_transfer_params {"kvtier":
{"save_decode": false}}) once their tokens are confirmed, a step later; what a finished request
still has unsaved is saved in the next step while vLLM holds its blocks (`request_finished`).

A hybrid model's groups each have a chain of keys per rank (kv_groups.py): a hit is the longest
prefix every chain holds its group's part of, and a load moves only that."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.load_cost import LoadCosts, LoadPlan
from kvtier.integrations.link import EngineLink
from kvtier.integrations.vllm.connector_config import (
    ConnectorSettings,
    KeyNamespace,
    rank_salt,
    request_opt_outs,
    request_pin,
)
from kvtier.integrations.vllm.connector_lookup import redis_reach
from kvtier.integrations.vllm.connector_requests import MAX_LOADS, TrackedRequest
from kvtier.integrations.vllm.connector_transfers import BlockTransfer, GroupPart, TransferPlan
from kvtier.integrations.vllm.kv_groups import GroupRule, complete_prefix, held_part
from kvtier.integrations.vllm.own_saves import OwnSaves

REPORT_S = 60.0
log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format


class SchedulerPlanner:
    """Pure bookkeeping plus lookups through the link; vLLM types are read duck-typed."""

    def __init__(self, settings: ConnectorSettings, ns: KeyNamespace, link: EngineLink,
                 ranks: Sequence[tuple[tuple[int, int], tuple[int, int]]], *, load: bool, save: bool,
                 rules: Sequence[GroupRule], block_bytes: int = 0, spec_tokens: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s = settings
        self.ns = ns
        self.link = link
        self.ranks = list(ranks)  # every (tp, pp) pair: a block counts only if every rank has it
        self.rules = list(rules)  # per KV-cache group
        # One chain of keys per (rank, group): a block counts only if every chain holds its part.
        self.chains = [(tp, pp, g) for tp, pp in self.ranks for g in range(len(self.rules))]
        self.chain_rules = [self.rules[g] for _, _, g in self.chains]
        self.do_load, self.do_save = load, save
        self.clock = clock
        self.block_size = ns.block_size
        # Speculative tokens are counted computed before they are verified: decode saves stay
        # that far (and one more token) behind.
        self.unconfirmed = spec_tokens + 1 if spec_tokens else 0
        self.costs = LoadCosts(max(block_bytes, 1), ns.block_size, ceiling_s=settings.call_timeout_s)
        self.reqs: dict[str, TrackedRequest] = {}
        self.loads: list[BlockTransfer] = []  # planned at allocation, sent with the next metadata
        self.final_saves: list[BlockTransfer] = []  # of finished requests whose blocks vLLM holds for them
        self.held = False  # a request was answered None since the last step (asked again next step)
        self.own = OwnSaves(clock=clock)  # blocks this engine handed over and has not seen placed
        self._next_report = clock() + REPORT_S
        self._reported: dict[str, int] = {}

    # --- keys ------------------------------------------------------------------------------------

    def _track(self, request) -> TrackedRequest:
        t = self.reqs.get(request.request_id)
        if t is None:
            lora = getattr(request, "lora_request", None)
            params = getattr(request, "kv_transfer_params", None)
            save, save_decode = request_opt_outs(params)
            t = TrackedRequest(request, tuple(request.prompt_token_ids or ()), getattr(request, "cache_salt", None),
                               None if lora is None else str(lora.lora_name), save, save_decode and self.s.save_decode,
                               pin=request_pin(params))
            self.reqs[request.request_id] = t
            self.link.counters.add("lookups")
        return t

    def _keys(self, client, t: TrackedRequest, n_blocks: int, tokens: Sequence[int] | None = None) -> list[list[bytes]]:
        """Each chain's keys for the first n_blocks blocks of the request's tokens (hashed once
        per request and extended as it grows: the prompt is the start of its tokens)."""
        if t.keys is None or len(t.keys[0]) < n_blocks:
            upto = tuple((t.prompt if tokens is None else tokens)[: n_blocks * self.block_size])
            t.keys = [client.block_keys(self.s.pool, upto, salt=rank_salt(self.ns, tp, pp, t.cache_salt, g),
                                        lora_id=t.lora_name) for tp, pp, g in self.chains]
        return [k[:n_blocks] for k in t.keys]

    # --- get_num_new_matched_tokens --------------------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvtier can load (None: ask again next step), and
        whether vLLM should wait for them asynchronously."""
        t = self._track(request)
        t.local_tokens = num_computed_tokens
        t.promised = None
        if not self.do_load or getattr(request, "mm_features", None) or not t.prompt:
            return 0, False  # multimodal placeholders are not the content: their keys would lie
        if t.load_failed or t.loads >= MAX_LOADS:  # vLLM asks again after a failed load: recompute
            return 0, False
        # vLLM must compute at least one token itself, so the last prompt token is never loaded.
        max_blocks = (len(t.prompt) - 1) // self.block_size
        done = num_computed_tokens // self.block_size
        if max_blocks <= done:
            return 0, False
        found = self.link.guard("lookup", None, lambda c: self._resident(c, t, max_blocks))
        if found is None:
            return 0, False
        local, keys, landing = found
        if landing > local:  # this engine's own saves, not placed yet: the worker reads them from its staging
            self.link.counters.add("own_save_hits")
            local = landing
        t.saved = max(t.saved, local)
        reach = local
        if local < max_blocks and self.s.read_through:
            r = redis_reach(self.link, self.s.pool, self.s.lookup_timeout_s, t, keys)
            if r is None:
                if t.tries < self.s.lookup_tries:
                    self.link.counters.add("lookup_retries")
                    self.held = True
                    return None, False
                r = local  # still no answer: this request goes on with what the node holds
            reach = max(local, r)
        here, there = max(0, local - done), max(0, reach - max(local, done))
        plan = self.costs.plan(here, there) if self.s.cost_model else LoadPlan(here, there, self.costs.ceiling_s, 0)
        self.link.counters.add("load_not_worth_blocks", plan.not_worth)
        end = done + plan.local + plan.remote
        if end <= done:
            return 0, False
        t.promised = (end, max(local, done), plan.deadline_s)
        return end * self.block_size - num_computed_tokens, self.s.load_async

    def _resident(self, client, t: TrackedRequest, max_blocks: int) -> tuple[int, list[list[bytes]], int]:
        """The leading blocks this node holds whole (every chain's part that a load needs), each
        chain's keys, and how far that prefix reaches once this engine's own saves are placed."""
        keys = self._keys(client, t, max_blocks)
        present: list[list[bool]] = []
        for k, rule in zip(keys, self.chain_rules):
            if rule.first_kept(max_blocks) == 0:  # needs every block from the first: the leading run
                run = client.lookup(self.s.pool, k).length
                present.append([True] * run + [False] * (len(k) - run))
            else:
                present.append(client.resident(self.s.pool, k))
        local = complete_prefix(self.chain_rules, present, max_blocks)
        if not self.own:
            return local, keys, local
        return local, keys, complete_prefix(self.chain_rules, self.own.landing(keys, present), max_blocks)

    # --- update_state_after_alloc / build_connector_meta ---------------------------------------

    def after_alloc(self, request, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (per group): the load it was promised is planned
        now (an asynchronous one is never among the step's scheduled requests)."""
        t = self._track(request)
        t.block_ids = [list(ids) for ids in block_ids]
        promised, t.promised = t.promised, None
        if num_external_tokens <= 0 or promised is None:
            return
        end, from_redis, deadline = promised
        first = t.local_tokens // self.block_size  # vLLM loads right after the local hit it showed us
        end = min(end, first + num_external_tokens // self.block_size)
        held = self._held(t)
        c = self.link.counters
        c.add("hit_blocks", end - first)
        c.add("hit_blocks_redis", max(0, end - max(first, from_redis)))
        t.redis_tokens = max(0, end - max(first, from_redis)) * self.block_size
        asynchronous = self.s.load_async
        if end <= first or held < end:  # never promised this much: vLLM recomputes it
            parts: tuple[GroupPart, ...] = ()
            refused = True
        else:
            parts = self._parts(t, first, end, load=True)
            # vLLM nulls the same blocks the rules leave out; a part that starts later means it
            # kept fewer than the load needs: load nothing, so vLLM recomputes them all.
            want = [(g, lo) for g, r in enumerate(self.rules) if (lo := max(first, r.first_kept(end))) < end]
            refused = [(p.group, p.first) for p in parts] != want
        if refused:
            log.error("kvtier: request %s: vLLM's blocks for groups %s do not cover the window the load needs; "
                      "recomputing it", request.request_id, [p.group for p in parts])
        t.loads += 1
        t.loading = frozenset(b for p in parts for b in p.block_ids)
        self.loads.append(BlockTransfer(request.request_id, t.prompt[: end * self.block_size], t.cache_salt,
                                        t.lora_name, parts, refused, remote=end > from_redis, deadline_s=deadline,
                                        asynchronous=asynchronous))
        t.saved = max(t.saved, end)

    def redis_tokens(self, request) -> int:
        return t.redis_tokens if (t := self.reqs.get(request.request_id)) else 0

    def build(self, scheduler_output) -> TransferPlan:
        self.report()
        self.own.step()
        plan = TransferPlan(loads=self.loads, saves=self.final_saves, held=self.held,
                            step_tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
        self.loads, self.final_saves, self.held = [], [], False
        for new in scheduler_output.scheduled_new_reqs:
            t = self.reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = [list(ids) for ids in new.block_ids]
            self._plan(plan, t, new.num_computed_tokens,
                       new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, then scheduled again
                self.link.counters.add("resumed_requests")
                t.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not t.block_ids:
                    t.block_ids = [[] for _ in new_ids]
                for have, more in zip(t.block_ids, new_ids):
                    have.extend(more)
            computed = cached.num_computed_tokens[i]
            self._plan(plan, t, computed, computed + scheduler_output.num_scheduled_tokens[req_id])
        return plan

    def _held(self, t: TrackedRequest) -> int:
        """How many leading blocks vLLM has allocated in every group."""
        return min((len(ids) for ids in t.block_ids), default=0) if len(t.block_ids) == len(self.rules) else 0

    def _parts(self, t: TrackedRequest, first: int, end: int, *, load: bool) -> tuple[GroupPart, ...]:
        """Each group's blocks of [first, end) that a transfer moves: a load only those the
        group keeps for `end` blocks; a save every computed one (each block of a sliding group
        is in some longer prefix's window). Never a null block."""
        parts = []
        for g, (rule, ids) in enumerate(zip(self.rules, t.block_ids)):
            lo, held = held_part(ids, max(first, rule.first_kept(end)) if load else first, end)
            if held:
                parts.append(GroupPart(g, lo, held))
        return tuple(parts)

    def _save_upto(self, t: TrackedRequest, confirmed: int, computed_after_step: int) -> tuple[int, tuple[int, ...]]:
        """How many leading blocks can be saved once this step ran, and their tokens: the prompt's
        computed ones, and with save_decode the confirmed tokens' (prompt and output) too."""
        tokens: Sequence[int] = t.prompt
        upto = min(computed_after_step, len(t.prompt))
        if t.save_decode and t.request is not None:
            everything = t.request.all_token_ids
            decoded = min(confirmed - self.unconfirmed, len(everything))
            if decoded > upto:
                tokens, upto = everything, decoded
        held = self._held(t)
        n = min(upto // self.block_size, held)
        return n, tuple(tokens[: n * self.block_size])

    def _plan(self, plan: TransferPlan, t: TrackedRequest, confirmed: int, computed_after_step: int) -> None:
        if not (self.do_save and t.save):
            return
        upto, tokens = self._save_upto(t, confirmed, computed_after_step)
        if upto > t.saved:
            plan.saves.append(self._save(t, upto, tokens))

    def _save(self, t: TrackedRequest, upto: int, tokens: tuple[int, ...], *, final: bool = False) -> BlockTransfer:
        parts = self._parts(t, t.saved, upto, load=False)
        if self.do_load:  # a producer-only engine never looks its saves up
            self.link.guard("save plan", None, lambda c: self._note_own(c, t, upto, parts, tokens))
        t.saved = upto
        return BlockTransfer(t.request.request_id, tokens, t.cache_salt, t.lora_name, parts, final=final)

    def _note_own(self, client, t: TrackedRequest, upto: int, parts: tuple[GroupPart, ...],
                  tokens: Sequence[int]) -> None:
        """Remember the keys a save hands over, so that the next lookups wait for them to land."""
        keys = self._keys(client, t, upto, tokens)
        by_group = {p.group: p for p in parts}
        for k, (_, _, g) in zip(keys, self.chains):
            p = by_group.get(g)
            if p is not None:
                self.own.note(k[p.first:p.first + len(p.block_ids)])

    def finished(self, request, block_ids: Sequence[Sequence[int]]) -> bool:
        """The request is done: True when its last computed blocks still need saving, in the
        next step (vLLM then keeps its blocks until the worker reports the save staged). What it
        saved is pinned when it asked for a pin."""
        t = self.reqs.pop(request.request_id, None)
        later = t is not None and self._final_save(t, request, block_ids)
        if t is not None and t.pin is not None and t.saved:
            self.link.guard("pin", None, lambda c: self._pin(c, t, request))
        return later

    def _pin(self, client, t: TrackedRequest, request) -> None:
        """Pin every chain's saved blocks (the final save's too: a pin may come before its blocks)."""
        ttl, tenant = t.pin  # type: ignore[misc]
        for keys in self._keys(client, t, t.saved, getattr(request, "all_token_ids", None) or t.prompt):
            client.pin(self.s.pool, keys, ttl, tenant=tenant, timeout=self.s.call_timeout_s)
            self.link.counters.add("pinned_blocks", len(keys))

    def _final_save(self, t: TrackedRequest, request, block_ids: Sequence[Sequence[int]]) -> bool:
        if not (self.do_save and t.save and t.save_decode):
            return False
        t.block_ids = [list(ids) for ids in block_ids]
        computed = int(getattr(request, "num_computed_tokens", 0) or 0)
        upto, tokens = self._save_upto(t, computed, 0)
        if upto <= t.saved:
            return False
        self.final_saves.append(self._save(t, upto, tokens, final=True))
        return True

    def loads_over(self, req_ids, failed_block_ids) -> None:
        """Asynchronous loads the workers reported done, and the blocks they failed."""
        for r in req_ids or ():
            if (t := self.reqs.get(r)) is not None:
                t.load_failed = t.load_failed or bool(t.loading & set(failed_block_ids or ()))
                t.loading = frozenset()

    def workers_report(self, data: dict[str, Any]) -> None:
        """The workers' figures since their last report: load bandwidths and prefill throughput."""
        us = data.get("load_us", 0)
        if us:
            self.costs.observe_load(data.get("load_local_blocks", 0), data.get("load_remote_blocks", 0), us / 1e6)
        if data.get("prefill_us", 0):
            self.costs.observe_prefill(data.get("prefill_tokens", 0), data["prefill_us"] / 1e6)

    def report(self, now_too: bool = False) -> None:
        """The scheduler's counts, a log line a minute when they moved, and at shutdown (the
        workers' go to vLLM's connector stats)."""
        now = self.clock()
        if now < self._next_report and not now_too:
            return
        self._next_report = now + REPORT_S
        counts = self.link.counters.snapshot()
        if counts != self._reported:
            self._reported = counts
            log.info("kvtier: scheduler %s", " ".join(f"{k}={v}" for k, v in counts.items() if v))
