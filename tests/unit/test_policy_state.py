"""Stateful test of the pure tiering core: TierIndex (gpu, cpu, redis) + Placement for one pool.

A Hypothesis state machine drives the policy with client events (put, get, prefetch), time,
pressure, reader pins, Redis TTL expiry and outages, lost, late and duplicated deliveries and
daemon restarts, under drawn knobs and tier sizes. A synchronous executor carries out the
commands as kvtier/tiers/worker.py does, in the order Coordinator.flush publishes them, and
feeds every fact back through `Placement.on_fact`. It decides what the worker decides with the
worker's own rules (kvtier/core/eviction.py: what may leave a tier; kvtier/core/outcomes.py: the
fact, counter and Redis record each command's outcome comes to) and changes the indices only as
the worker does, through the Placement's methods; only the I/O is modelled (Redis down: every
read, write and check fails with an error). Plain dicts model the bytes each tier
holds and the cpu slot headers; a block's bytes are a function of its key, and the keys form a
small forest (chains with a branch) so puts collide and prefixes matter.

Every command may be lost (dead-lettered, trimmed) or delivered again late, evictions
included: the worker carries out an evict only for a block still marked leaving, so a late one
for a block that stayed or came back is skipped.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.core.events import Cause, Copy, Demote, Evict, Failure, Promote, Reason, Removed, Store, Stored, Tier
from kvtier.core.eviction import REFUSED, ROOM_TRIES, Verdict, after_redis_check, evict_verdict, room_victim
from kvtier.core.index import State, TierIndex
from kvtier.core.knobs import RedisWrite
from kvtier.core.outcomes import MOVED_IN, Count, Outcome, asked_redis, evicted, held, kept, read, sent, written
from kvtier.core.policy import DROP_REASONS, Placement
from tests.support.placement import knobs

POOL = "p"
GPU, CPU, DISK, REDIS = Tier.GPU, Tier.CPU, Tier.DISK, Tier.REDIS
LOCAL = (GPU, CPU)  # the memory tiers: puts and promotions land there
NODE = (GPU, CPU, DISK)  # this node's tiers: a block in any of them has not left the node
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
lose = st.just(frozenset()) | st.frozensets(st.integers(0, 4), min_size=1, max_size=2)  # lost commands
readers = st.none() | st.integers(0, 7)  # which block chosen to leave a reader pins in time, if any


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.data: dict[Tier, dict[bytes, bytes]] = {t: {} for t in Tier}  # the bytes each tier holds
        self.headers: dict[Tier, dict[int, bytes]] = {t: {} for t in NODE}  # slot -> key, as in slot headers
        self.pins: Counter[tuple[Tier, bytes]] = Counter()  # readers' pins taken by the test
        self.leases: dict[bytes, float] = {}  # prefetched, not yet read -> lease expiry
        self.stored: set[bytes] = set()  # reported stored, and not since lost by a documented rule
        self.staged: set[int] = set()  # staging gens not yet released
        self.gen = 0
        self.history: list = []  # the latest commands and facts, for duplicate delivery
        self.parked: list[Store | Promote] = []  # lost commands that may still turn up late
        self.lost_until: float | None = None  # marks of lost commands expire by then
        self.redis_up = True  # False: every Redis call fails (RedisError)
        self.extra: list[Removed] = []  # facts a handler reports besides its own (make_room's evictions)
        self.outcome: Outcome | None = None  # the latest one settled: the command's own, once it has run

    @initialize(write=st.sampled_from(RedisWrite), admit_after=st.sampled_from([0, 2]),
                prefetch_to=st.sampled_from([CPU, GPU]), high=st.sampled_from([0.9, 1.0]),
                gpu=st.sampled_from([2, 3]), cpu=st.sampled_from([3, 5]), disk=st.sampled_from([0, 2, 3]),
                disk_admit=st.sampled_from([0, 1]))
    def configure(self, write, admit_after, prefetch_to, high, gpu, cpu, disk, disk_admit) -> None:
        """Knobs and sizes per run; high_watermark 1.0 never sheds: tiers fill, workers make room.
        A disk of 0 is a pool without a disk tier."""
        self.cap = {GPU: gpu, CPU: cpu, DISK: disk}
        self.knobs = knobs(high_watermark=high, low_watermark=0.6, promote_after_hits=2,
                           prefetch_lease_s=LEASE, transfer_timeout_s=T, redis_write=write,
                           redis_admit_after_hits=admit_after, prefetch_to=prefetch_to,
                           disk_admit_after=disk_admit)
        self._fresh()

    def _fresh(self) -> None:
        self.idx = {GPU: TierIndex(self.cap[GPU]), CPU: TierIndex(self.cap[CPU]), DISK: TierIndex(self.cap[DISK]),
                    REDIS: TierIndex(None)}
        self.p = Placement(POOL, self.idx, self.knobs)

    # --- the executor: TierWorker, synchronously ------------------------------------------------

    def execute(self, cmds, lost=frozenset()) -> list[Stored | Removed]:
        """Run commands and the commands their facts lead to; the n-th one run is lost if n in `lost`.
        Returns the facts reported."""
        queue, n, facts = deque(cmds), 0, []
        while queue:
            cmd = queue.popleft()
            n += 1
            if n - 1 in lost:  # dead-lettered or trimmed
                self.lost_until = max(self.lost_until or 0.0, self.now + 2 * T)
                if isinstance(cmd, (Store, Promote)) and len(self.parked) < 4:
                    self.parked.append(cmd)
                continue
            self.history.append(cmd)
            for fact in self.apply(cmd):
                self.history.append(fact)
                facts.append(fact)
                self.observe(fact)
                for c in self.p.on_fact(fact):  # a write-back ends only for its leaving, free block
                    e = self.idx[c.tier].get(c.key) if isinstance(c, Evict) else None
                    assert e is None or (e.leaving and e.pins == 1 and not self.idx[c.tier].children(c.key)), c
                    queue.append(c)
        del self.history[:-40]
        return facts

    def observe(self, fact: Stored | Removed) -> None:
        """What a fact changes in the model besides the tiers, as on_fact does in the policy."""
        # The policy gives up the lease of what never came, not of a block that is here (a late
        # failure must not end the lease of a newer prefetch).
        here = any(fact.key in self.data[t] for t in NODE)
        if isinstance(fact, Removed) and fact.cause == Cause.PROMOTE and not here:
            self.leases.pop(fact.key, None)

    def apply(self, cmd) -> list[Stored | Removed]:
        """One command, as TierWorker.handle: the facts it reports, in order."""
        dst = cmd.tier if isinstance(cmd, (Store, Evict)) else cmd.dst
        here = cmd.key in self.data[dst]
        if isinstance(cmd, Store):
            fact = self.store(cmd)
        elif isinstance(cmd, Evict):
            fact = self.evict(cmd)
        else:
            fact = self.transfer(cmd)
        if dst in NODE and not isinstance(cmd, Evict):  # what the outcome says, against what happened
            o = self.outcome
            assert not (here and o.count in MOVED_IN), f"{cmd}: counted as moved in, but {dst.label} held it already"
            assert not (o.count is Count.FAILED and cmd.key in self.data[dst]), \
                f"{cmd}: reported failed, but {dst.label} holds the block"
        facts, self.extra = self.extra + [fact] * (fact is not None), []
        return facts

    def settle(self, cmd, o: Outcome) -> Stored | Removed | None:
        """Apply an outcome as the worker does (kvtier/tiers/facts.py `settle`): what it says of
        Redis's copy goes to the policy; a block it moved is one the model must not lose."""
        if o.in_redis is True:
            assert isinstance(o.fact, Stored), o
            assert o.fact.tier == REDIS or (cmd.src == REDIS and o.fact.key in self.data[REDIS]), \
                f"{cmd}: recorded in Redis, which does not hold it"
            self.p.in_redis(o.fact.key, o.fact.parent)
        elif o.in_redis is False:
            self.p.not_in_redis(o.fact.key)
        if isinstance(o.fact, Stored) and o.count is not None:  # moved in now
            assert o.fact.key in self.data[o.fact.tier], f"{cmd}: reported stored, not there"
            self.stored.add(o.fact.key)
        if o.dropped:
            assert isinstance(cmd, Store) and isinstance(o.fact, Removed), o
        self.outcome = o
        return o.fact

    def store(self, c: Store) -> Stored | Removed | None:
        """As TierWorker._store, with the worker's outcome rules (kvtier/core/outcomes.py)."""
        if (o := held(self.p, c, c.tier)) is not None:  # duplicate, or another client won
            self.staged.discard(c.gen)
            return self.settle(c, o)
        # A staging slot released already fails its generation check: a changed block.
        got = bytes_of(c.key) if c.gen in self.staged else None
        self.staged.discard(c.gen)
        if (o := read(c, c.tier, got)) is not None:
            return self.settle(c, o)
        if c.tier == REDIS:
            return self.settle(c, sent(c, self.redis_put(c.key, got)))
        return self.settle(c, written(c, c.tier, self.write_local(c.tier, c.key, got)))

    def transfer(self, c: Promote | Demote | Copy) -> Stored | Removed | None:
        """As TierWorker._transfer and _promoted."""
        if (o := held(self.p, c, c.dst)) is not None:
            return self.settle(c, o)
        if c.src == REDIS:
            got = self.data[REDIS].get(c.key) if self.redis_up else ConnectionError("redis is down")
        else:
            e = self.idx[c.src].get(c.key)
            got = self.data[c.src].get(c.key) if e is not None and e.state is State.READY else None
        if (o := read(c, c.dst, got)) is not None:
            return self.settle(c, o)
        if c.dst == REDIS:
            return self.settle(c, sent(c, self.redis_put(c.key, got)))
        return self.settle(c, written(c, c.dst, self.write_local(c.dst, c.key, got)))

    def evict(self, c: Evict) -> Stored | Removed | None:
        """As Evictions.evict."""
        if c.tier == REDIS:
            self.data[REDIS].pop(c.key, None)
            return self.settle(c, evicted(POOL, c.key, REDIS, c.reason))
        # The worker's own rules (kvtier/core/eviction.py): gone, stale, busy, safe or the only copy.
        verdict = evict_verdict(self.p, c.tier, c.key, c.reason)
        in_redis = False
        if verdict is Verdict.ASK_REDIS:
            in_redis = self.redis_has(c.key)
            verdict = after_redis_check(in_redis, c.reason)
        if verdict is not Verdict.DROP:
            if verdict in REFUSED:
                self.p.refused(c.tier, c.key)
            o = kept(verdict)
            assert o.fact is None, f"{c}: {verdict} reports {o.fact}"
            return self.settle(c, o)
        # No lower tier holds it: a documented drop (the frequency filter), of a block read too little.
        if not (any(c.key in self.idx[u] for u in NODE if u > c.tier) or in_redis):
            assert c.reason in DROP_REASONS, f"{c}: dropped the only copy"
            n = self.knobs.redis_admit_after_hits
            assert all(x.hits < n for t in NODE if (x := self.idx[t].get(c.key))), \
                f"{c.reason} drop of a block read {n} times"
            if all(c.key not in self.data[t] for t in Tier if t != c.tier):
                self.stored.discard(c.key)  # gone by a documented rule
        self.drop(c.tier, c.key, c.reason)
        return self.settle(c, evicted(POOL, c.key, c.tier, c.reason))

    def redis_put(self, k: bytes, payload: bytes) -> Exception | None:
        """A SET: None, or the error Redis gave."""
        if not self.redis_up:
            return ConnectionError("redis is down")
        self.data[REDIS][k] = payload
        return None

    def redis_has(self, k: bytes) -> bool:
        """An EXISTS before the last local copy goes, and what its answer means (`asked_redis`)."""
        present, in_redis = asked_redis(k in self.data[REDIS] if self.redis_up else ConnectionError("redis is down"))
        if in_redis is False:
            self.p.not_in_redis(k)  # the record was stale (TTL): forget it
        return present

    def write_local(self, t: Tier, k: bytes, payload: bytes):
        """As LocalWrites.write: the entry, or None when the tier has no room even after making some."""
        idx = self.idx[t]
        if (e := idx.get(k)) is not None:
            return e
        e = self.p.reserve(t, k, PARENT[k])
        if e is None and self.make_room(t):
            e = self.p.reserve(t, k, PARENT[k])
        if e is None:
            return None
        assert e.slot not in self.headers[t], f"slot {e.slot} handed out twice in {t.label}"
        self.headers[t][e.slot] = k
        self.data[t][k] = payload
        return self.p.commit(t, k)

    def make_room(self, t: Tier) -> bool:
        """As Evictions.make_room: the victims the worker's rule picks, confirmed as it confirms them."""
        for _ in range(ROOM_TRIES):
            choice = room_victim(self.p, t)
            if choice is None:
                return False
            victim, verdict = choice
            over = self.p.tenants.excess(t, self.idx[t].capacity or 0)
            assert not over or self.p.tenants.owner(victim) in over, \
                f"{victim!r} taken to make room in {t.label} from a tenant within its share, while {over} are over"
            if verdict is Verdict.ASK_REDIS:
                verdict = after_redis_check(self.redis_has(victim), Reason.MAKE_ROOM)
            if verdict is Verdict.DROP:
                assert any(victim in self.idx[u] for u in NODE if u > t) or victim in self.data[REDIS], \
                    f"{victim!r}: the only copy"
                self.drop(t, victim, Reason.MAKE_ROOM)
                self.extra.append(self.settle(None, evicted(POOL, victim, t, Reason.MAKE_ROOM)))
                return True
        return False

    def drop(self, t: Tier, k: bytes, why: str) -> None:
        """Every eviction from a local tier goes through here: check the eviction rules."""
        idx = self.idx[t]
        assert self.pins[(t, k)] == 0, f"{k!r} dropped from {t.label} while a reader pins it"
        assert idx.children(k) == 0, f"{k!r} dropped from {t.label} before its {idx.children(k)} children"
        # A lease keeps a prefetched block on the node until it is read; a move that was decided
        # before the prefetch may still finish, as long as it leaves a local copy.
        stays = any(k in self.data[u] for u in NODE if u != t)  # another copy on the node
        assert self.leases.get(k, 0.0) <= self.now or stays, f"{k!r} left the node under a prefetch lease"
        assert k not in self.p.pins or stays, f"{k!r} left the node under a session pin"
        if not stays:
            for u in NODE:
                assert u == t or self.idx[u].children(k) == 0, f"{k!r} left the node while a child sits in {u.label}"
        if t == CPU and k not in self.data[DISK]:  # a cpu block with gpu children keeps its node copy below it
            assert self.idx[GPU].children(k) == 0, f"{k!r} left cpu for Redis while a child sits in gpu"
        del self.headers[t][idx.get(k).slot]
        del self.data[t][k]
        self.p.dropped(t, k)

    def flush(self, cmds, lost=frozenset(), room_promised: bool = False, reader: int | None = None,
              may_fail: int = 0) -> None:
        """As Coordinator.flush: what pressure sheds joins the batch's commands, decided before
        any of them has run, and all are published (here: run) together. With a `reader`, a
        reader pins one of the blocks chosen to leave after the choice, before its worker acts."""
        # Before the decision (and after the marks it expires first): each tenant's excess, less
        # what of it is already on its way out.
        self.p._expire(self.now)
        over = {t: self.p.tenants.excess(t, self.idx[t].capacity or 0) for t in NODE}
        for t in NODE:
            for e in self.idx[t].ready():
                if e.leaving and self.p.tenants.owner(e.key) in over[t]:
                    over[t][self.p.tenants.owner(e.key)] -= 1
        shed = self.p.pressure(self.now)
        self.expired()
        taken: Counter[tuple[Tier, str]] = Counter()
        for c in shed:  # the decisions themselves: evictable blocks, and safe ways out
            if isinstance(c, Promote):  # a prefetched block that waited for a cpu slot
                assert c.src in (REDIS, DISK) and c.dst == CPU and self.p.tiers[CPU].get(c.key) is None, c
                continue
            t = c.tier if isinstance(c, Evict) else c.src
            e = self.idx[t].get(c.key)
            assert e.leaving and e.pins == 1 and not self.pins[(t, c.key)], f"{c}: pinned"
            assert not self.idx[t].children(c.key), f"{c}: a parent of resident blocks"
            assert self.leases.get(c.key, 0.0) <= self.now, f"{c}: under a prefetch lease"
            on_node = ((isinstance(c, Demote) and c.dst in NODE)
                       or (isinstance(c, Evict) and any(c.key in self.idx[u] for u in NODE if u > t)))
            assert t == GPU or on_node or not self.idx[GPU].children(c.key), f"{c}: parent of gpu blocks"
            assert t != DISK or not self.idx[CPU].children(c.key), f"{c}: parent of cpu blocks off the node"
            assert not (t == GPU and isinstance(c, Demote) and c.dst == REDIS
                        and (self.idx[CPU].children(c.key) or self.idx[DISK].children(c.key))), \
                f"{c}: sends a parent of cpu or disk blocks off the node"
            if isinstance(c, Evict):
                assert c.reason in DROP_REASONS or any(c.key in self.idx[u] for u in Tier if u > t), c
            assert on_node or c.key not in self.p.pins, f"{c}: sends a session-pinned block off the node"
            who = self.p.tenants.owner(c.key)
            taken[(t, who)] += 1
            # Fair share: while a tenant is over its share of t, only tenants over theirs shed
            # there, none beyond its excess.
            assert not over[t] or taken[(t, who)] <= over[t].get(who, 0), \
                f"{c}: tenant {who!r} shed below its share of {t.label} while {over[t]} were over"
        chosen = [c for c in shed if not isinstance(c, Promote)]
        if reader is not None and chosen and sum(self.pins.values()) < 3:
            c = chosen[reader % len(chosen)]
            t = c.tier if isinstance(c, Evict) else c.src
            assert self.idx[t].pin(c.key)
            self.pins[(t, c.key)] += 1
        facts = self.execute(list(cmds) + shed, lost)
        if room_promised:  # admit and promote-on-hits count what is on its way in
            no_room = [f for f in facts if isinstance(f, Removed) and f.why == Failure.NO_ROOM]
            assert len(no_room) <= may_fail and all(f.cause == Cause.STORE for f in no_room), \
                f"room was promised that was not there: {no_room}"

    def expired(self) -> None:
        """Call right after a policy call that expires marks (admit, on_access, pressure)."""
        if self.lost_until is not None and self.now >= self.lost_until:
            self.lost_until = None
        self.leases = {k: u for k, u in self.leases.items() if u > self.now}

    def resident(self) -> list[tuple[Tier, bytes]]:
        return [(t, k) for t in NODE for k in sorted(self.data[t])]

    def snapshot(self):
        def entries(t):
            return sorted((e.key, e.slot, e.state.value, e.pins, e.leaving, e.parent)
                          for e in self.idx[t].ready())
        return ([entries(t) for t in Tier], [[e.key for e in self.idx[t].ready()] for t in NODE],
                {t: dict(d) for t, d in self.data.items()})

    # --- rules ----------------------------------------------------------------------------------

    @rule(path=paths, lost=lose, reader=readers, tenant=st.sampled_from(["", "x", "y"]))
    def put(self, path, lost, reader, tenant) -> None:
        free = sum(self.p.room(t) for t in LOCAL)
        tiers, cmds = self.p.on_put(list(path), PARENT[path[0]], self.now, tenant=tenant)
        for k, t in zip(path, tiers):
            if t is not None:
                self.gen += 1
                self.staged.add(self.gen)
                cmds.append(Store(POOL, t, k, PARENT[k], "seg", self.gen % 16, self.gen))
        # Blocks admitted beyond the free room rely on clean blocks the worker drops to make
        # room, which Redis may turn out not to hold any more (TTL, an outage): those may fail.
        on_spares = max(0, sum(t in LOCAL for t in tiers) - free)
        self.flush(cmds, lost, room_promised=True, reader=reader, may_fail=on_spares)

    @rule(data=st.data(), lost=lose)
    def get(self, data, lost) -> None:
        """A client reads the blocks it finds locally (exact bytes) and reports them."""
        local = sorted({k for _, k in self.resident()})
        keys = data.draw(st.lists(st.sampled_from(local or KEYS) | st.sampled_from(KEYS), max_size=4))
        hits = [k for k in keys if self.p.where(k) in NODE]  # disk blocks too: clients read them
        for k in hits:
            assert self.data[self.p.where(k)][k] == bytes_of(k), "lookup returned the wrong bytes"
            self.leases.pop(k, None)
        self.flush(self.p.on_access(hits, self.now), lost, room_promised=True)

    @rule(data=st.data(), lost=lose)
    def prefetch(self, data, lost) -> None:
        """Bring a chain up from Redis or disk: mostly one that memory lacks, as `locate` reports it."""
        below = lambda k: k in self.data[REDIS] or k in self.data[DISK]  # noqa: E731
        remote = [p for p in PATHS if all(below(k) and self.p.where(k) not in LOCAL for k in p)]
        path = data.draw(st.sampled_from(remote or PATHS) | paths)
        cmds = self.p.on_prefetch(list(path), PARENT[path[0]], self.now)
        # Leased, up to half the memory slots. Which blocks get one under that cap is the policy's
        # call: a lost promote keeps its block's lease (and a cap slot) in the policy while it may
        # still come, which the model cannot see; it checks the cap and that no leased block is shed.
        assert len(self.p._leases) <= (self.cap[GPU] + self.cap[CPU]) // 2
        for k in path:
            if k in self.p._leases:
                self.leases[k] = self.now + LEASE
        self.flush(cmds, lost)

    @rule(lost=lose, reader=readers)
    def pressure(self, lost, reader) -> None:
        self.flush([], lost, reader=reader)

    @rule(dt=st.sampled_from([LEASE, T, 2 * T]) | st.floats(0.0, 2 * T), lost=lose)
    def advance(self, dt, lost) -> None:
        """Time passes (leases and in-flight marks may expire); capacity pressure is re-checked."""
        self.now += dt
        self.flush([], lost)

    @precondition(lambda self: sum(self.pins.values()) < 3 and any(self.data[t] for t in NODE))
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

    @rule(path=paths, ttl=st.sampled_from([0, 1, 10, 2 * T]), tenant=st.sampled_from(["", "x"]))
    def session_pin(self, path, ttl, tenant) -> None:
        """A session pin (or its release, ttl 0): what was pinned stays on the node until it ends
        (checked in `drop` and `flush`), and its Redis copies are asked to live as long."""
        verdict, retain = self.p.on_pin(path, tenant, ttl, self.now)
        self.expired()
        assert all(k in self.p.pins and self.p.pins.until(k) >= self.now + ttl for k in verdict.pinned)
        assert retain is None if not verdict.pinned else (retain.keys == verdict.pinned and retain.ttl_s == ttl)
        for k in verdict.pinned:  # a move off the node decided before the pin is called off
            assert not any((e := self.idx[t].get(k)) is not None and e.leaving and self.p.held_below(t, k) not in NODE
                           and not any(c for c in (CPU, DISK) if self.p._demoting.get((c, k)) == t) for t in NODE)
        assert len(self.p.pins) <= self.p.pins.rules.node_share * self.p.node_slots()

    @precondition(lambda self: self.data[REDIS])
    @rule(data=st.data())
    def redis_ttl(self, data) -> None:
        """Redis drops a key by TTL; nobody tells the daemon. The documented way blocks leave."""
        k = data.draw(st.sampled_from(sorted(self.data[REDIS])))
        del self.data[REDIS][k]
        if all(k not in self.data[t] for t in NODE):
            self.stored.discard(k)

    @rule()
    def redis_outage(self) -> None:
        """Redis goes away, or comes back: writes, reads and checks fail meanwhile."""
        self.redis_up = not self.redis_up

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def duplicate(self, data) -> None:
        """At least once: a recent command or fact comes again, perhaps late, twice: safe, and the
        second delivery changes nothing."""
        item = data.draw(st.sampled_from(self.history))
        states = []
        for _ in range(2):
            for fact in [item] if isinstance(item, (Stored, Removed)) else self.apply(item):
                self.observe(fact)  # the coordinator takes it as any other fact
                self.execute(self.p.on_fact(fact))
            states.append(self.snapshot())
        assert states[0] == states[1], f"delivering {item} again changed the state"

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def late(self, data) -> None:
        """A lost store or promote is delivered after all, perhaps after its marks expired."""
        cmd = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        for fact in self.apply(cmd):
            self.observe(fact)
            self.execute(self.p.on_fact(fact))

    @precondition(lambda self: len(self.history) >= 30)  # some traffic since the last one
    @rule()
    def restart(self) -> None:
        """The daemon restarts: gpu is gone, cpu and disk re-indexed from their slot headers, Redis kept."""
        self.stored -= {k for k in self.data[GPU] if all(k not in self.data[t] for t in (CPU, DISK, REDIS))}
        self.data[GPU].clear()
        self.headers[GPU].clear()
        self.pins.clear()
        self.leases.clear()
        self.staged.clear()
        self.history, self.parked, self.lost_until = [], [], None
        self._fresh()
        for t in (CPU, DISK):
            for slot, k in sorted(self.headers[t].items()):
                assert self.p.restore(t, k, PARENT[k], slot) is not None  # as arena_fill and disk_adoption do

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def within_capacity(self) -> None:
        for t in NODE:
            idx = self.idx[t]
            assert idx.used <= self.cap[t] and idx.free + idx.used == self.cap[t]
            assert len(self.data[t]) * BLOCK_BYTES <= self.cap[t] * BLOCK_BYTES
            assert len(self.headers[t]) == len(self.data[t])

    @invariant()
    def present_means_exact_bytes(self) -> None:
        for t in NODE:
            ready = {e.key: e for e in self.idx[t].ready()}
            assert ready.keys() == self.data[t].keys() == set(self.headers[t].values())
            assert len(self.idx[t]) == len(ready), "a PENDING entry outlived its transfer"
            for k, e in ready.items():
                assert self.headers[t][e.slot] == k and self.data[t][k] == bytes_of(k)
                assert e.parent == PARENT[k]
                assert self.idx[t].children(k) == sum(PARENT[c] == k for c in ready), "child count drifted"

    @invariant()
    def nothing_lost(self) -> None:
        held = set(self.data[GPU]) | set(self.data[CPU]) | set(self.data[DISK]) | set(self.data[REDIS])
        assert self.stored <= held, f"lost without a documented rule: {sorted(self.stored - held)}"

    @invariant()
    def pins_are_readers_plus_leaving_marks(self) -> None:
        for t in NODE:
            for e in self.idx[t].ready():
                assert e.pins == self.pins[(t, e.key)] + e.leaving, f"{e.key!r} pins leak in {t.label}"
        assert all(self.idx[t].get(k) is not None for (t, k), n in self.pins.items() if n)

    @invariant()
    def tenant_counts_are_what_the_tiers_hold(self) -> None:
        for t in NODE:
            held = Counter(self.p.tenants.owner(e.key) for e in self.idx[t].ready())
            assert held == self.p.tenants.blocks.get(t, Counter()), f"{t.label}: tenant counts drifted"
        for k in list(self.p.tenants._owner):  # an owner only for a block on the node, or on its way
            assert any(self.idx[t].get(k) is not None or k in self.p._incoming[t] for t in NODE), \
                f"{k!r}: a tenant remembered for a block gone from the node"

    @invariant()
    def redis_record_only_for_local_blocks(self) -> None:
        for e in self.idx[REDIS].ready():
            assert any(self.idx[t].get(e.key) is not None for t in NODE)

    @invariant()
    def in_flight_marks_settle_or_expire(self) -> None:
        for t in NODE:
            idx = self.idx[t]
            assert idx.leaving == sum(e.leaving for e in idx.ready())
            if self.lost_until is None:  # every command ran to its fact, or its marks expired
                assert idx.leaving == 0 and self.p.incoming(t) == 0, \
                    f"{t.label} keeps stale marks: leaving {[e.key for e in idx.ready() if e.leaving]}"


