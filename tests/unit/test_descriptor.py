"""The daemon's descriptor: one typed record that the daemon writes and clients read (issue 26)."""

from __future__ import annotations

import json

import pytest

from kvtier.descriptor import VERSION, Descriptor, DescriptorError, PoolEntry, RedisEndpoints, Segment, Streams
from kvtier.errors import KvtierError
from kvtier.layout import BlockLayout

LAYOUT = BlockLayout("m", 2, 2, 32, 16, "float16")


def descriptor(**kw) -> Descriptor:
    pool = PoolEntry(LAYOUT, LAYOUT.fingerprint.hex(), LAYOUT.block_bytes,
                     gpu=Segment("kvtier.n.t.gpu", 8, "/dev/shm", "cuda", {"fields": ["00ff"], "shape": [8, 4]}),
                     cpu=Segment("kvtier.n.t.cpu", 16, "/mnt/huge"), directory=Segment("kvtier.n.t.dir", 64))
    fields = dict(node="n", pid=42, epoch=7, redis=RedisEndpoints("", "unix:///run/r.sock", 8 << 20, 4),
                  streams=Streams("kvtier:{n}:client", "kvtier:{n}:facts", "kvtier:{n}:dlq"), shm_gid=None,
                  prefix_index=True, pools={"t": pool})
    return Descriptor(**{**fields, **kw})


def test_what_the_daemon_writes_the_client_reads_back_exactly() -> None:
    d = descriptor()
    wire = json.loads(json.dumps(d.to_json()))  # through JSON, as through kvtier.json
    assert wire["version"] == VERSION and wire["pools"]["t"]["layout"]["model"] == "m"
    assert Descriptor.from_json(wire) == d
    assert Descriptor.from_json(json.loads(json.dumps(descriptor(shm_gid=1001).to_json()))).shm_gid == 1001


def test_another_version_is_refused_with_what_to_do() -> None:
    for version in (1, VERSION + 1, None, "2"):
        wire = {**descriptor().to_json(), "version": version}
        with pytest.raises(DescriptorError, match="different kvtier releases") as e:
            Descriptor.from_json(wire)
        assert isinstance(e.value, KvtierError)


@pytest.mark.parametrize("break_it", [
    lambda w: w.pop("streams"),
    lambda w: w.update(pid="42"),
    lambda w: w.update(pid=True),
    lambda w: w.update(prefix_index="yes"),
    lambda w: w["pools"]["t"].update(cpu=[]),
    lambda w: w["pools"]["t"]["gpu"].update(ipc="handle"),
    lambda w: w["pools"]["t"]["cpu"].update(segment=""),
    lambda w: w["pools"]["t"]["layout"].pop("dtype"),
    lambda w: w.update(pools=[]),
])
def test_a_malformed_descriptor_is_one_clear_error(break_it) -> None:
    wire = json.loads(json.dumps(descriptor().to_json()))
    break_it(wire)
    with pytest.raises(DescriptorError, match="malformed"):
        Descriptor.from_json(wire)
    with pytest.raises(DescriptorError):
        Descriptor.from_json([wire])
