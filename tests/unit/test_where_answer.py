"""The cluster prefix index's pure part (core/where.py): fields, holders, runs, commands."""

from __future__ import annotations

from kvtier.core.where import candidate_fields, field, holders, index_commands, leading, verified_runs, where_key


def h(*fields: str) -> dict[bytes, bytes]:
    return {f.encode(): b"1" for f in fields}


def test_holders_best_tier_and_malformed_fields_ignored() -> None:
    assert holders(h("a|cpu", "a|gpu", "b|cpu", "n/e0|engine")) == {"a": "gpu", "b": "cpu", "n/e0": "engine"}
    assert holders({b"nopipe": b"1", b"|cpu": b"1", b"a|tape": b"1", b"a|redis": b"1", b"\xff|cpu": b"1"}) == {
        "\ufffd": "cpu"}
    assert holders(None) == {} and holders({}) == {}


def test_leading() -> None:
    assert leading([3, 1, 0, 5]) == 2 and leading([]) == 0 and leading([1, RuntimeError("x"), 1]) == 1


def test_verified_runs_follow_each_candidate_to_its_first_gap() -> None:
    nodes = ["a", "b/e0"]
    assert candidate_fields(nodes) == ["a|engine", "a|gpu", "a|cpu", "a|disk",
                                       "b/e0|engine", "b/e0|gpu", "b/e0|cpu", "b/e0|disk"]
    n = None
    replies = [[n, n, b"1", n, b"1", n, n, n], [n, b"1", n, n, b"1", n, n, n], [n, n, n, b"1", n, n, n, n],
               [n, n, b"1", b"1", b"1", n, n, n]]
    runs = verified_runs(nodes, replies)
    assert [(r.node, r.length, r.tiers) for r in runs] == [("a", 4, ("cpu", "gpu", "disk", "cpu")),
                                                         ("b/e0", 2, ("engine", "engine"))]
    assert verified_runs(["c"], [[None, None, None, None]]) == []


def test_index_commands() -> None:
    k1, k2 = b"\x01" * 32, b"\x02" * 32
    cmds = index_commands("p", "n1", [(k1, "cpu")], [(k2, "gpu")], 600)
    assert cmds == [("HSET", where_key("p", k1), field("n1", "cpu"), "1"), ("EXPIRE", where_key("p", k1), 600),
                    ("HDEL", where_key("p", k2), "n1|gpu")]
    assert where_key("p", k1) == "kvtier:where:p:" + "01" * 32
