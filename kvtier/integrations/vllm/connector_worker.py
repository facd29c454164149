"""The connector's worker half: moves blocks between vLLM's paged KV caches and kvtier.

Runs in each vLLM worker process (one per tensor/pipeline-parallel rank), keyed by that rank's
salt. Loads run on one background thread while vLLM computes the other requests (`start_loads`;
`finished_loads` reports those done, for `get_finished`), or, when the scheduler asked for a
synchronous one, before the forward pass. Each load reads what this node holds and, past that,
straight from Redis, and is given up at its deadline. Saves are staged after the forward pass
(`wait_for_save`), from every layer at once, since a kvtier block holds all of this rank's layers
of one KV-cache group (a hybrid model's groups each have their own chain). A load that reads
fewer blocks than planned reports the rest as failed block ids: vLLM then recomputes them (or
fails the request, if `kv_load_failure_policy` says "fail").

Layer by layer loading (`wait_for_layer_load`) is not done: a kvtier block holds every layer
and is verified whole, so a layer cannot be used before the whole block is read; and with
asynchronous loads no forward pass waits for a load at all.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from kvtier.client import ManifestEntry, ReadCounts, checksum_parts, checksum_stream, copy_streamed
from kvtier.integrations.link import EngineLink
from kvtier.integrations.pool_spec import PoolSpec
from kvtier.integrations.vllm.connector_config import (
    ConnectorSettings,
    KeyNamespace,
    namespace_id,
    rank_salt,
    request_tenant,
)
from kvtier.integrations.vllm.connector_copy import block_view, copy_block, page_shape, scatter_blocks
from kvtier.integrations.vllm.connector_transfers import BlockTransfer, GroupPart

log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format
PREFILL_STEP_TOKENS = 256  # steps this large are timed as prefill throughput
LOAD_STALL_ENV = "KVTIER_TEST_LOAD_STALL_S"
IDLE_WAIT_S = 0.005


def pages_spec(pool: str, ns: KeyNamespace, layers: int, page_bytes: int, dtype: str, elem: int) -> PoolSpec:
    """vLLM's pages as the pool must hold them: one vLLM block of every layer of this rank. The
    head_dim it suggests gives the page's bytes (an MLA page holds one latent, not K and V)."""
    head_dim = page_bytes // (2 * ns.kv_heads * ns.block_size * elem)
    return PoolSpec(
        pool, block_bytes=layers * page_bytes, block_tokens=ns.block_size, dtype=dtype,
        howto=lambda: (f"Configure it as layers = {layers}, kv_heads = {ns.kv_heads}, head_dim = {head_dim}, "
                       f"block_tokens = {ns.block_size}, dtype = \"{dtype}\""),
        tokens_msg="block_tokens {have} != vLLM block_size {want} (one vLLM block must be exactly one kvtier block)",
        dtype_msg="dtype {have} != vLLM's KV dtype {want}",
        bytes_msg="block bytes {have} != " + f"{layers} layers x {page_bytes} page bytes")


