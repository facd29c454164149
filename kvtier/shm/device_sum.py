"""A block checksum computed where the block is, with torch: on the GPU for a CUDA gpu pool, so a
read from it is verified without bringing the block back to the host (xxh3 runs on the host
only, at about 10 GB/s, where a device copy moves 760-1100 GB/s on an H200).

The slot headers of a CUDA gpu pool carry this sum instead of xxh3 (every other tier keeps
xxh3). The daemon computes it on the device right after it writes a block there from a copy it
verified; readers (the daemon demoting, clients reading through the IPC mapping, which any
client can write) recompute it over their own copy and compare.

The block's bytes are read as 16-bit words laid out in R rows of P columns (P a power of two
dividing the word count, at most 1024). Three exact integer sums, all in int64 with room to spare
for blocks up to 64 MiB: the column sums weighted by column number, the row sums weighted by row
number, and the plain sum. A changed word changes the plain sum; two words swapped change the
column-weighted sum unless they share a column and the row-weighted sum unless they share a row.
Two passes over the block, no temporaries of its size, and one host sync for a whole batch. Like
xxh3 it catches torn and corrupt copies, not an adversary who can also write the header.

The same function runs on CPU tensors, which is how the tests check it and the paths that use it.
"""

from __future__ import annotations

import torch

COLUMNS = 1024
_K1, _K2, _K3 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9  # odd: a mixing bijection
_M64 = (1 << 64) - 1


def _shape(words: int) -> tuple[int, int]:
    p = COLUMNS
    while words % p:
        p //= 2
    return words // p, p


def device_sums(blocks: torch.Tensor) -> list[int]:
    """The checksum of each row of `blocks` (uint8 [k, block_bytes], any device, block_bytes even)."""
    if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % 2:
        raise ValueError("device_sums wants a uint8 [blocks, even block_bytes] tensor")
    k = blocks.shape[0]
    if k == 0:
        return []
    rows, cols = _shape(blocks.shape[1] // 2)
    grid = blocks.contiguous().view(torch.int16).view(k, rows, cols)
    col = grid.sum(dim=1, dtype=torch.int64)  # [k, cols]
    row = grid.sum(dim=2, dtype=torch.int64)  # [k, rows]
    dev = blocks.device
    s_col = (col * torch.arange(1, cols + 1, device=dev, dtype=torch.int64)).sum(dim=1)
    s_row = (row * torch.arange(1, rows + 1, device=dev, dtype=torch.int64)).sum(dim=1)
    plain = col.sum(dim=1)
    sums = torch.stack([plain, s_col, s_row], dim=1).tolist()  # the one sync
    return [(a * _K1 + b * _K2 + c * _K3) & _M64 for a, b, c in sums]


def device_sum(block: torch.Tensor) -> int:
    """The checksum of one block (uint8 [block_bytes], any device)."""
    return device_sums(block.reshape(1, -1))[0]
