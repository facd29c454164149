"""The cluster prefix index: who holds which block, and the router's answer. Pure: no I/O.

Each block a node holds locally has one Redis hash, `kvtier:where:<pool>:<key hex>`, whose
fields are `<node>|<tier>` (value "1"), tier `gpu`, `cpu` or `disk`, or `engine` for a block an engine on
that node holds in its own GPU cache (`<node>/<engine>|engine`, from its KV events). Whether Redis holds the block is
not indexed: the reader asks Redis itself (EXISTS on the block's key), which is never stale,
and a Redis copy serves every node, so it is reported once, not per node.
Daemons set fields as their tier facts arrive and delete them as blocks leave; every write
renews the hash's TTL, and each daemon re-writes what its local tiers hold every `refresh_s`.
So an entry of a node that died is gone within `ttl_s`, and the index's memory is bounded by
what the nodes hold now (plus what died within the last `ttl_s`).

The reader (client/where_query.py) finds the run anyone holds (HLEN per block), takes the
holders of its deepest block as candidates (`holders`), and verifies each candidate's run and
tiers on every block (`verified_runs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.keys import BlockKey

TIER_RANK = {"engine": 0, "gpu": 1, "cpu": 2, "disk": 3}  # best first; engine: an engine's own GPU cache (ingested)
SEP = "|"


def where_key(pool: str, key: bytes) -> str:
    return f"kvtier:where:{pool}:{bytes(key).hex()}"


def field(node: str, tier: str) -> str:
    return f"{node}{SEP}{tier}"


@dataclass(frozen=True, slots=True)
class NodeRun:
    node: str
    length: int  # leading blocks this node holds in a local tier
    tiers: tuple[str, ...]  # the best local tier of each of those blocks


@dataclass(frozen=True, slots=True)
class Where:
    length: int  # the longest leading run any node holds locally
    nodes: tuple[NodeRun, ...]  # every node with a run of 1 or more, longest first
    redis_length: int  # leading blocks held in Redis (any node can read them)

    @property
    def best(self) -> NodeRun | None:
        return self.nodes[0] if self.nodes else None


def holders(fields: Mapping[bytes | str, object] | None) -> dict[str, str]:
    """{node: best local tier}. Malformed fields are ignored (the index is written by every node:
    a bad entry must cost a miss, not an error)."""
    local: dict[str, str] = {}
    for raw in fields or {}:
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        node, sep, tier = name.rpartition(SEP)
        if sep and node and tier in TIER_RANK and (node not in local or TIER_RANK[tier] < TIER_RANK[local[node]]):
            local[node] = tier
    return local


def index_commands(pool: str, node: str, stored: Sequence[tuple[BlockKey, str]],
                   removed: Sequence[tuple[BlockKey, str]], ttl_s: int) -> list[tuple[object, ...]]:
    """Redis commands for a batch of tier changes: HSET + EXPIRE per block stored, HDEL per block
    removed (a hash left empty is deleted by Redis itself)."""
    cmds: list[tuple[object, ...]] = []
    for key, tier in stored:
        name = where_key(pool, key)
        cmds.append(("HSET", name, field(node, tier), "1"))
        cmds.append(("EXPIRE", name, ttl_s))
    for key, tier in removed:
        cmds.append(("HDEL", where_key(pool, key), field(node, tier)))
    return cmds


def leading(flags: Sequence[object]) -> int:
    """How many leading answers are truthy (an Exception counts as no)."""
    n = 0
    for f in flags:
        if isinstance(f, Exception) or not f:
            break
        n += 1
    return n


def candidate_fields(nodes: Sequence[str]) -> list[str]:
    return [field(n, t) for n in nodes for t in TIER_RANK]


def verified_runs(nodes: Sequence[str], replies: Sequence[Sequence[object] | None]) -> list[NodeRun]:
    """Each candidate's leading run, from HMGET replies (one per key, the candidate_fields(nodes)
    in order), longest first."""
    tiers = list(TIER_RANK)
    out = []
    for j, node in enumerate(nodes):
        got: list[str] = []
        for reply in replies:
            vals = list(reply or ())[j * len(tiers):(j + 1) * len(tiers)]
            best = next((t for t, v in zip(tiers, vals) if v is not None), None)
            if best is None:
                break
            got.append(best)
        if got:
            out.append(NodeRun(node, len(got), tuple(got)))
    return sorted(out, key=lambda r: (-r.length, r.node))
