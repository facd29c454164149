"""The pure rules behind the cluster batches: which masters to leave alone, when to reload the
slot map (kvtier/store/master_health.py), and which argument is a command's key."""

from __future__ import annotations

from kvtier.store.commands import key_of
from kvtier.store.master_health import DOWN_MAX_S, DOWN_MIN_S, RELOAD_MAX_S, RELOAD_MIN_S, MasterHealth, ReloadPacing


def test_a_failed_master_is_left_alone_for_a_while_that_doubles_while_it_keeps_failing():
    h, err = MasterHealth(), ConnectionError("refused")
    assert h.down("m1", 0.0) is None
    h.failed("m1", err, now=10.0)
    assert h.down("m1", 10.0) is err and h.down("m1", 10.0 + DOWN_MIN_S - 1e-6) is err
    assert h.down("m1", 10.0 + DOWN_MIN_S) is None, "then it may be asked again (a probe)"
    assert h.down("m2", 10.0) is None, "only that master"
    h.failed("m1", err, now=20.0)  # the probe failed too
    assert h.down("m1", 20.0 + DOWN_MIN_S) is err and h.down("m1", 20.0 + 2 * DOWN_MIN_S) is None
    for _ in range(20):
        h.failed("m1", err, now=30.0)
    assert h.down("m1", 30.0 + DOWN_MAX_S - 1e-6) is err and h.down("m1", 30.0 + DOWN_MAX_S) is None
    h.ok("m1")
    h.failed("m1", err, now=40.0)
    assert h.down("m1", 40.0 + DOWN_MIN_S) is None, "a success starts the hold small again"


def test_reloads_are_paced_while_an_outage_lasts_and_at_once_after_it_ends():
    p = ReloadPacing()
    assert p.due(0.0) and not p.due(RELOAD_MIN_S - 1e-6) and p.due(RELOAD_MIN_S)
    t = RELOAD_MIN_S
    gaps = []
    for _ in range(10):
        nxt = t + min(RELOAD_MAX_S, 2 * RELOAD_MIN_S * 2 ** len(gaps))
        assert not p.due(nxt - 1e-6) and p.due(nxt)
        gaps.append(nxt - t)
        t = nxt
    assert gaps[0] == 2 * RELOAD_MIN_S and gaps[-1] == RELOAD_MAX_S
    p.settled()
    assert p.due(t + 1e-3) and not p.due(t + 1e-3 + RELOAD_MIN_S - 1e-6)


def test_the_key_of_a_command_and_of_a_script():
    assert key_of(("GET", "k1")) == "k1"
    assert key_of(("SET", "k2", b"v", "EX", 5)) == "k2"
    assert key_of(("EVAL", "return 1", 1, "k3", "arg")) == "k3"
