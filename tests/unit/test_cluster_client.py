"""The cluster client's key finder for stream reads (bus/connect.py): found locally, so no
master has to answer COMMAND GETKEYS before every XREADGROUP."""

from __future__ import annotations

from kvtier.bus.connect import _AnyPrimaryCommands, make_redis


async def test_stream_read_keys_are_found_without_asking_any_node():
    cluster = make_redis("redis+cluster://127.0.0.1:1", socket_timeout=1, connect_timeout=1, retries=0)
    parser = cluster.commands_parser
    assert isinstance(parser, _AnyPrimaryCommands)
    # A group and a consumer named "streams" are not taken for the STREAMS keyword.
    args = ("XREADGROUP", "GROUP", "streams", "STREAMS", "COUNT", 10, "BLOCK", 100,
            "STREAMS", "kvtier:{n}:client", "kvtier:{n}:facts", ">", ">")
    assert await parser.get_keys(*args) == ("kvtier:{n}:client", "kvtier:{n}:facts")
    assert await parser.get_keys("XREAD", "COUNT", 1, "STREAMS", b"s1", b"0") == (b"s1",)
    assert await parser.get_keys("XREADGROUP", "GROUP", "g", "c") is None
    await cluster.aclose()