TestPolicyState = PolicyMachine.TestCase
TestPolicyState.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


# --- what the machine found, as small cases -----------------------------------------------------
A0, A1, A2, C0, C1, D0 = (key(n) for n in ("a0", "a1", "a2", "c0", "c1", "d0"))


def _placement(gpu: int = 3, cpu: int = 5, **changed) -> Placement:
    tiers = {GPU: TierIndex(gpu), CPU: TierIndex(cpu), REDIS: TierIndex(None)}
    return Placement(POOL, tiers, knobs(**changed))


def _stored(p: Placement, t: Tier, k: bytes, cause: Cause) -> list:
    """A worker stored `k` in `t` (index and fact), as TierWorker does; the policy's answer."""
    if t == REDIS:
        assert p.in_redis(k, PARENT[k])
    else:
        assert p.reserve(t, k, PARENT[k]) is not None and p.commit(t, k) is not None
    return p.on_fact(Stored(POOL, k, PARENT[k], t, p.tiers[t].get(k).slot, cause))


def test_write_back_keeps_a_parent_whose_children_arrived_meanwhile() -> None:
    """Found before 24ad0dd: the shed decided in the same flush as a put's stores chose their parent."""
    p = _placement()
    _stored(p, GPU, A0, Cause.STORE)
    assert p.admit([A0, A1, A2], 0.0) == [None, GPU, GPU]  # a client extends the chain a0 -> a1 -> a2
    # Same flush, same publish as the two stores: a0's children are on their way in, so it stays.
    assert p.pressure(0.0) == []
    # Chosen before the children were announced at all: the demote completes, a0 stays in gpu.
    q = _placement(high_watermark=0.3, low_watermark=0.1)  # a0 alone is too much
    _stored(q, GPU, A0, Cause.STORE)
    shed = q.pressure(0.0)
    assert [(type(c), c.key) for c in shed] == [(Demote, A0)]
    assert q.admit([A0, A1, A2], 0.0) == [None, GPU, GPU]
    for k in (A1, A2):
        _stored(q, GPU, k, Cause.STORE)
    assert _stored(q, CPU, A0, Cause.DEMOTE) == [], "evicts a0 from gpu before its children"
    assert not q.tiers[GPU].get(A0).leaving and q.tiers[GPU].get(A0).pins == 0


