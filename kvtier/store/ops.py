"""The Redis commands the block store sends, by name.

One enum for what is sent and what is dispatched on (store/commands.py, store/cluster_batches.py,
store/bulk_reads.py), so the two cannot drift apart. A member is a `str` equal to its wire name:
redis-py and the bulk reader send it as they would the plain name, so the bytes on the wire are
the same. Commands built elsewhere (the client's EXISTS, the prefix index's HSET) may still name
themselves with plain strings: a member compares and hashes as its name.
"""

from __future__ import annotations

import enum


class Op(enum.StrEnum):
    GET = "GET"
    SET = "SET"
    DEL = "DEL"
    EXISTS = "EXISTS"
    EXPIRE = "EXPIRE"
    EVAL = "EVAL"
    EVALSHA = "EVALSHA"
    ASKING = "ASKING"  # before a command sent to a cluster node importing its slot
    AUTH = "AUTH"
    SELECT = "SELECT"
    # Not a Redis command: a GET whose value lands in the caller's buffers (store/bulk_reads.py),
    # sent as GET. A batch holds these or others, not both.
    GET_INTO = "GET_INTO"


SCRIPTS = frozenset({Op.EVAL, Op.EVALSHA})  # their key comes after the script and the key count
EX = "EX"  # SET's option: expire after so many seconds
GT = "GT"  # EXPIRE's option: only lengthen a time to live (a key with none keeps none)
