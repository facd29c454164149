"""Copy and hash in one pass (kvtier/shm/onepass.py): whatever the size and however a block is
split, the digest taken piece by piece as the bytes land is the one-shot xxh3 of the block, and
the bytes land exactly. Sizes straddle the piece size, where the loop's edges are."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.shm.onepass import PIECE, checksum, checksum_stream, copy_hashed, copy_streamed, pread_hashed

SIZES = [1, 1000, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 5]


@pytest.mark.parametrize("n", SIZES)
def test_copy_hashed_lands_the_bytes_and_their_checksum(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    assert copy_hashed(dst, src) == checksum(src)
    assert np.array_equal(dst, src)
    # A write hashes its source (the private side), piece by piece too: the same digest. (That it
    # is the source and not the shared slot is what tests/integration/test_torn_reads.py's two
    # writers check: hashing the slot let a mix of two writers' bytes through.)
    again = np.zeros(n, np.uint8)
    assert copy_hashed(again, src, hash_src=True) == checksum(src) and np.array_equal(again, src)
    wide = np.random.default_rng(n).integers(0, 1 << 16, (n + 1) // 2, dtype=np.uint16)  # any dtype, as bytes
    out = np.zeros(wide.nbytes, np.uint8)
    assert copy_hashed(out, wide) == checksum(wide.view(np.uint8)) and np.array_equal(out, wide.view(np.uint8))


def test_copy_streamed_over_runs_is_one_checksum() -> None:
    src = np.random.default_rng(7).integers(0, 256, 2 * PIECE + 333, dtype=np.uint8)
    dst = np.zeros_like(src)
    h = checksum_stream()
    cuts = [0, 17, PIECE + 40, src.size]  # three runs of odd sizes, as a strided page has
    for a, b in zip(cuts, cuts[1:]):
        copy_streamed(h, dst[a:b], src[a:b])
    assert h.intdigest() == checksum(src) and np.array_equal(dst, src)
    h, out = checksum_stream(), np.zeros_like(src)
    for a, b in zip(cuts, cuts[1:]):
        copy_streamed(h, out[a:b], src[a:b], hash_src=True)
    assert h.intdigest() == checksum(src) and np.array_equal(out, src)


@pytest.mark.parametrize("n", SIZES)
def test_pread_hashed_and_a_short_read(tmp_path, n: int) -> None:
    data = np.random.default_rng(n + 1).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100 + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.zeros(n, np.uint8)
        assert pread_hashed(fd, dst, 100) == (n, checksum(data)) and np.array_equal(dst, data)
        got, _ = pread_hashed(fd, np.zeros(n + 10, np.uint8), 100)  # past the end of the file
        assert got == n  # short: the caller sees it and treats the block as a miss
    finally:
        os.close(fd)
