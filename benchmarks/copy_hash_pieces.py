"""Copy and xxh3 in one pass, by piece size: the curve behind kvtier/shm/onepass.py's PIECE.

    .venv/bin/python benchmarks/copy_hash_pieces.py [--mib 512] [--block-kib 2048] [--repeat 5]

Copies `--mib` of blocks of `--block-kib` (one thread, best of `--repeat`) four ways, and prints
each against a plain memcpy of the same bytes measured in the same run:
- memcpy alone (the bound);
- copy, then a separate xxh3 pass over each block (what a put and a get did before issue 31);
- copy and hash in pieces of 16 KiB .. 1 MiB: each piece hashed right after it lands;
- kvtier's own `copy_hashed`: compiled where kvtier/shm/native/copy_hash.c built (8 KiB
  pieces, non-temporal stores), else numpy in onepass.PIECE pieces, which must match the best
  of those.
Every digest is checked against the one-shot xxh3 of the block: the streaming form must agree.
"""

from __future__ import annotations

import argparse

import numpy as np
import xxhash

from kvtier.shm.onepass import COMPILED, PIECE, checksum, copy_hashed
from kvtier.tools.bench_basics import best_time as best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--block-kib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    bb = a.block_kib << 10
    n = max(1, (a.mib << 20) // bb)
    src = np.random.default_rng(0).integers(0, 255, (n, bb), dtype=np.uint8)
    dst = np.empty_like(src)
    want = [checksum(src[i]) for i in range(n)]
    gb = n * bb / 1e9
    mc = best(lambda: np.copyto(dst, src), a.repeat)
    print(f"{n} blocks of {a.block_kib} KiB; memcpy {gb / mc:.2f} GB/s (the bound)")

    def two_passes() -> None:
        for i in range(n):
            np.copyto(dst[i], src[i])
            if checksum(dst[i]) != want[i]:
                raise AssertionError("copy then hash: wrong digest")

    t = best(two_passes, a.repeat)
    print(f"copy, then hash:        {gb / t:6.2f} GB/s  {mc / t:.2f}x memcpy")
    for piece in (16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20):
        def pieces(piece: int = piece) -> None:
            for i in range(n):
                h = xxhash.xxh3_64()
                s, d = src[i], dst[i]
                for off in range(0, bb, piece):
                    np.copyto(d[off:off + piece], s[off:off + piece])
                    h.update(d[off:off + piece])
                if h.intdigest() != want[i]:
                    raise AssertionError(f"pieces of {piece}: wrong digest")

        t = best(pieces, a.repeat)
        print(f"pieces of {piece >> 10:5d} KiB:     {gb / t:6.2f} GB/s  {mc / t:.2f}x memcpy")

    def ours() -> None:
        for i in range(n):
            if copy_hashed(dst[i], src[i]) != want[i]:
                raise AssertionError("copy_hashed: wrong digest")

    t = best(ours, a.repeat)
    how = "compiled" if COMPILED else f"{PIECE >> 10} KiB"
    print(f"copy_hashed ({how}):  {gb / t:6.2f} GB/s  {mc / t:.2f}x memcpy")


if __name__ == "__main__":
    main()