def test_a_late_demote_fact_evicts_only_a_block_still_leaving() -> None:
    """Found before 24ad0dd: a redelivered stored(demote) fact evicted a block that had come back."""
    p = _placement(gpu=4, high_watermark=0.5, low_watermark=0.5)
    gpu = p.tiers[GPU]
    for k in (A0, C0, D0):
        _stored(p, GPU, k, Cause.STORE)
    assert [(type(c), c.key) for c in p.pressure(0.0)] == [(Demote, A0)]  # the coldest, written back
    assert _stored(p, CPU, A0, Cause.DEMOTE) == [Evict(POOL, A0, GPU, Reason.DEMOTED)]
    p.dropped(GPU, A0)  # the gpu worker drops it
    p.on_fact(Removed(POOL, A0, GPU, Cause.EVICT, Reason.DEMOTED))
    for _ in range(2):  # read twice from cpu: promoted back to gpu
        promote = p.on_access([A0], 1.0)
    assert [type(c) for c in promote] == [Promote]
    _stored(p, GPU, A0, Cause.PROMOTE)
    _stored(p, GPU, A1, Cause.STORE)  # the chain grows in gpu, and a reader pins a0
    assert gpu.pin(A0) and not gpu.get(A0).leaving and gpu.children(A0) == 1
    late = Stored(POOL, A0, None, CPU, p.tiers[CPU].get(A0).slot, Cause.DEMOTE)  # redelivered (XAUTOCLAIM)
    assert p.on_fact(late) == [], "the old fact evicts a0 from gpu: pinned, not leaving, with a child"


