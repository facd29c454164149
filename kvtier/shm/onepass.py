"""Copy and checksum in one pass over the payload.

A block is copied in pieces, and each piece is hashed right after it lands, while it is still in
the core's cache: the hash then reads cache rather than memory, and the copy plus its checksum
cost little more than the copy alone. A separate hash pass over a 2 MiB block reads it from
memory a second time (0.63x memcpy here, against 0.82x in pieces: docs/performance.md has the
curve). xxh3's streaming form gives the same digest as the one-shot `checksum`, so slots written
either way verify either way.

Always the private side is hashed: a read hashes its own copy (the slot may change under it), a
write hashes its source (`hash_src`), never the shared slot it writes. Two processes may write
one slot at once (a granted slot: kvtier/tiers/grants.py), and a hash of the slot could then
certify a mix of both; a hash of the source certifies only bytes this writer wrote.

`copy_hashed` runs compiled where kvtier/shm/native/copy_hash.c was built (the `_copy_hash`
extension, optional at install): each 8 KiB piece loaded once, stored to the destination with
non-temporal stores and hashed from a bounce buffer in L1, the GIL released. Its digest is of
exactly the bytes both read and written, which satisfies both rules above at once. Where it was
not built, numpy and python-xxhash do the same work (`copy_hashed_py`); `COMPILED` says which.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import numpy as np
import numpy.typing as npt
import xxhash

try:
    from kvtier.shm import _copy_hash  # type: ignore[attr-defined]  # built at install, if it could be
except ImportError:
    _copy_hash = None

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    # Bytes to hash: any buffer, or a numpy array (numpy's stubs declare ndarray's __buffer__ only
    # for Python >= 3.12, so for mypy an array is not a buffer on 3.11).
    HashInput: TypeAlias = ReadableBuffer | npt.NDArray[Any]

# Small enough to stay in a core's L2 (512 KiB on the hosts measured) beside its source, large
# enough that the per-piece Python call costs little: the curve is flat from 256 to 512 KiB.
PIECE = 256 << 10

# Whether block copies run compiled (kvtier/shm/native/copy_hash.c) or in numpy and python-xxhash.
COMPILED: bool = _copy_hash is not None
# xxh3's kernel in the compiled copy: "avx2" where the CPU has it, else "baseline" (SSE2 on x86-64).
HASH_KERNEL: str = getattr(_copy_hash, "HASH_KERNEL", "baseline") if COMPILED else "python-xxhash"


def compiled(name: str) -> Any:
    """The compiled extension's function `name`, or None (not built here, or built before it)."""
    return getattr(_copy_hash, name, None)


def checksum(data: HashInput) -> int:
    """The payload checksum of every slot, block file and Redis value: xxh3-64."""
    return xxhash.xxh3_64_intdigest(cast("ReadableBuffer", data))


