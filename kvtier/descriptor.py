"""The daemon's descriptor (`kvtier.json` in its runtime directory): one typed, versioned record,
written by the daemon (daemon/app.py) and read by every client (client/discovery.py).

It tells a client how to reach the daemon: its node, pid and epoch (a restart is a new epoch),
the Redis URLs, the streams, and per pool the layout and the shared-memory segments to map. The
bytes come from a file, so they are untrusted until checked: `from_json` validates every field's
type, and a version this code does not know is refused with a message that says what to do. JSON,
never pickle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtier.errors import KvtierError
from kvtier.layout import BlockLayout

VERSION = 2  # 1: the untyped dict of kvtier 0.1 (same fields, no `prefix_index`)


class DescriptorError(KvtierError, ValueError):
    """A descriptor of another version, or one that does not hold what a descriptor must."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A tier's (or the directory's) shared-memory segment."""

    segment: str
    capacity: int
    dir: str = ""  # the directory it lives in ("" for the directory segment: /dev/shm)
    device: str = "cpu"  # a gpu tier: "cpu" (shared memory) or "cuda" (payload shared by CUDA IPC); "disk"
    ipc: dict[str, Any] | None = None  # the CUDA IPC handle of a "cuda" gpu tier


@dataclass(frozen=True, slots=True)
class PoolEntry:
    layout: BlockLayout
    fingerprint: str  # hex of layout.fingerprint: checked against the layout by the reader
    block_bytes: int
    gpu: Segment | None
    cpu: Segment
    directory: Segment
    disk: Segment | None = None  # the disk tier's block file (segment: its name in `dir`), where the pool has one


@dataclass(frozen=True, slots=True)
class RedisEndpoints:
    url: str  # blocks
    bus_url: str  # streams
    pipeline_bytes: int
    connections: int


@dataclass(frozen=True, slots=True)
class Streams:
    client: str
    facts: str
    dlq: str


@dataclass(frozen=True, slots=True)
class Descriptor:
    node: str
    pid: int
    epoch: int  # the daemon's start time in ns: a new one after every restart
    redis: RedisEndpoints
    streams: Streams
    shm_gid: int | None
    prefix_index: bool  # whether this daemon writes the cluster prefix index `where` reads
    pools: dict[str, PoolEntry]
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for name, p in self.pools.items():
            d["pools"][name]["layout"] = p.layout.to_dict()
        return d

    @classmethod
    def from_json(cls, d: Any) -> Descriptor:
        """The record from parsed JSON; DescriptorError unless it is one of this version."""
        if not isinstance(d, dict):
            raise DescriptorError("the descriptor is not a JSON object")
        version = d.get("version")
        if version != VERSION:
            raise DescriptorError(
                f"the daemon's descriptor is version {version!r} and this kvtier client reads version {VERSION}: "
                f"the daemon and its clients run different kvtier releases. Install the daemon's kvtier release "
                f"in the engine's environment (or upgrade the daemon)")
        try:
            pools = {str(name): _pool(p) for name, p in _dict(d, "pools").items()}
            r, s = _dict(d, "redis"), _dict(d, "streams")
            return cls(
                node=_str(d, "node"), pid=_int(d, "pid"), epoch=_int(d, "epoch"),
                redis=RedisEndpoints(_str(r, "url", empty=True), _str(r, "bus_url"), _int(r, "pipeline_bytes"),
                                     _int(r, "connections")),
                streams=Streams(_str(s, "client"), _str(s, "facts"), _str(s, "dlq")),
                shm_gid=None if d.get("shm_gid") is None else _int(d, "shm_gid"),
                prefix_index=_bool(d, "prefix_index"), pools=pools)
        except (KeyError, TypeError, ValueError) as e:
            raise DescriptorError(f"the daemon's descriptor is malformed: {e}") from e


def _pool(p: Any) -> PoolEntry:
    if not isinstance(p, dict):
        raise TypeError("a pool entry is not an object")
    gpu, disk = p.get("gpu"), p.get("disk")
    return PoolEntry(layout=BlockLayout.from_dict(_dict(p, "layout")), fingerprint=_str(p, "fingerprint"),
                     block_bytes=_int(p, "block_bytes"), gpu=None if gpu is None else _segment(gpu),
                     cpu=_segment(_dict(p, "cpu")), directory=_segment(_dict(p, "directory")),
                     disk=None if disk is None else _segment(disk))


def _segment(s: Any) -> Segment:
    if not isinstance(s, dict):
        raise TypeError("a segment entry is not an object")
    ipc = s.get("ipc")
    if ipc is not None and not isinstance(ipc, dict):
        raise TypeError("a segment's 'ipc' is not an object")
    return Segment(_str(s, "segment"), _int(s, "capacity"), _str(s, "dir", empty=True) if "dir" in s else "",
                   _str(s, "device") if "device" in s else "cpu", ipc)


def _dict(d: dict[str, Any], key: str) -> dict[str, Any]:
    v = d[key]
    if not isinstance(v, dict):
        raise TypeError(f"{key!r} is not an object")
    return v


def _str(d: dict[str, Any], key: str, empty: bool = False) -> str:
    v = d[key]
    if not isinstance(v, str) or (not v and not empty):
        raise TypeError(f"{key!r} is not a non-empty string")
    return v


def _int(d: dict[str, Any], key: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{key!r} is not an integer")
    return v


def _bool(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise TypeError(f"{key!r} is not true or false")
    return v