def test_a_cpu_write_back_keeps_a_parent_of_gpu_blocks() -> None:
    """Found by the machine: a write-back decided before a gpu child arrived evicted its cpu parent."""
    p = _placement()
    for k in (C0, D0, A0, A1, A2):  # cpu over its high watermark; c0 and d0 the coldest leaves
        _stored(p, CPU, k, Cause.STORE)
    assert p.admit([C0, C1], 0.0) == [None, GPU]  # a client extends c0 (in cpu) with c1
    shed = p.pressure(0.0)  # decided in the flush that publishes the store of c1
    assert (Demote, C0, REDIS) not in [(type(c), c.key, c.dst) for c in shed], "c1 is on its way into gpu"
    # Chosen before c1 was announced: the write-back completes, but c0 stays on the node.
    q = _placement()
    for k in (C0, D0, A0, A1, A2):
        _stored(q, CPU, k, Cause.STORE)
    assert (Demote, C0, REDIS) in [(type(c), c.key, c.dst) for c in q.pressure(0.0)]
    assert q.admit([C0, C1], 0.0) == [None, GPU]
    _stored(q, GPU, C1, Cause.STORE)  # the store runs first
    cmds = _stored(q, REDIS, C0, Cause.DEMOTE)  # then the write-back of c0 completes
    assert Evict(POOL, C0, CPU, Reason.DEMOTED) not in cmds, "c0 leaves the node while its child c1 is in gpu"