def key_tags(keys: bytes, csums: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """`slots.key_tag` of each 32-byte key of `keys` (joined) with its checksum, for a batch's
    headers: compiled, a few nanoseconds a key, where a Python call each costs 300."""
    n = len(keys) // 32
    sums = np.ascontiguousarray(csums, dtype=np.uint64)
    if len(keys) % 32 or len(sums) != n:
        raise ValueError(f"key_tags: {len(keys)} bytes of keys, {len(sums)} checksums")
    tags = np.empty(n, dtype=np.uint64)
    if (tags_of := compiled("key_tags")) is not None:  # (a build from before it: Python)
        tags_of(keys, sums, tags)
        return tags
    for j, c in enumerate(sums.tolist()):
        tags[j] = key_tag(keys[32 * j:32 * j + 32], c)
    return tags


def key_tag(key: bytes, csum: int) -> int:
    """A slot header's tag: binds `key` to the payload checksum `csum` (kvtier/shm/slots.py)."""
    return xxhash.xxh3_64_intdigest(key + csum.to_bytes(8, "little"))


class ChecksumStream(Protocol):
    """`checksum` taken piece by piece: python-xxhash's xxh3_64, or the compiled `Stream`."""

    def update(self, data: Any, /) -> None: ...  # a buffer, or a numpy array (see HashInput)

    def intdigest(self) -> int: ...


def checksum_stream() -> ChecksumStream:
    """`checksum` computed piece by piece: update(piece) in payload order, then intdigest(). For
    a caller that copies a block in pieces (vLLM's per-layer pages) and hashes each as it lands
    (`copy_streamed`). Compiled where the copy is (its `copy_hashed` then copies and hashes in one
    call); used by one thread at a time."""
    return _copy_hash.Stream() if _copy_hash is not None else xxhash.xxh3_64()


def copy_hashed(dst: npt.NDArray[np.uint8], src: npt.NDArray[Any], *, hash_src: bool = False) -> int:
    """Copy src (any dtype, contiguous) into dst (uint8 of the same bytes); the xxh3 of what
    landed in dst (a read), or with `hash_src` of what was copied from src (a write)."""
    flat = src if src.dtype == np.uint8 and src.ndim == 1 else src.reshape(-1).view(np.uint8)
    if not flat.flags.c_contiguous:
        flat = np.ascontiguousarray(flat)  # a strided byte view: no caller in kvtier passes one
    if _copy_hash is not None and dst.nbytes == flat.nbytes and dst.flags.c_contiguous:
        return _copy_hash.copy_hashed(dst, flat)  # type: ignore[no-any-return]
    return copy_hashed_py(dst, flat, hash_src=hash_src)


def copy_rows(dst: npt.NDArray[np.uint8], dst_rows: npt.NDArray[np.int64], src: npt.NDArray[np.uint8],
              src_rows: npt.NDArray[np.int64], nbytes: int, *, hash_src: bool = False) -> npt.NDArray[np.uint64]:
    """For each j, the first `nbytes` of src[src_rows[j]] copied into dst[dst_rows[j]]; their
    checksums (`copy_hashed` of each, `hash_src` as there; dst and src 2-D uint8 with contiguous
    rows). Compiled, the whole batch is one call with the GIL released, so the copy threads of a
    get of small blocks no longer take turns at it a block at a time."""
    sums = np.empty(len(dst_rows), dtype=np.uint64)
    if _copy_hash is not None:
        _copy_hash.copy_rows(dst, np.ascontiguousarray(dst_rows, dtype=np.int64), src,
                             np.ascontiguousarray(src_rows, dtype=np.int64), nbytes, sums)
        return sums
    # The compiled copy's checks, all before any row is copied.
    if len(dst_rows) != len(src_rows):
        raise ValueError(f"copy_rows: {len(dst_rows)} dst rows, {len(src_rows)} src rows")
    if not 0 <= nbytes <= min(dst.shape[1], src.shape[1]):
        raise ValueError(f"copy_rows: {nbytes} bytes do not fit a row")
    if len(dst_rows) and not (0 <= int(np.min(dst_rows)) and int(np.max(dst_rows)) < len(dst)
                              and 0 <= int(np.min(src_rows)) and int(np.max(src_rows)) < len(src)):
        raise IndexError("copy_rows: a row out of range")  # no wrapping around, as numpy would
    for j, (d, s) in enumerate(zip(dst_rows.tolist(), src_rows.tolist())):
        sums[j] = copy_hashed_py(dst[d, :nbytes], src[s, :nbytes], hash_src=hash_src)
    return sums


def copy_hashed_py(dst: npt.NDArray[np.uint8], flat: npt.NDArray[np.uint8], *, hash_src: bool = False) -> int:
    """`copy_hashed` in numpy and python-xxhash, for flat contiguous uint8 src: where the compiled
    copy was not built, and for a dst it cannot take (not contiguous: a write's only)."""
    if dst.nbytes <= PIECE:
        np.copyto(dst, flat)
        return xxhash.xxh3_64_intdigest(flat if hash_src else dst)  # type: ignore[arg-type]  # see HashInput
    h = xxhash.xxh3_64()
    copy_streamed(h, dst, flat, hash_src=hash_src)
    return h.intdigest()


def copy_streamed(h: ChecksumStream, dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8], *,
                  hash_src: bool = False) -> None:
    """Copy src into dst (both flat uint8 of the same size) a piece at a time, feeding each piece
    to the stream `h` right after its copy, while it is in cache: the piece as it landed in dst
    (a read), or with `hash_src` as it was read from src (a write into shared memory). For a
    block that lands in several runs (a strided page), one stream over all of them. With a
    compiled stream (`checksum_stream`), one compiled call: the bytes read are the bytes written
    and hashed (see the module's docstring)."""
    if (_copy_hash is not None and isinstance(h, _copy_hash.Stream) and dst.nbytes == src.nbytes
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        cast(Any, h).copy_hashed(dst, src)
        return
    for off in range(0, dst.nbytes, PIECE):
        piece, source = dst[off:off + PIECE], src[off:off + PIECE]
        np.copyto(piece, source)
        h.update(cast("ReadableBuffer", source if hash_src else piece))


def pread_hashed(fd: int, dst: npt.NDArray[np.uint8], offset: int) -> tuple[int, int]:
    """pread dst.nbytes from fd at offset into dst, hashing each piece as it lands: (bytes read,
    xxh3 of dst). A short read stops early; its checksum is then of no use."""
    n = dst.nbytes
    if n <= PIECE:
        got = os.preadv(fd, [dst.data], offset)
        return got, checksum(dst)
    h = xxhash.xxh3_64()
    got = 0
    for off in range(0, n, PIECE):
        piece = dst[off:off + PIECE]
        k = os.preadv(fd, [piece.data], offset + off)
        got += k
        if k != piece.nbytes:
            break
        h.update(cast("ReadableBuffer", piece))
    return got, h.intdigest()
