"""The connector's scheduler half: how much of a prompt kvtier holds, and which blocks to move.

Runs in vLLM's scheduler process, on its loop, so it never waits long:
- a lookup in the node's shared-memory directory costs no I/O;
- Redis is asked once per request, bounded by `lookup_timeout_s`;
- blocks that only Redis holds are prefetched into this node, and the request is held back
  (`None`: "ask again next step") until they are resident or `redis_wait_s` has passed; then
  it is scheduled with whatever is resident;
- blocks this engine itself handed to kvtier and the daemon has not placed yet (read your own
  writes) hold a request back the same way, for at most OWN_SAVE_LAND_S after their save was
  planned (a save the worker had to drop is not waited for longer than that).
Loads are synchronous for vLLM (the worker reads them before the forward pass). Saves are
planned as blocks of the prompt become computed and staged by the worker in the same step, so
a finished request's blocks are never held back (`request_finished` returns False).

A hybrid model's KV-cache groups each have a chain of keys per rank (kv_groups.py): a hit is
the longest prefix every chain holds what its group needs of, and a load moves only that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.integrations.link import EngineLink
from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace, rank_salt
from kvtier.integrations.vllm.kv_groups import GroupRule, complete_prefix, held_part

REPORT_S = 60.0
OWN_SAVE_LAND_S = 0.5  # how long a lookup waits for this engine's own save to be placed
log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format


@dataclass(frozen=True, slots=True)
class GroupPart:
    """One KV-cache group's blocks [first, first + len(block_ids)) of a prompt, and where they are
    in vLLM (that group's block ids)."""

    group: int
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request's prompt, one part per KV-cache group. Workers recompute the keys
    from the tokens with their own rank's salt."""

    req_id: str
    token_ids: tuple[int, ...]  # the prompt's tokens up to the last block moved
    cache_salt: str | None
    lora_name: str | None
    parts: tuple[GroupPart, ...]
    refused: bool = False  # a load whose blocks vLLM laid out unlike the plan: all of it fails

    @property
    def blocks(self) -> int:
        return sum(len(p.block_ids) for p in self.parts)


@dataclass(slots=True)
class TransferPlan:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    prompt: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    saved: int = 0  # leading prompt blocks already in kvtier or handed to it
    load: tuple[int, int] | None = None  # blocks [first, end) to load before the next forward
    local_tokens: int = 0  # the (block-aligned) local hit vLLM last showed us
    keys: list[list[bytes]] | None = None  # per chain (rank-major, then group), as far as hashed
    asked_redis: bool = False
    held_for_own: bool = False  # held back a step or more for this engine's own saves
    waiting_since: float | None = None  # prefetch from Redis asked at this time
    redis_target: int = 0


class SchedulerPlanner:
    """Pure bookkeeping plus lookups through the link; vLLM types are read duck-typed."""

    def __init__(self, settings: ConnectorSettings, ns: KeyNamespace, link: EngineLink,
                 ranks: Sequence[tuple[tuple[int, int], tuple[int, int]]], *, load: bool, save: bool,
                 rules: Sequence[GroupRule], clock: Callable[[], float] = time.monotonic) -> None:
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
        self.reqs: dict[str, _Tracked] = {}
        # Keys of blocks this engine handed to kvtier and has not yet seen placed: until when a
        # lookup waits for them (a save is staged in the step that computed it, then placed).
        self.own: dict[bytes, float] = {}
        self._next_prune = 0.0
        self._next_report = clock() + REPORT_S
        self._reported: dict[str, int] = {}

    # --- keys ------------------------------------------------------------------------------------

    def _track(self, request) -> _Tracked:
        t = self.reqs.get(request.request_id)
        if t is None:
            lora = getattr(request, "lora_request", None)
            t = _Tracked(tuple(request.prompt_token_ids or ()), getattr(request, "cache_salt", None),
                         None if lora is None else str(lora.lora_name))
            self.reqs[request.request_id] = t
            self.link.counters.add("lookups")
        return t

    def _keys(self, client, t: _Tracked, n_blocks: int) -> list[list[bytes]]:
        """Each chain's keys for the first n_blocks blocks (hashed once per request)."""
        if t.keys is None or len(t.keys[0]) < n_blocks:
            tokens = t.prompt[: n_blocks * self.block_size]
            t.keys = [client.block_keys(self.s.pool, tokens, salt=rank_salt(self.ns, tp, pp, t.cache_salt, g),
                                        lora_id=t.lora_name) for tp, pp, g in self.chains]
        return [k[:n_blocks] for k in t.keys]

    # --- get_num_new_matched_tokens --------------------------------------------------------------

    def matched_tokens(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` that kvtier can load now; None: ask again later."""
        t = self._track(request)
        t.local_tokens = num_computed_tokens
        if not self.do_load or getattr(request, "mm_features", None) or not t.prompt:
            return 0  # multimodal placeholders are not the content: their keys would lie
        # vLLM must compute at least one token itself, so the last prompt token is never loaded.
        max_blocks = (len(t.prompt) - 1) // self.block_size
        if max_blocks * self.block_size <= num_computed_tokens:
            return 0
        found = self.link.guard("lookup", None, lambda c: self._resident(c, t, max_blocks))
        if found is None:
            return 0
        local, keys, landing = found
        if landing > local:  # this engine's own saves are being placed: found a step later
            if not t.held_for_own:
                t.held_for_own = True
                self.link.counters.add("own_save_waits")
            return None
        if t.waiting_since is not None:  # a prefetch from Redis is on its way
            if local < t.redis_target and self.clock() - t.waiting_since < self.s.redis_wait_s:
                return None
            t.waiting_since = None
        elif local < max_blocks and self.s.redis_wait_s > 0 and self._prefetch(t, keys, local):
            return None
        t.saved = max(t.saved, local)
        return max(0, local * self.block_size - num_computed_tokens)

    def _resident(self, client, t: _Tracked, max_blocks: int) -> tuple[int, list[list[bytes]], int]:
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
        now = self.clock()
        for k, held in zip(keys, present):
            for key, h in zip(k, held):
                if h:
                    self.own.pop(key, None)
        landing = [[h or self.own.get(key, 0.0) > now for key, h in zip(k, held)] for k, held in zip(keys, present)]
        return local, keys, complete_prefix(self.chain_rules, landing, max_blocks)

    def _prefetch(self, t: _Tracked, keys: list[list[bytes]], local: int) -> bool:
        """Ask Redis (one bounded round trip per chain, once per request) how far each chain's
        leading run goes on; if every chain reaches past this node's prefix, prefetch the
        missing blocks each group needs and say so. (A sliding-window group's run is asked from
        its first block: older parts Redis lost cost a miss here, never a wrong load.)"""
        if t.asked_redis:
            return False
        t.asked_redis = True
        timeout = self.s.lookup_timeout_s
        starts: list[int] = []
        end = len(keys[0])
        for k in keys:
            found = self.link.guard("redis lookup", None, lambda c, k=k: c.locate(self.s.pool, k, timeout=timeout))
            if found is None:
                return False
            starts.append(found.length)
            end = min(end, found.length + found.redis_length)
        if end <= local:
            return False
        for k, start, rule in zip(keys, starts, self.chain_rules):
            start = max(start, rule.first_kept(end))
            if start < end and not self.link.guard("prefetch", False, lambda c, k=k, start=start: c.prefetch(
                    self.s.pool, k[start:end], parent=k[start - 1] if start else None, timeout=timeout) or True):
                return False
        t.redis_target = end
        t.waiting_since = self.clock()
        self.link.counters.add("redis_blocks", end - local)
        return True

    # --- update_state_after_alloc / build_connector_meta ---------------------------------------

    def after_alloc(self, request, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        t = self._track(request)
        first = t.local_tokens // self.block_size  # vLLM loads right after the local hit it showed us
        t.load = (first, first + num_external_tokens // self.block_size)
        self.link.counters.add("hit_blocks", t.load[1] - first)

    def build(self, scheduler_output) -> TransferPlan:
        self._report()
        plan = TransferPlan()
        for new in scheduler_output.scheduled_new_reqs:
            t = self.reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = [list(ids) for ids in new.block_ids]
            self._plan(plan, new.req_id, t, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not t.block_ids:
                    t.block_ids = [[] for _ in new_ids]
                for have, more in zip(t.block_ids, new_ids):
                    have.extend(more)
            self._plan(plan, req_id, t, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id])
        return plan

    def _parts(self, t: _Tracked, first: int, end: int, *, load: bool) -> tuple[GroupPart, ...]:
        """Each group's blocks of [first, end) that a transfer moves: a load only those the
        group keeps for `end` blocks; a save every computed one (each block of a sliding group
        is in some longer prefix's window). Never a null block."""
        parts = []
        for g, (rule, ids) in enumerate(zip(self.rules, t.block_ids)):
            lo, held = held_part(ids, max(first, rule.first_kept(end)) if load else first, end)
            if held:
                parts.append(GroupPart(g, lo, held))
        return tuple(parts)

    def _plan(self, plan: TransferPlan, req_id: str, t: _Tracked, computed_after_step: int) -> None:
        bs = self.block_size
        held = min((len(ids) for ids in t.block_ids), default=0) if len(t.block_ids) == len(self.rules) else 0
        if t.load is not None:
            first, end = t.load
            t.load = None
            if end > first and held >= end:
                parts = self._parts(t, first, end, load=True)
                # vLLM nulls the same blocks the rules leave out; a part that starts later means
                # it kept fewer than the load needs: load nothing, so vLLM recomputes them all.
                want = [(g, lo) for g, r in enumerate(self.rules) if (lo := max(first, r.first_kept(end))) < end]
                refused = [(p.group, p.first) for p in parts] != want
                if refused:
                    log.error("kvtier: request %s: vLLM's blocks for groups %s do not cover the window the load "
                              "needs; recomputing it", req_id, [p.group for p in parts])
                plan.loads.append(BlockTransfer(req_id, t.prompt[: end * bs], t.cache_salt, t.lora_name, parts,
                                                refused))
                t.saved = max(t.saved, end)
        if not self.do_save:
            return
        upto = min(min(computed_after_step, len(t.prompt)) // bs, held)
        if upto > t.saved:
            parts = self._parts(t, t.saved, upto, load=False)
            plan.saves.append(BlockTransfer(req_id, t.prompt[: upto * bs], t.cache_salt, t.lora_name, parts))
            if self.do_load:  # a producer-only engine never looks its saves up
                self.link.guard("save plan", None, lambda c: self._note_own(c, t, upto, parts))
            t.saved = upto

    def _note_own(self, client, t: _Tracked, upto: int, parts: tuple[GroupPart, ...]) -> None:
        """Remember the keys a save hands over, so that the next lookups wait for them to land."""
        keys = self._keys(client, t, upto)
        now = self.clock()
        until = now + OWN_SAVE_LAND_S
        if now >= self._next_prune:  # forget what landed unseen or never will
            self._next_prune = now + 1.0
            self.own = {k: u for k, u in self.own.items() if u > now}
        by_group = {p.group: p for p in parts}
        for k, (_, _, g) in zip(keys, self.chains):
            p = by_group.get(g)
            if p is not None:
                for key in k[p.first:p.first + len(p.block_ids)]:
                    self.own[key] = until

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    def _report(self) -> None:
        """The scheduler's counts, one log line a minute when they moved (the workers' go to
        vLLM's connector stats)."""
        now = self.clock()
        if now < self._next_report:
            return
        self._next_report = now + REPORT_S
        counts = self.link.counters.snapshot()
        if counts != self._reported:
            self._reported = counts
            log.info("kvtier: scheduler %s", " ".join(f"{k}={v}" for k, v in counts.items() if v))
