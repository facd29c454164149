"""A batch of slots' headers written in one pass: a client filling a put's slots, the daemon
adopting a put's granted slots (READY -> VALID).

`SlotTable.begin_write` and `end_write` publish one slot's header under the seqlock; for a batch
that is three struct reads and writes per block in Python. Here each step of the seqlock is one
vectorised store over the whole batch, in the same order (gen odd, header, gen even), so a reader
of any of these slots sees a whole header or a miss, as with end_write. The writer must own every
slot of the batch, as with begin_write.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.keys import KEY_BYTES
from kvtier.shm.onepass import compiled, key_tags
from kvtier.shm.slots import HEADER_DTYPE, SLOT_MAGIC, Flags


def begin_writes(headers: npt.NDArray[Any], slots: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """`begin_write` for a batch of distinct slots: each gen made odd in one store (readers of
    these slots miss from here). The odd gens, for `end_writes`."""
    cur = headers["gen"][slots]
    odd = np.where(cur % 2 == 0, cur + 1, cur + 2)  # past a writer that died mid-write
    headers["gen"][slots] = odd
    return odd


def end_writes(headers: npt.NDArray[Any], slots: npt.NDArray[np.int64], odd: npt.NDArray[np.uint64],
               fields: dict[str, Any]) -> None:
    """`end_write` for a batch of slots `begin_writes` made odd: the headers' `fields` (key,
    length, checksum, flags, parent, tag: arrays, or one value for all) written with the odd gens,
    then every gen even."""
    body = headers[slots]  # a copy: the bytes past the fields are kept as they are
    body["magic"], body["gen"] = SLOT_MAGIC, odd
    for name, value in fields.items():
        body[name] = value
    headers[slots] = body
    headers["gen"][slots] = odd + 1


def flip_valid(headers: npt.NDArray[Any], slots: npt.NDArray[np.int64], checked: npt.NDArray[Any]) -> None:
    """READY -> VALID for a batch of slots (`headers`: the table's, over the mapping; `checked`:
    those slots' headers as the caller checked them): every gen odd (readers of these slots miss
    from here), the checked header written back with flags VALID, every gen even. One numpy store
    per step, and x86 keeps stores in order, as end_write relies on per slot."""
    odd = begin_writes(headers, slots)
    body = checked.copy()
    body["flags"], body["gen"] = Flags.VALID, odd
    headers[slots] = body
    headers["gen"][slots] = odd + 1


def check_ready(headers: npt.NDArray[Any], slots: npt.NDArray[np.int64], gens: npt.NDArray[np.uint64], keys: bytes,
                block_bytes: int) -> tuple[npt.NDArray[Any], list[bool]]:
    """A put's granted blocks against their slots' headers, before the daemon makes them VALID:
    (a copy of each slot's header as the client left it, zeros for a slot outside the table;
    whether that copy is whole and the block's: magic, READY, the gen the put names and even, its
    key (`keys`: joined), `block_bytes` long, and a tag binding the key to the checksum, as every
    reader demands). Each check reads the copy, which is what `flip_valid` writes back. Compiled
    (a few microseconds a put of 64 blocks, against about 28 in numpy), else numpy."""
    n = len(keys) // KEY_BYTES
    snaps = np.empty(n, dtype=HEADER_DTYPE)
    if (check := compiled("check_ready")) is not None:
        ok: list[bool] = check(headers, slots, gens, keys, block_bytes, SLOT_MAGIC, Flags.READY, snaps)
        return snaps, ok
    inside = (slots >= 0) & (slots < len(headers))
    snaps[:] = headers[np.where(inside, slots, 0)]
    snaps[~inside] = np.zeros(1, dtype=HEADER_DTYPE)
    return snaps, (inside & (snaps["magic"] == SLOT_MAGIC) & (snaps["flags"] == Flags.READY) & (snaps["gen"] == gens)
                   & (gens % 2 == 0) & (snaps["key"] == np.frombuffer(keys, dtype="V32"))
                   & (snaps["length"] == block_bytes) & (snaps["tag"] == key_tags(keys, snaps["checksum"]))).tolist()
