"""The compatibility manifest's pure rules (core/manifest.py): entries from Redis are untrusted,
a namespace's page must match, and status lists namespaces by what they stored."""

from __future__ import annotations

import json

import pytest

from kvtier.core.manifest import MAX_ENTRY_BYTES, ManifestEntry, conflict, holdings

NS = "0123456789abcdef0123456789abcdef"


def entry(ns: str = NS, model: str = "m", **page) -> ManifestEntry:
    return ManifestEntry(namespace=ns, engine="vllm-connector", engine_version="0.32", model=model,
                         weights={"weights": "content:aa", "revision": None},
                         page={"page_bytes": 8192, "dtype": "float16", **page}, extra={"tp_size": 1})


def test_round_trip():
    e = entry()
    assert ManifestEntry.from_json(e.to_json()) == e


@pytest.mark.parametrize("raw", [
    b"[]", b"{}", b"not json",
    json.dumps({**json.loads(entry().to_json()), "namespace": "XYZ"}).encode(),  # not a hex id
    json.dumps({**json.loads(entry().to_json()), "page": "8192"}).encode(),  # wrong type
    json.dumps({**json.loads(entry().to_json()), "model": 7}).encode(),
    b"{" + b" " * MAX_ENTRY_BYTES + b"}",  # too large to believe
])
def test_hostile_entries_are_refused(raw):
    with pytest.raises(ValueError):
        ManifestEntry.from_json(raw)


def test_a_namespace_must_keep_its_page_bytes_the_readable_fields_may_differ():
    assert conflict(entry(model="llama-copy"), entry()) is None  # another served name: same weights
    assert conflict(entry(ns="f" * 32, page_bytes=1), entry()) is None  # another namespace
    why = conflict(entry(page_bytes=16384), entry())
    assert why is not None and "page_bytes: 8192 registered, 16384 here" in why and "Refused" in why
    assert conflict(entry(shape=[2, 16]), entry()) is not None  # a field only one side has


def test_holdings_largest_first_and_malformed_counted():
    big, small = entry("a" * 32, model="big"), entry("b" * 32, model="small")
    entries = {big.namespace.encode(): big.to_json(), small.namespace.encode(): small.to_json(),
               b"c" * 32: b"garbage", b"d" * 32: big.to_json()}  # the last under another namespace's name
    stored = {f"{big.namespace}:blocks".encode(): b"10", f"{big.namespace}:bytes".encode(): b"81920",
              f"{small.namespace}:blocks".encode(): b"1", f"{small.namespace}:bytes".encode(): b"8192",
              b"x:bytes": b"not a number"}
    held, bad = holdings(entries, stored)
    assert [h.entry.model for h in held] == ["big", "small"] and bad == 2
    assert (held[0].stored_blocks, held[0].stored_bytes) == (10, 81920)
