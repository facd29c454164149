"""A batch of slots made VALID in one pass: a tier worker adopting a put's granted slots.

`SlotTable.end_write` publishes one slot's header under the seqlock; for a batch that is three
struct reads and writes per block in Python. Here each step of the seqlock is one vectorised
store over the whole batch, in the same order (gen odd, header, gen even), so a reader of any of
these slots sees a whole header or a miss, as with end_write.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.shm.slots import Flags


def flip_valid(headers: npt.NDArray[Any], slots: npt.NDArray[np.int64], checked: npt.NDArray[Any]) -> None:
    """READY -> VALID for a batch of slots (`headers`: the table's, over the mapping; `checked`:
    those slots' headers as the caller checked them): every gen odd (readers of these slots miss
    from here), the checked header written back with flags VALID, every gen even. One numpy store
    per step, and x86 keeps stores in order, as end_write relies on per slot."""
    cur = headers["gen"][slots]
    odd = np.where(cur % 2 == 0, cur + 1, cur + 2)  # as begin_write: past a writer that died mid-write
    headers["gen"][slots] = odd
    body = checked.copy()
    body["flags"], body["gen"] = Flags.VALID, odd
    headers[slots] = body
    headers["gen"][slots] = odd + 1
