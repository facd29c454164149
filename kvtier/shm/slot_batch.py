"""A slot table's verified reads over a batch of slots, the seqlock checks vectorised: the
headers are gathered at once, before the copies and again after (a gen unchanged at the later
read was unchanged all along), so per block only the tag, the copy and its hash remain in Python.

`holds` is begin_read for a batch with nothing copied: a lookup's answer. `read_rows` is
read_into for a batch. Both answer False for what they cannot vouch for (torn, replaced, corrupt,
a slot out of range); the caller takes the one-block path (kvtier/shm/slots.py) for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.shm.onepass import copy_rows, key_tags
from kvtier.shm.slots import SLOT_MAGIC, Flags, SlotTable


def holds(table: SlotTable, slots: npt.NDArray[np.int64], keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
    """Per key, whether slots[j] holds keys[j] now as a complete block (a hint, as every lookup's
    answer is: a read verifies again)."""
    return _valid(table, slots, keys)[0]


def read_rows(table: SlotTable, slots: npt.NDArray[np.int64], keys: Sequence[bytes], out: npt.NDArray[np.uint8],
              rows: Sequence[int]) -> list[bool]:
    """keys[j] from slots[j] into out[rows[j]] (out: [*, block_bytes] uint8), each verified."""
    ok, idx, before, want = _valid(table, slots, keys)
    sums = np.zeros(len(keys), dtype=np.uint64)
    at = np.flatnonzero(ok)
    sums[at] = copy_rows(out, np.asarray(rows, dtype=np.int64)[at], table.payloads(), idx[at], table.block_bytes)
    after = table.headers(0, table.n)[idx]
    ok &= (after["gen"] == before["gen"]) & (after["key"] == want) & (sums == before["checksum"])
    return ok.tolist()  # type: ignore[no-any-return]


def _valid(table: SlotTable, slots: npt.NDArray[np.int64], keys: Sequence[bytes]
           ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64], Any, Any]:
    """begin_read's checks over the batch: (ok, the slots, their headers as gathered now, the keys)."""
    ok = (slots >= 0) & (slots < table.n)
    idx = np.where(ok, slots, 0)
    before = table.headers(0, table.n)[idx]  # a copy: the gathered headers as they were now
    joined = b"".join(keys)
    want = np.frombuffer(joined, dtype="V32") if keys else np.empty(0, dtype="V32")
    ok &= ((before["magic"] == SLOT_MAGIC) & (before["gen"] % 2 == 0) & (before["flags"] == Flags.VALID)
           & (before["key"] == want) & (before["length"] == table.block_bytes)
           & (before["tag"] == key_tags(joined, before["checksum"])))  # else not one writer's: a miss
    return ok, idx, before, want