def test_a_redis_write_back_completes_the_cpu_copy() -> None:
    """Found by the machine: a stored(redis, demote) fact was credited to the gpu copy, also leaving."""
    p = _placement()
    for k in (D0, C0, C1):
        _stored(p, GPU, k, Cause.STORE)
    assert [(type(c), c.key) for c in p.pressure(0.0)] == [(Demote, D0)]  # gpu -> cpu
    assert _stored(p, CPU, D0, Cause.DEMOTE) == [Evict(POOL, D0, GPU, Reason.DEMOTED)]  # not carried out yet
    for k in (A0, A1, A2, key("a3")):  # cpu fills up behind d0
        _stored(p, CPU, k, Cause.STORE)
    assert (Demote, D0, REDIS) in [(type(c), c.key, c.dst) for c in p.pressure(0.0)]  # cpu -> redis
    cmds = _stored(p, REDIS, D0, Cause.DEMOTE)
    assert Evict(POOL, D0, CPU, Reason.DEMOTED) in cmds, f"the cpu copy stays leaving; got {cmds}"


def test_a_late_eviction_fact_leaves_a_new_mark_free_to_expire() -> None:
    """Found by the machine: a redelivered removed(evict) fact for a block that came back and was
    chosen again took the new mark's give-up record, so the mark (and its pin) stayed for ever."""
    p = _placement(gpu=2, cpu=3, low_watermark=0.6)
    gpu = p.tiers[GPU]
    _stored(p, CPU, A0, Cause.STORE)
    _stored(p, GPU, A0, Cause.PROMOTE)
    _stored(p, GPU, C0, Cause.STORE)
    assert p.pressure(0.0) == [Evict(POOL, A0, GPU, Reason.CLEAN)]  # cpu holds it
    p.dropped(GPU, A0)  # the gpu worker evicts it, and reports
    evicted = Removed(POOL, A0, GPU, Cause.EVICT, Reason.CLEAN)
    assert p.on_fact(evicted) == []
    _stored(p, GPU, A0, Cause.PROMOTE)  # read again, promoted back; a reader pins c0
    assert gpu.pin(C0)
    assert p.pressure(1.0) == [Evict(POOL, A0, GPU, Reason.CLEAN)]  # chosen again; this evict is lost
    assert p.on_fact(evicted) == []  # and the old fact comes again (XAUTOCLAIM)
    assert p.pressure(1.0 + T) == [Evict(POOL, A0, GPU, Reason.CLEAN)], "the lost evict's mark never expires"
    assert gpu.get(A0).pins == 1 and gpu.leaving == 1  # marked once, afresh


