"""The block store's command names (kvtier/store/ops.py): an enum whose members go on the wire
exactly as the plain names did, through redis-py and through the bulk reader."""

from __future__ import annotations

from redis.asyncio.connection import Connection

from kvtier.store.bulk_reads import pack
from kvtier.store.commands import key_of
from kvtier.store.ops import EX, Op


def test_commands_named_by_the_enum_are_the_same_bytes_on_the_wire() -> None:
    named = [(Op.SET, "kvtier:blk:p:01", b"value", EX, 60), (Op.GET, "kvtier:blk:p:01"), (Op.ASKING,),
             (Op.EVAL, "return 1", 1, "kvtier:blk:p:01", "digest"), (Op.DEL, "k"), (Op.EXISTS, "k")]
    plain = [tuple(str(a) if isinstance(a, Op) else a for a in c) for c in named]
    assert all(type(c[0]) is str for c in plain)
    conn = Connection()  # packs only: never connects
    assert b"".join(conn.pack_commands(named)) == b"".join(conn.pack_commands(plain))
    assert b"".join(conn.pack_commands(named)).startswith(b"*5\r\n$3\r\nSET\r\n")
    assert pack([Op.AUTH, "user", "pw"], [Op.SELECT, 2], [Op.GET, "k"]) == pack(["AUTH", "user", "pw"],
                                                                                  ["SELECT", 2], ["GET", "k"])


def test_every_member_is_its_wire_name() -> None:
    for op in Op:
        assert op == op.name and str(op) == op.name and hash(op) == hash(op.name)


def test_the_key_of_a_command_named_either_way() -> None:
    assert key_of((Op.GET, "k1")) == key_of(("GET", "k1")) == "k1"
    assert key_of((Op.EVALSHA, "sha", 1, "k3", "arg")) == key_of(("EVALSHA", "sha", 1, "k3", "arg")) == "k3"
    assert key_of(("HSET", "k4", "f", "1")) == "k4"  # a command the enum does not name (the prefix index's)
