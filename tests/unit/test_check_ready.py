"""`flips.check_ready`, the daemon's check of a put's granted headers before they go VALID: the
compiled check and the numpy one agree on every batch, a header is accepted only whole and naming
its block, and what is written back is the copy that was checked, not the header read again."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.shm import flips, onepass
from kvtier.shm.flips import check_ready
from kvtier.shm.slots import HEADER_DTYPE, SLOT_MAGIC, Flags, key_tag

BB = 65_536
TABLE = 32  # more slots than a batch names: its slots are distinct
# One way each to make a header not the block's, or not whole.
SPOILS = ("none", "magic", "flags", "gen-other", "gen-odd", "key", "length", "checksum", "tag", "outside", "gen-huge")


def header_for(key: bytes, gen: int, csum: int) -> np.ndarray:
    h = np.zeros(1, dtype=HEADER_DTYPE)
    h["magic"], h["flags"], h["gen"], h["length"], h["checksum"] = SLOT_MAGIC, Flags.READY, gen, BB, csum
    h["key"] = np.frombuffer(key, dtype="V32")
    h["parent"] = np.frombuffer(bytes(range(32)), dtype="V32")
    h["tag"] = key_tag(key, csum)
    return h


def batch(spoils: list[str], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
    """A header table of random bytes and a batch naming len(spoils) distinct slots of it, block
    j's header written for it, then spoiled as spoils[j] says."""
    rng = np.random.default_rng(seed)
    headers = np.frombuffer(rng.bytes(TABLE * HEADER_DTYPE.itemsize), dtype=HEADER_DTYPE).copy()
    keys, slots, gens = [], [], []
    for spoil, slot in zip(spoils, rng.permutation(TABLE).tolist()):
        key = rng.bytes(32)
        gen, csum = 2 * int(rng.integers(1, 1 << 40)), int(rng.integers(0, 1 << 63))
        h = header_for(key, gen, csum)
        named_gen = gen
        if spoil == "magic":
            h["magic"] += 1
        elif spoil == "flags":
            h["flags"] = Flags.VALID
        elif spoil == "gen-other":
            named_gen = gen + 2
        elif spoil == "gen-odd":
            h["gen"], named_gen = gen + 1, gen + 1
        elif spoil == "key":
            key = bytes([key[0] ^ 1]) + key[1:]
        elif spoil == "length":
            h["length"] = BB - 1
        elif spoil == "checksum":
            h["checksum"] = csum ^ 1
        elif spoil == "tag":
            h["tag"] = int(h["tag"][0]) ^ 1
        elif spoil == "outside":
            slot = TABLE + int(rng.integers(0, 3)) if rng.integers(0, 2) else -1
        elif spoil == "gen-huge":  # as grants.py passes a gen past 63 bits: odd
            named_gen = 1
        if 0 <= slot < TABLE:
            headers[slot] = h[0]
        keys.append(key)
        slots.append(slot)
        gens.append(named_gen)
    return headers, np.array(slots, np.int64), np.array(gens, np.uint64), b"".join(keys)


def numpy_check(monkeypatch: pytest.MonkeyPatch, *args) -> tuple[np.ndarray, list[bool]]:
    with monkeypatch.context() as m:
        m.setattr(onepass, "_copy_hash", None)
        return check_ready(*args)


@pytest.mark.skipif(not onepass.COMPILED, reason="compares the compiled check with numpy's (the build has none)")
@settings(max_examples=200, deadline=None)
@given(spoils=st.lists(st.sampled_from(SPOILS), max_size=24), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_check_and_numpys_agree(spoils: list[str], seed: int) -> None:
    headers, slots, gens, keys = batch(spoils, seed)
    mp = pytest.MonkeyPatch()
    try:
        want_snaps, want = numpy_check(mp, headers, slots, gens, keys, BB)
    finally:
        mp.undo()
    snaps, ok = check_ready(headers, slots, gens, keys, BB)
    assert onepass.compiled("check_ready") is not None
    assert ok == want and all(type(v) is bool for v in ok)
    assert snaps.tobytes() == want_snaps.tobytes()


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_header_passes_only_whole_and_naming_its_block(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path == "compiled" and not onepass.COMPILED:
        pytest.skip("no compiled build here: the numpy case covers the check")
    if path == "numpy":
        monkeypatch.setattr(onepass, "_copy_hash", None)
    for spoil in SPOILS:  # the spoiled block between two good ones
        headers, slots, gens, keys = batch(["none", spoil, "none"], seed=SPOILS.index(spoil))
        snaps, ok = check_ready(headers, slots, gens, keys, BB)
        assert ok == [True, spoil == "none", True], spoil
        for j, s in enumerate(slots.tolist()):  # the copies are the headers as they were
            assert snaps[j].tobytes() == (headers[s].tobytes() if 0 <= s < TABLE else bytes(128))


def test_the_copy_checked_is_the_copy_returned() -> None:
    """A client writing the header after the check changes neither the verdict nor the copy
    the daemon writes back VALID."""
    headers, slots, gens, keys = batch(["none"], seed=3)
    snaps, ok = check_ready(headers, slots, gens, keys, BB)
    headers[int(slots[0])]["key"] = np.frombuffer(bytes(32), dtype="V32")
    assert ok == [True] and snaps[0]["key"].tobytes() == keys[:32]


def test_bad_arguments_are_refused() -> None:
    if not onepass.COMPILED:
        pytest.skip("the compiled check's own argument checks")
    check = onepass.compiled("check_ready")
    headers, slots, gens, keys = batch(["none", "none"], seed=4)
    snaps = np.empty(2, dtype=HEADER_DTYPE)
    with pytest.raises(ValueError, match="slots must hold 2"):
        check(headers, slots[:1], gens, keys, BB, SLOT_MAGIC, Flags.READY, snaps)
    with pytest.raises(ValueError, match="gens must hold 2"):
        check(headers, slots, gens.astype(np.int64), keys, BB, SLOT_MAGIC, Flags.READY, snaps)
    with pytest.raises(ValueError, match="snaps must be 256 bytes"):
        check(headers, slots, gens, keys, BB, SLOT_MAGIC, Flags.READY, snaps[:1])
    with pytest.raises(ValueError, match="of keys"):
        check(headers, slots, gens, keys[:-1], BB, SLOT_MAGIC, Flags.READY, snaps)
    with pytest.raises(TypeError, match="eight arguments"):
        check(headers, slots, gens, keys)
    assert flips.check_ready is check_ready