def test_a_demote_fact_without_its_record_leaves_other_marks_alone() -> None:
    """Found by the machine: a demote fact delivered again, its record settled, was credited to
    whatever mark the block carried, here the evict of its gpu copy: a second delivery changed
    the state."""
    p = _placement(gpu=2, cpu=3, low_watermark=0.6)
    gpu, cpu = p.tiers[GPU], p.tiers[CPU]
    for k in (A0, C0, D0):
        _stored(p, CPU, k, Cause.STORE)
    assert [(type(c), c.key, c.dst) for c in p.pressure(0.0)] == [(Demote, A0, REDIS), (Demote, C0, REDIS)]
    _stored(p, GPU, A0, Cause.PROMOTE)  # read meanwhile, promoted to gpu: both copies are here
    _stored(p, GPU, D0, Cause.PROMOTE)
    assert p.pressure(0.0) == [Evict(POOL, A0, GPU, Reason.CLEAN)]  # cpu holds it
    failed = Removed(POOL, A0, REDIS, Cause.DEMOTE, Failure.REDIS)
    assert p.on_fact(failed) == [] and not cpu.get(A0).leaving  # the cpu copy stays
    assert p.on_fact(failed) == [] and gpu.get(A0).leaving, "the gpu copy's evict was called off"
    done = Stored(POOL, C0, None, REDIS, -1, Cause.DEMOTE)
    assert p.on_fact(done) == [Evict(POOL, C0, CPU, Reason.DEMOTED)]
    p.dropped(CPU, C0)
    assert p.on_fact(done) == []