class WorkerMover:
    def __init__(self, settings: ConnectorSettings, ns: KeyNamespace, link: EngineLink,
                 tp: tuple[int, int], pp: tuple[int, int], groups: Sequence[Sequence[str]]) -> None:
        self.s = settings
        self.ns = ns
        self.link = link
        self.tp, self.pp = tp, pp
        self.group_layers = [list(g) for g in groups]  # layer names per KV-cache group, in model order
        self.groups: list[list[torch.Tensor]] = []  # their caches
        self.caches: list[torch.Tensor] = []  # every group's, for the device and dtype
        self.page: tuple[int, ...] = ()
        self._scratch: torch.Tensor | None = None  # the loader thread's only
        self._pages: list[list[np.ndarray]] | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[set[int]]] = {}  # asynchronous loads by request
        self.sent: set[str] = set()  # finished requests whose last save is staged (get_finished)
        self._step_started = 0.0
        self._step_tokens = 0
        self._step_sync_s = 0.0  # synchronous loads inside this step (not prefill)
        self._idle_step = False  # this step computes nothing
        self._held_step = False  # and the scheduler holds a request back (to be asked again)
        # A fault test's slow tier: every load waits this long first (unset in production).
        self._stall_s = float(os.environ.get(LOAD_STALL_ENV, "0") or 0)

    # --- setup -----------------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Keep each group's attention layers of this rank in model order (the order is part of
        the block). Layers of different groups may share memory (vLLM's hybrid manager): a
        block id belongs to one group at a time, so each group reads only its own blocks."""
        groups = [[kv_caches[n] for n in names if n in kv_caches] for names in self.group_layers]
        if len(groups) == 1 and not groups[0]:
            groups = [list(kv_caches.values())]
        self.groups = groups
        self.caches = [c for g in groups for c in g]
        self.page = page_shape(self.caches)
        # Host caches with contiguous pages are loaded straight from the slots, verified in place
        # (one copy); others (CUDA, strided pages) through a scratch buffer and a scatter.
        self._pages = None
        if all(c.device.type == "cpu" and c.is_contiguous() for c in self.caches):
            self._pages = [[c.view(torch.uint8).numpy().reshape(c.shape[0], -1) for c in g] for g in groups]
        layers = len(groups[0])
        # The pool must hold this rank's pages: checked on every connection (a pool that does not
        # fit keeps the link down, every transfer a miss, with the fix in vLLM's log).
        dtype = str(self.caches[0].dtype).removeprefix("torch.")
        page_bytes = self.caches[0][0].numel() * self.caches[0].element_size()
        self.link.spec = pages_spec(self.s.pool, self.ns, layers, page_bytes, dtype, self.caches[0].element_size())
        ns = self.ns
        self.link.register(ManifestEntry(
            namespace=namespace_id(ns), engine="vllm-connector", engine_version=ns.engine_version, model=ns.model,
            weights={**json.loads(ns.weights), "revision": ns.revision},
            page={"page_bytes": page_bytes, "layers": layers, "block_tokens": ns.block_size, "dtype": dtype,
                  "kv_layout": ns.kv_layout, "shape": list(self.page), "groups": ns.groups.split(",")},
            extra={"tp_size": self.tp[1], "pp_size": self.pp[1], "groups": len(groups)}))
        log.info("kvtier: %d layers in %d KV-cache group(s) (%s) registered, page %s %s on %s", len(self.caches),
                 len(groups), ns.groups, self.page, self.caches[0].dtype, self.caches[0].device)

    def _usable(self, client) -> object | None:
        """The pool, once vLLM's pages are known (the link checked that it fits them)."""
        return client.pool(self.s.pool) if self.caches else None

    def chain_keys(self, client, tr: BlockTransfer, group: int) -> list[bytes]:
        """This rank's keys of one group for every block of the transfer's tokens, from the first."""
        salt = rank_salt(self.ns, self.tp, self.pp, tr.cache_salt, group)
        return client.block_keys(self.s.pool, tr.token_ids, salt=salt, lora_id=tr.lora_name)

    def _buffer(self, pool, n: int) -> torch.Tensor:
        """n blocks of scratch for loads through a buffer (CUDA, strided pages), reused: a fresh
        one per step page-faults its whole size (measured: a tenth of the bound)."""
        shape = (n, *pool.shape)
        buf = self._scratch
        if buf is None or buf.shape[0] < n or buf.shape[1:] != shape[1:] or buf.dtype != pool.dtype:
            buf = self._scratch = torch.empty(shape, dtype=pool.dtype, device=self.caches[0].device)
        return buf[:n]

    def _copy_pages_out(self, g: int, b: int, dst) -> int | None:
        """vLLM block b's page of every layer of group g into dst (uint8, block_bytes: a staging
        or granted slot). On host pages, the xxh3 of what was copied, each page hashed from
        vLLM's own memory right after its copy (one pass; never the shared slot: see
        kvtier/shm/onepass.py)."""
        if self._pages is not None:  # numpy: a torch copy_ per 128 KiB page costs as much again
            pages = self._pages[g]
            step = pages[0].shape[1]
            h = checksum_stream()
            for layer, p in enumerate(pages):
                copy_streamed(h, dst[layer * step:(layer + 1) * step], p[b], hash_src=True)
            return h.intdigest()
        caches = self.groups[g]
        view = torch.from_numpy(dst).view(caches[0].dtype).view(len(caches), *self.page)
        copy_block(caches, b, view)
        return None

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.caches[0].device)

    # --- loads -----------------------------------------------------------------------------------

    def start_loads(self, transfers: Sequence[BlockTransfer]) -> set[int]:
        """Hand asynchronous loads to the loader thread; run synchronous ones now (returns the
        block ids they did not load)."""
        failed: set[int] = set()
        now = time.monotonic()
        for tr in transfers:
            if tr.asynchronous:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
                self._inflight[tr.req_id] = self._loader.submit(self._load, tr)
            else:
                failed |= self._load(tr)
                self._step_sync_s += time.monotonic() - now
                now = time.monotonic()
        return failed

    def load(self, transfers: Sequence[BlockTransfer]) -> set[int]:
        """Read each transfer's blocks into vLLM's pages now. Returns the block ids not loaded."""
        return set().union(*(self._load(tr) for tr in transfers))

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """Requests whose asynchronous load is over (loaded or not), and the block ids it failed.
        In a step with nothing to compute it waits up to IDLE_WAIT_S for one (or, while the
        scheduler holds a request back for the daemon, sleeps that long): vLLM would run the next
        empty step at once, a spin that takes the cores the load or the daemon needs."""
        if self._idle_step and self._inflight:
            wait(list(self._inflight.values()), timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        elif self._idle_step and self._held_step:
            time.sleep(IDLE_WAIT_S)
        done = [r for r, f in self._inflight.items() if f.done()]
        failed: set[int] = set()
        for r in done:
            failed |= self._inflight.pop(r).result()
        return set(done), failed

    def _load(self, tr: BlockTransfer) -> set[int]:
        """One transfer's blocks, within its deadline."""
        # From when this load starts: the loads queued ahead of it on the loader thread are not
        # its own cost (a burst of twelve otherwise ran out its last loads' deadlines waiting).
        deadline = time.monotonic() + (tr.deadline_s or self.s.call_timeout_s)
        if self._stall_s and not tr.refused:
            log.warning("kvtier: load of request %s stalled for %g s (%s)", tr.req_id, self._stall_s, LOAD_STALL_ENV)
            time.sleep(self._stall_s)
        c = self.link.counters
        lost: list[int] = []
        missed = False
        counts = ReadCounts()
        for part in tr.parts:
            n = 0
            left = deadline - time.monotonic()
            if tr.refused:
                pass
            elif left <= 0:
                missed = True
            else:
                t0 = time.perf_counter()
                n = self.link.guard("load", 0, lambda c, tr=tr, p=part, left=left: self._load_part(
                    c, tr, p, left, counts))
                if n < 0:  # its deadline passed (the link is fine)
                    missed, n = True, 0
                elif n:
                    c.add("load_us", int((time.perf_counter() - t0) * 1e6))
                    c.add("load_local_blocks", counts.local)
                    c.add("load_remote_blocks", counts.remote)
            c.add("loaded_blocks", n)
            lost += part.block_ids[n:]
        if missed:
            c.add("load_deadline_missed")
        if lost:
            c.add("load_failed_blocks", len(lost))
            log.warning("kvtier: request %s loaded %d of %d planned blocks%s; vLLM recomputes the rest",
                        tr.req_id, tr.blocks - len(lost), tr.blocks, " (its deadline passed)" if missed else "")
        return set(lost)

    def _load_part(self, client, tr: BlockTransfer, part: GroupPart, timeout: float, counts: ReadCounts) -> int:
        """_load_one, or -1 when it ran out of time (not a fault of the link: the guard must not
        count it as one)."""
        try:
            return self._load_one(client, tr, part, timeout, counts)
        except TimeoutError:
            return -1

    def _load_one(self, client, tr: BlockTransfer, part: GroupPart, timeout: float, counts: ReadCounts) -> int:
        pool = self._usable(client)
        if pool is None:
            return 0
        keys = self.chain_keys(client, tr, part.group)[part.first:part.first + len(part.block_ids)]
        if self._pages is not None:
            return self._load_in_place(client, keys, part.block_ids, self._pages[part.group], tr.remote, timeout,
                                       counts)
        caches = self.groups[part.group]
        buf = self._buffer(pool, len(keys))
        n = client.get(self.s.pool, keys, buf, remote=tr.remote, counts=counts, timeout=timeout)
        if n:
            scatter_blocks(block_view(buf, len(caches), self.page), caches, self._ids(part.block_ids[:n]))
        return n

    def _load_in_place(self, client, keys: list[bytes], block_ids: Sequence[int], pages: list[np.ndarray],
                       remote: bool, timeout: float, counts: ReadCounts) -> int:
        step = pages[0].shape[1]
        # A timed-out call returns while its copy threads may still run: past that point they
        # must not write into pages vLLM will recompute (a page in flight is one 128 KiB copy).
        abandoned = threading.Event()

        landed: dict[int, int] = {}  # block -> xxh3 of its pages, hashed as each landed (one pass)

        def copy_out(i: int, src) -> None:
            b = block_ids[i]
            h = checksum_stream()
            for layer, p in enumerate(pages):
                if abandoned.is_set():
                    raise TimeoutError("the load was given up")
                copy_streamed(h, p[b], src[layer * step:(layer + 1) * step])
            landed[i] = h.intdigest()

        def digest(i: int) -> int:
            got = landed.pop(i, None)
            return checksum_parts(p[block_ids[i]] for p in pages) if got is None else got

        try:
            return client.get_with(self.s.pool, keys, copy_out, digest, remote=remote, counts=counts, timeout=timeout)
        except BaseException:
            abandoned.set()
            raise

    # --- saves -----------------------------------------------------------------------------------

    def step_started(self, step_tokens: int, held: bool = False) -> None:
        self._step_started, self._step_tokens, self._step_sync_s = time.monotonic(), step_tokens, 0.0
        self._idle_step, self._held_step = step_tokens == 0, held

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Stage the saves after the forward pass, and time that pass: a step of mostly prefill
        (PREFILL_STEP_TOKENS or more) tells the scheduler what recomputing costs."""
        if self._step_tokens >= PREFILL_STEP_TOKENS and self._step_started:
            s = time.monotonic() - self._step_started - self._step_sync_s
            if s > 0:
                self.link.counters.add("prefill_tokens", self._step_tokens)
                self.link.counters.add("prefill_us", int(s * 1e6))
        self._step_tokens = 0
        for tr in transfers:
            for part in tr.parts:
                self.link.guard("save", None, lambda c, tr=tr, p=part: self._save_one(c, tr, p))
            if tr.final:
                self.sent.add(tr.req_id)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def _save_one(self, client, tr: BlockTransfer, part: GroupPart) -> None:
        pool = self._usable(client)
        if pool is None:
            return
        c = self.link.counters
        keys = self.chain_keys(client, tr, part.group)
        todo = keys[part.first:part.first + len(part.block_ids)]
        skip = client.lookup(self.s.pool, todo).length  # already on this node: nothing to hand over
        c.add("save_skipped_blocks", skip)
        todo, ids = todo[skip:], part.block_ids[skip:]
        if not todo:
            return
        start = part.first + skip
        g = part.group
        bs = self.ns.block_size
        toks = list(tr.token_ids[start * bs:(start + len(todo)) * bs])  # for routers' KV events
        # vLLM may free these pages once this step ends, so the bytes must be staged now: staging
        # slots the daemon has not drained yet are waited for, up to save_wait_s; what is still
        # not staged then is dropped and counted (a future miss, never an error).
        done = self.link.put_with(client, todo, lambda i, dst: self._copy_pages_out(g, ids[i], dst),
                                  parent=keys[start - 1] if start else None, wait_s=self.s.save_wait_s,
                                  token_ids=toks if len(toks) == len(todo) * bs else None,
                                  tenant=request_tenant(tr.cache_salt, tr.lora_name))
        c.add("saved_blocks", done)
        c.add("save_dropped_blocks", len(todo) - done)
