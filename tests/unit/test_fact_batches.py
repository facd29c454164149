"""A tier worker's facts go out as batches (kvtier/core/fact_batches.py `batched`, of
kvtier/core/events.py's StoredBatch): each run of stored facts of one pool, tier and cause is
one event, and stands for exactly those facts."""

from hypothesis import given
from hypothesis import strategies as st

from kvtier.bus.codec import decode, encode
from kvtier.core.events import Cause, Envelope, Failure, Removed, Stored, StoredBatch, Tier
from kvtier.core.fact_batches import MAX_RUN, batched

KEYS = [bytes([i]) * 32 for i in range(8)]

stored = st.builds(Stored, st.sampled_from(["a", "b"]), st.sampled_from(KEYS), st.sampled_from([None, *KEYS]),
                   st.sampled_from([Tier.GPU, Tier.CPU]), st.integers(-1, 1 << 40),
                   st.sampled_from([Cause.STORE, Cause.PROMOTE]))
removed = st.builds(Removed, st.sampled_from(["a", "b"]), st.sampled_from(KEYS), st.just(Tier.CPU),
                    st.just(Cause.STORE), st.just(Failure.NO_ROOM))


# A worker reports a put's adopted blocks as one StoredBatch (kvtier/tiers/facts.py): in a batch's
# facts it sits beside single facts, and runs on into them.
batch = st.builds(lambda pool, cause, n, slot: StoredBatch(pool, Tier.CPU, cause, tuple(KEYS[:n]),
                                                           (None, *KEYS[:n - 1]), tuple(range(slot, slot + n))),
                  st.sampled_from(["a", "b"]), st.sampled_from([Cause.STORE, Cause.PROMOTE]), st.integers(1, 8),
                  st.integers(0, 100))


def expand(events) -> list:
    return [f for e in events for f in (e.facts() if isinstance(e, StoredBatch) else [e])]


@given(st.lists(st.one_of(stored, stored, removed, batch), max_size=40))
def test_batches_stand_for_exactly_the_facts_in_order(facts):
    out = batched(facts)
    assert expand(out) == expand(facts)
    for e in out:
        if isinstance(e, StoredBatch):
            assert len(e.keys) >= 2  # a lone stored fact stays as it is
    # Maximal runs: two neighbours never could have been one batch (facts here are < MAX_RUN).
    for x, y in zip(out, out[1:]):
        if isinstance(x, (Stored, StoredBatch)) and isinstance(y, (Stored, StoredBatch)):
            assert (x.pool, x.tier, x.cause) != (y.pool, y.tier, y.cause)


def test_a_put_of_64_blocks_is_one_fact():
    facts = [Stored("p", KEYS[i % 8], None, Tier.CPU, i, Cause.STORE) for i in range(64)]
    (one,) = batched(facts)
    assert isinstance(one, StoredBatch) and one.slots == tuple(range(64))
    # Its granted head adopted as one batch, its staged tail stored block by block: still one fact.
    head = StoredBatch("p", Tier.CPU, Cause.STORE, tuple(f.key for f in facts[:40]), (None,) * 40, tuple(range(40)))
    (again,) = batched([head, *facts[40:]])
    assert again == one
    (lone,) = batched([StoredBatch("p", Tier.CPU, Cause.STORE, (KEYS[0],), (None,), (7,))])
    assert lone == Stored("p", KEYS[0], None, Tier.CPU, 7, Cause.STORE)


def test_columns_of_different_lengths_stand_for_nothing():
    assert StoredBatch("p", Tier.CPU, Cause.STORE, (KEYS[0], KEYS[1]), (None,), (1, 2)).facts() is None


def test_a_long_run_is_cut_into_batches_that_a_consumer_accepts():
    """A batch's facts pile up until its flush (thousands, from a prefetch or a shed): each fact
    event stays within what the codec decodes (an entry of 4 MiB, a list of 65,536)."""
    n = 3 * MAX_RUN + 5
    facts = [Stored("p", i.to_bytes(32, "little"), None, Tier.CPU, i, Cause.PROMOTE) for i in range(n)]
    out = batched(facts)
    assert [len(e.keys) for e in out[:3]] == [MAX_RUN] * 3 and len(out[3].keys) == 5
    assert expand(out) == facts
    for e in out:
        assert decode(encode(Envelope(e, "w", 1, 1))).event == e
