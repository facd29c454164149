"""Stateful test of the pure tiering core: TierIndex (gpu, cpu, redis) + Placement for one pool.

A Hypothesis state machine drives the policy with client events (put, access, prefetch), time,
pressure, reader pins, Redis TTL expiry, lost and duplicated deliveries and daemon restarts. A
small synchronous executor carries out the commands the way kvtier/tiers/worker.py does and
feeds the facts back through `Placement.on_fact`; a plain dict model holds the block bytes.

The keys form a small forest (chains with a branch) so puts collide and prefixes matter. A
block's bytes are a function of its key, so a wrong copy anywhere is visible.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.bus.events import Copy, Demote, Evict, Promote, Removed, Store, Stored, Tier
from kvtier.tiers.index import State, TierIndex
from kvtier.tiers.policy import DROP_REASONS, Placement, PolicyKnobs, RedisWrite

POOL = "p"
GPU, CPU, REDIS = Tier.GPU, Tier.CPU, Tier.REDIS
LOCAL = (GPU, CPU)
CAP = {GPU: 3, CPU: 5}
BLOCK_BYTES = 8
LEASE, T = 5.0, 30.0  # prefetch_lease_s, transfer_timeout_s

# name -> parent name: a0..a4 with a branch b2, b3 off a1; c0..c2; d0, d1
_FOREST = {"a0": None, "a1": "a0", "a2": "a1", "a3": "a2", "a4": "a3", "b2": "a1", "b3": "b2",
           "c0": None, "c1": "c0", "c2": "c1", "d0": None, "d1": "d0"}


def key(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


PARENT = {key(n): None if p is None else key(p) for n, p in _FOREST.items()}
KEYS = sorted(PARENT)


def bytes_of(k: bytes) -> bytes:
    return hashlib.blake2b(k, digest_size=BLOCK_BYTES).digest()


def _root_path(k: bytes) -> list[bytes]:
    path = [k]
    while PARENT[path[0]] is not None:
        path.insert(0, PARENT[path[0]])
    return path


# Every contiguous piece of a root-to-node path: what one client batch may put or prefetch.
PATHS = sorted({tuple(p[i:j]) for k in KEYS for p in [_root_path(k)]
                for i in range(len(p)) for j in range(i + 1, len(p) + 1)})
paths = st.sampled_from(PATHS)
lose = st.frozensets(st.integers(0, 5), max_size=2) | st.just(frozenset())


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.data: dict[Tier, dict[bytes, bytes]] = {t: {} for t in Tier}  # the bytes each tier holds
        self.headers: dict[Tier, dict[int, bytes]] = {t: {} for t in LOCAL}  # slot -> key, as in slot headers
        self.pins: Counter[tuple[Tier, bytes]] = Counter()  # readers' pins taken by the test
        self.leases: dict[bytes, float] = {}  # prefetched, not yet read -> lease expiry
        self.stored: set[bytes] = set()  # reported stored, and not since lost by a documented rule
        self.staged: set[int] = set()  # staging gens not yet released
        self.gen = 0
        self.recent: list = []  # commands and facts of the last batch, for duplicate delivery
        self.parked: list[Store | Promote] = []  # lost commands that may still turn up late
        self.lost_until: float | None = None  # marks of lost commands expire by then

    @initialize(write=st.sampled_from(RedisWrite), admit_after=st.sampled_from([0, 2]),
                prefetch_to=st.sampled_from([CPU, GPU]))
    def configure(self, write, admit_after, prefetch_to) -> None:
        self.knobs = PolicyKnobs(high_watermark=0.9, low_watermark=0.6, promote_after_hits=2,
                                 prefetch_lease_s=LEASE, transfer_timeout_s=T, redis_write=write,
                                 redis_admit_after_hits=admit_after, prefetch_to=prefetch_to)
        self._fresh()

    def _fresh(self) -> None:
        self.idx = {GPU: TierIndex(CAP[GPU]), CPU: TierIndex(CAP[CPU]), REDIS: TierIndex(None)}
        self.p = Placement(POOL, self.idx, self.knobs)

    # --- the executor: TierWorker, synchronously ------------------------------------------------

    def execute(self, cmds, lost=frozenset(), keep_recent: bool = False) -> None:
        """Run commands and the commands their facts lead to; the n-th one run is lost if n in `lost`."""
        if not keep_recent:
            self.recent = []
        queue, n = deque(cmds), 0
        while queue:
            cmd = queue.popleft()
            n += 1
            if n - 1 in lost:  # dead-lettered or trimmed; a Store or Promote may still turn up late
                self.lost_until = max(self.lost_until or 0.0, self.now + 2 * T)
                if isinstance(cmd, (Store, Promote)) and len(self.parked) < 4:
                    self.parked.append(cmd)
                continue
            self.recent.append(cmd)
            fact = self.apply(cmd)
            if fact is not None:
                self.recent.append(fact)
                queue.extend(self.p.on_fact(fact))

    def apply(self, cmd) -> Stored | Removed | None:
        if isinstance(cmd, Store):
            return self.store(cmd)
        if isinstance(cmd, Evict):
            return self.evict(cmd)
        return self.transfer(cmd)

    def stored_fact(self, k: bytes, t: Tier, slot: int, cause: str) -> Stored:
        self.stored.add(k)
        return Stored(POOL, k, PARENT[k], t, slot, cause)

    def store(self, c: Store) -> Stored | Removed:
        if (held := self.idx[c.tier].get(c.key)) is not None:  # duplicate, or another client won
            self.staged.discard(c.gen)
            return Stored(POOL, c.key, c.parent, c.tier, held.slot, Store.TYPE)
        if c.gen not in self.staged:  # staging slot already released: its generation check fails
            return Removed(POOL, c.key, c.tier, "store_failed:verify")
        self.staged.discard(c.gen)
        if c.tier == REDIS:
            self.redis_put(c.key, bytes_of(c.key))
            return self.stored_fact(c.key, REDIS, -1, Store.TYPE)
        if (e := self.write_local(c.tier, c.key, bytes_of(c.key))) is None:
            return Removed(POOL, c.key, c.tier, "store_failed:no_room")
        return self.stored_fact(c.key, c.tier, e.slot, Store.TYPE)

    def transfer(self, c: Promote | Demote | Copy) -> Stored | Removed:
        if c.dst != REDIS and (have := self.idx[c.dst].get(c.key)) is not None:
            return Stored(POOL, c.key, c.parent, c.dst, have.slot, c.TYPE)
        if c.src == REDIS:
            payload = self.data[REDIS].get(c.key)
        else:
            e = self.idx[c.src].get(c.key)
            payload = self.data[c.src].get(c.key) if e is not None and e.state is State.READY else None
        if payload is None:
            if c.src == REDIS:
                self.idx[REDIS].remove(c.key)
            return Removed(POOL, c.key, c.dst, f"{c.TYPE}_failed:source_miss")
        if c.dst == REDIS:
            self.redis_put(c.key, payload)
            return self.stored_fact(c.key, REDIS, -1, c.TYPE)
        if (e := self.write_local(c.dst, c.key, payload)) is None:
            return Removed(POOL, c.key, c.dst, f"{c.TYPE}_failed:no_room")
        return self.stored_fact(c.key, c.dst, e.slot, c.TYPE)

    def evict(self, c: Evict) -> Removed | None:
        if c.tier == REDIS:
            self.data[REDIS].pop(c.key, None)
            self.idx[REDIS].remove(c.key)
            return Removed(POOL, c.key, REDIS, f"evict:{c.reason}")
        if self.idx[c.tier].get(c.key) is None:
            return None  # already gone: a duplicate
        lower = Tier(c.tier + 1)
        safe = c.key in self.idx[lower]
        if safe and lower == REDIS:
            safe = self.redis_has(c.key)
        if not safe and c.reason in DROP_REASONS:  # the frequency filter drops an unread block
            e = self.idx[c.tier].get(c.key)
            assert c.tier == CPU and e.hits < self.knobs.redis_admit_after_hits, f"bad {c.reason} drop"
            safe = True
            if all(c.key not in self.data[t] for t in (GPU, REDIS)):
                self.stored.discard(c.key)  # gone by a documented rule
        if not safe:  # the only copy: refuse
            self.p.refused(c.tier, c.key)
            return None
        self.drop(c.tier, c.key)
        return Removed(POOL, c.key, c.tier, f"evict:{c.reason}")

    def redis_put(self, k: bytes, payload: bytes) -> None:
        self.data[REDIS][k] = payload
        if any(self.idx[t].get(k) is not None for t in LOCAL):
            self.idx[REDIS].add(k, PARENT[k])

    def redis_has(self, k: bytes) -> bool:
        if k in self.data[REDIS]:
            return True
        self.idx[REDIS].remove(k)  # the record was stale (TTL): forget it
        return False

    def write_local(self, t: Tier, k: bytes, payload: bytes):
        idx = self.idx[t]
        if (e := idx.get(k)) is not None:
            return e
        e = idx.reserve(k, PARENT[k])
        if e is None and self.make_room(t):
            e = idx.reserve(k, PARENT[k])
        if e is None:
            return None
        assert e.slot not in self.headers[t], f"slot {e.slot} handed out twice in {t.label}"
        self.headers[t][e.slot] = k
        self.data[t][k] = payload
        return idx.commit(k)

    def make_room(self, t: Tier) -> bool:
        for _ in range(4):
            victim = self.p.clean_victim(t)
            if victim is None:
                return False
            if t == CPU and not self.redis_has(victim):
                continue
            self.drop(t, victim)
            return True
        return False

    def drop(self, t: Tier, k: bytes) -> None:
        """Every eviction from a local tier goes through here: check the eviction rules."""
        idx = self.idx[t]
        assert self.pins[(t, k)] == 0, f"{k!r} dropped from {t.label} while a reader pins it"
        assert idx.children(k) == 0, f"{k!r} dropped from {t.label} before its {idx.children(k)} children"
        assert self.leases.get(k, 0.0) <= self.now, f"{k!r} dropped from {t.label} under a prefetch lease"
        if t == CPU:
            assert self.idx[GPU].children(k) == 0, f"{k!r} left the node while a child sits in gpu"
        del self.headers[t][idx.get(k).slot]
        del self.data[t][k]
        idx.remove(k)
        if all(self.idx[u].get(k) is None for u in LOCAL):
            self.idx[REDIS].remove(k)

    def flush(self, cmds, lost=frozenset()) -> None:
        """Run a batch's commands, then shed what pressure asks for. (The coordinator asks before
        the batch has run; see test_write_back_keeps_a_parent_whose_children_arrived_meanwhile.)"""
        self.execute(cmds, lost)
        shed = self.p.pressure(self.now)
        self.expired()
        self.execute(shed, lost, keep_recent=True)

    def expired(self) -> None:
        """Call right after a policy call that expires marks (admit, on_access, pressure)."""
        if self.lost_until is not None and self.now >= self.lost_until:
            self.lost_until = None
        self.leases = {k: u for k, u in self.leases.items() if u > self.now}

    def resident(self) -> list[tuple[Tier, bytes]]:
        return [(t, k) for t in LOCAL for k in sorted(self.data[t])]

    def snapshot(self):
        def entries(t):
            return sorted((e.key, e.slot, e.state.value, e.pins, e.leaving, e.parent)
                          for e in self.idx[t].ready())
        return ([entries(t) for t in Tier], [[e.key for e in self.idx[t].ready()] for t in LOCAL],
                {t: dict(d) for t, d in self.data.items()})

    # --- rules ----------------------------------------------------------------------------------

    @rule(path=paths, lost=lose)
    def put(self, path, lost) -> None:
        cmds = []
        for k, t in zip(path, self.p.admit(list(path), self.now)):
            if t is not None:
                self.gen += 1
                self.staged.add(self.gen)
                cmds.append(Store(POOL, t, k, PARENT[k], "seg", self.gen % 16, self.gen))
        self.flush(cmds, lost)
        assert not any(isinstance(f, Removed) and f.cause == "store_failed:no_room" for f in self.recent), \
            "admit promised room that was not there: a put was dropped"

    @rule(data=st.data(), lost=lose)
    def get(self, data, lost) -> None:
        """A client reads the blocks it finds locally (exact bytes) and reports them."""
        local = sorted({k for _, k in self.resident()})
        keys = data.draw(st.lists(st.sampled_from(local or KEYS) | st.sampled_from(KEYS), max_size=4))
        hits = [k for k in keys if self.p.where(k) in LOCAL]
        for k in hits:
            assert self.data[self.p.where(k)][k] == bytes_of(k), "lookup returned the wrong bytes"
            self.leases.pop(k, None)
        self.flush(self.p.on_access(hits, self.now), lost)

    @rule(data=st.data(), lost=lose)
    def prefetch(self, data, lost) -> None:
        """Bring a chain up from Redis (mostly one that Redis holds blocks of)."""
        remote = [p for p in PATHS if any(k in self.data[REDIS] and not self.p.where(k) for k in p)]
        path = data.draw(st.sampled_from(remote or PATHS) | paths)
        cmds = self.p.on_prefetch(list(path), PARENT[path[0]], self.now)
        for k in path:
            self.leases[k] = self.now + LEASE
        self.flush(cmds, lost)

    @rule(lost=lose)
    def pressure(self, lost) -> None:
        self.flush([], lost)

    @rule(dt=st.floats(0.0, 2 * T, allow_nan=False), lost=lose)
    def advance(self, dt, lost) -> None:
        """Time passes (leases and in-flight marks may expire); capacity pressure is re-checked."""
        self.now += dt
        self.flush([], lost)

    @precondition(lambda self: sum(self.pins.values()) < 3 and any(self.data[t] for t in LOCAL))
    @rule(data=st.data())
    def pin(self, data) -> None:
        t, k = data.draw(st.sampled_from(self.resident()))
        assert self.idx[t].pin(k)
        self.pins[(t, k)] += 1

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        t, k = data.draw(st.sampled_from(sorted(+self.pins)))
        self.idx[t].unpin(k)
        self.pins[(t, k)] -= 1

    @precondition(lambda self: self.data[REDIS])
    @rule(data=st.data())
    def redis_ttl(self, data) -> None:
        """Redis drops a key by TTL; nobody tells the daemon. The documented way blocks leave."""
        k = data.draw(st.sampled_from(sorted(self.data[REDIS])))
        del self.data[REDIS][k]
        if all(k not in self.data[t] for t in LOCAL):
            self.stored.discard(k)

    @precondition(lambda self: self.recent)
    @rule(data=st.data())
    def duplicate(self, data) -> None:
        """At-least-once: an item of the last batch is delivered again, twice; the second changes nothing."""
        item = data.draw(st.sampled_from(self.recent))
        recent, states = list(self.recent), []
        for _ in range(2):
            if isinstance(item, (Stored, Removed)):
                self.execute(self.p.on_fact(item), keep_recent=True)
            elif (fact := self.apply(item)) is not None:
                self.execute(self.p.on_fact(fact), keep_recent=True)
            states.append(self.snapshot())
        assert states[0] == states[1], f"delivering {item} again changed the state"
        self.recent = recent

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def late(self, data) -> None:
        """A lost store or promote is delivered after all, after its marks may have expired.
        (A late demote or evict is test_late_write_back_* below.)"""
        cmd = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        if (fact := self.apply(cmd)) is not None:
            self.execute(self.p.on_fact(fact))

    @rule()
    def restart(self) -> None:
        """The daemon restarts: gpu is gone, cpu re-indexed from its slot headers, Redis kept."""
        self.stored -= {k for k in self.data[GPU] if k not in self.data[CPU] and k not in self.data[REDIS]}
        self.data[GPU].clear()
        self.headers[GPU].clear()
        self.pins.clear()
        self.leases.clear()
        self.staged.clear()
        self.recent, self.parked, self.lost_until = [], [], None
        self._fresh()
        for slot, k in sorted(self.headers[CPU].items()):
            assert self.idx[CPU].add(k, PARENT[k], slot) is not None

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        for t in LOCAL:
            idx = self.idx[t]
            assert idx.used <= CAP[t] and idx.free + idx.used == CAP[t]
            assert len(self.data[t]) * BLOCK_BYTES <= CAP[t] * BLOCK_BYTES
            assert len(self.headers[t]) == len(self.data[t])

    @invariant()
    def present_means_exact_bytes(self) -> None:
        for t in LOCAL:
            ready = {e.key: e for e in self.idx[t].ready()}
            assert ready.keys() == self.data[t].keys() == set(self.headers[t].values())
            assert len(self.idx[t]) == len(ready), "a PENDING entry outlived its transfer"
            for k, e in ready.items():
                assert self.headers[t][e.slot] == k and self.data[t][k] == bytes_of(k)
                assert e.parent == PARENT[k]
                assert self.idx[t].children(k) == sum(PARENT[c] == k for c in ready), "child count drifted"

    @invariant()
    def nothing_lost(self) -> None:
        held = set(self.data[GPU]) | set(self.data[CPU]) | set(self.data[REDIS])
        assert self.stored <= held, f"lost without a documented rule: {sorted(self.stored - held)}"

    @invariant()
    def pins_are_readers_plus_leaving_marks(self) -> None:
        for t in LOCAL:
            for e in self.idx[t].ready():
                assert e.pins == self.pins[(t, e.key)] + e.leaving, f"{e.key!r} pins leak in {t.label}"
        assert all(self.idx[t].get(k) is not None for (t, k), n in self.pins.items() if n)

    @invariant()
    def redis_record_only_for_local_blocks(self) -> None:
        for e in self.idx[REDIS].ready():
            assert any(self.idx[t].get(e.key) is not None for t in LOCAL)

    @invariant()
    def in_flight_marks_settle_or_expire(self) -> None:
        for t in LOCAL:
            idx = self.idx[t]
            assert idx.leaving == sum(e.leaving for e in idx.ready())
            if self.lost_until is None:  # every command ran to its fact, or its marks expired
                assert idx.leaving == 0 and self.p.incoming(t) == 0, f"{t.label} keeps stale marks"


TestPolicyState = PolicyMachine.TestCase
TestPolicyState.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- defects found by the machine, kept as failing cases ---------------------------------------
A0, A1, A2 = key("a0"), key("a1"), key("a2")


def _placement() -> Placement:
    return Placement(POOL, {GPU: TierIndex(3), CPU: TierIndex(5), REDIS: TierIndex(None)}, PolicyKnobs())


def _stored(p: Placement, t: Tier, k: bytes, cause: str) -> list:
    """A worker stored `k` in `t` (index and fact), as TierWorker does; the policy's answer."""
    p.tiers[t].add(k, PARENT[k])
    return p.on_fact(Stored(POOL, k, PARENT[k], t, p.tiers[t].get(k).slot, cause))