def test_a_prefetch_calls_off_a_move_out_of_the_node() -> None:
    """Found by the machine: a block chosen to leave cpu for Redis and prefetched before the
    write-back finished was leased, then dropped from the node when the write-back completed."""
    p = _placement(gpu=2, cpu=3, low_watermark=0.6)
    cpu = p.tiers[CPU]
    for k in (A0, C0, D0):
        _stored(p, CPU, k, Cause.STORE)
    assert p.in_redis(A0, None)  # written through earlier
    assert [(type(c), c.key) for c in p.pressure(0.0)] == [(Evict, A0), (Demote, C0)]
    assert p.on_prefetch([A0], None, 1.0) == [] and p.on_prefetch([C0], None, 1.0) == []  # here: leased
    assert evict_verdict(p, CPU, A0, Reason.CLEAN) is Verdict.STALE, "the evict would drop a0 from the node"
    assert _stored(p, REDIS, C0, Cause.DEMOTE) == [], "the write-back would drop c0 from the node"
    assert not cpu.get(A0).leaving and not cpu.get(C0).leaving and cpu.leaving == 0
    assert [c.key for c in p.pressure(1.0)] == [D0]  # cpu still sheds, but not the leased blocks


def test_a_late_promote_failure_keeps_the_lease_of_a_block_that_is_here() -> None:
    """Found by the machine: a failed promote's fact, delivered again after the block had arrived
    by a put and been prefetched (leased) anew, ended that lease: the block was shed unread."""
    p = _placement(gpu=2, prefetch_to=GPU)
    assert p.on_prefetch([A0], None, 0.0) == [Promote(POOL, A0, None, REDIS, GPU, -1, 0)]
    failed = Removed(POOL, A0, GPU, Cause.PROMOTE, Failure.SOURCE_MISS)  # Redis did not have it
    assert p.on_fact(failed) == []
    assert p.admit([A0, C0], 1.0) == [GPU, GPU]
    _stored(p, GPU, A0, Cause.STORE)
    _stored(p, GPU, C0, Cause.STORE)
    assert p.tiers[GPU].pin(C0)  # a reader holds c0
    assert p.on_prefetch([A0], None, 1.0) == []  # here: leased
    assert p.on_fact(failed) == []  # the old fact comes again
    assert p.pressure(1.0) == [], "a0 is shed under its lease"


def test_an_unreused_drop_is_refused_for_a_block_read_since() -> None:
    """Found by the machine: an `unreused` evict carried out after the block had been read
    `redis_admit_after_hits` times (here a redelivered one, acting on a newer mark) dropped a
    block the frequency filter admits to Redis."""
    p = _placement(gpu=2, cpu=1, low_watermark=0.6, redis_admit_after_hits=2)
    _stored(p, CPU, D0, Cause.STORE)  # cpu full: gpu sheds straight to Redis
    for k in (A0, C0):
        _stored(p, GPU, k, Cause.STORE)
    assert Evict(POOL, A0, GPU, Reason.UNREUSED) in p.pressure(0.0)  # never read: the filter's drop
    p.on_access([A0, A0], 1.0)  # read twice before the gpu worker acts
    assert evict_verdict(p, GPU, A0, Reason.UNREUSED) is Verdict.REUSED, "drops a block read twice"
    assert p.in_redis(A0, None)  # believed in Redis: still refused outright, not asked of Redis
    assert evict_verdict(p, GPU, A0, Reason.UNREUSED) is Verdict.REUSED
    assert evict_verdict(p, GPU, C0, Reason.UNREUSED) is Verdict.STALE  # not chosen