@pytest.mark.xfail(strict=True, reason="BUG: Coordinator.flush asks pressure() before the batch's stores run; "
                   "_shed counts the incoming children but picks their parent as a leaf, and on_fact then "
                   "evicts the parent while its children sit in the same tier")
def test_write_back_keeps_a_parent_whose_children_arrived_meanwhile() -> None:
    p = _placement()
    _stored(p, GPU, A0, "store")
    assert p.admit([A0, A1, A2], 0.0) == [None, GPU, GPU]  # a client extends the chain a0 -> a1 -> a2
    shed = p.pressure(0.0)  # same flush, same publish as the two stores
    for k in (A1, A2):
        _stored(p, GPU, k, "store")
    for c in shed:  # then the cpu worker carries out the write-back
        if isinstance(c, Demote):
            for ev in _stored(p, c.dst, c.key, "demote"):
                assert not (isinstance(ev, Evict) and p.tiers[ev.tier].children(ev.key)), \
                    f"evict {ev.key!r} from {ev.tier.label} before its children"


@pytest.mark.xfail(strict=True, reason="BUG: Placement.on_fact answers any stored(demote) fact with an evict of "
                   "the source copy without checking that the policy marked it leaving: a redelivered fact "
                   "evicts a block that has come back since and is pinned by a reader")
def test_a_redelivered_demote_fact_does_not_evict_a_block_that_came_back() -> None:
    p = _placement()
    gpu, cpu = p.tiers[GPU], p.tiers[CPU]
    for k in (A0, key("c0"), key("d0")):
        _stored(p, GPU, k, "store")
    (demote,) = p.pressure(0.0)  # a0, the coldest, is written back to cpu
    assert isinstance(demote, Demote) and demote.key == A0
    assert _stored(p, CPU, A0, "demote") == [Evict(POOL, A0, GPU, "demoted")]
    gpu.remove(A0)  # the gpu worker drops it
    p.on_fact(Removed(POOL, A0, GPU, "evict:demoted"))
    first = Stored(POOL, A0, None, CPU, cpu.get(A0).slot, "demote")
    for _ in range(2):  # read twice from cpu: promoted back to gpu, where a reader pins it
        promote = p.on_access([A0], 1.0)
    assert [type(c) for c in promote] == [Promote]
    _stored(p, GPU, A0, "promote")
    assert gpu.pin(A0) and gpu.get(A0).leaving is False
    assert p.on_fact(first) == [], "the old fact, redelivered, evicts the pinned a0 from gpu"
