"""The disk tier's block file on real filesystems: ext4 under the test's tmp dir (O_DIRECT), and
tmpfs mounts the test makes (root) for a full disk and a read-only remount. Every damaged block
must read as a miss, never as other bytes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.disk.blockfile import DiskBlockFile, aligned_empty
from kvtier.errors import DiskFault, SegmentError
from kvtier.failpoints import IoFaults
from kvtier.shm.slots import HEADER_OFF, SLOT_HDR
from tests.support.mounts import mounted, need_root

BB = 64 * 1024 + 512  # not a whole number of pages: the bounce-buffer path is exercised too
FP = b"f" * 32


def _key(i: int) -> bytes:
    return (i + 1).to_bytes(4, "little") * 8  # never all zeros: that is the empty key


def _block(i: int, nbytes: int = BB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def _open(path: Path, n: int = 16, bb: int = BB, **kw: object) -> DiskBlockFile:
    f, _ = DiskBlockFile.open_or_create(path, n, bb, FP, **kw)  # type: ignore[arg-type]
    return f


def test_blocks_round_trip_verified_and_o_direct_on_ext4(tmp_path: Path) -> None:
    f = _open(tmp_path / "pool.blocks")
    try:
        assert f.direct, "ext4 takes O_DIRECT: payloads must bypass the page cache"
        for i in range(16):
            f.write(i, _key(i), _block(i), parent=_key(i - 1) if i else None)
        for i in range(16):
            out = np.empty(BB, np.uint8)
            assert f.read_into(i, _key(i), out) is not None
            assert np.array_equal(out, _block(i))
        aligned = aligned_empty(BB)
        assert f.read_into(3, _key(3), aligned) is not None and np.array_equal(aligned, _block(3))
        assert f.read_into(3, _key(4), np.empty(BB, np.uint8)) is None  # another key: a miss
        f.invalidate(3)
        assert f.read_into(3, _key(3), np.empty(BB, np.uint8)) is None
    finally:
        f.close()
    assert os.path.getsize(tmp_path / "pool.blocks") == f.payload_off + 16 * f.stride  # never grows


def test_capacity_is_fixed_and_the_reserve_is_kept(tmp_path: Path) -> None:
    n = DiskBlockFile.slots_for(10 << 20, BB)
    f = _open(tmp_path / "a.blocks", n=n)
    try:
        assert os.path.getsize(f.path) <= 10 << 20
        with pytest.raises(IndexError):
            f.write(n, _key(0), _block(0))
    finally:
        f.close()
    vfs = os.statvfs(tmp_path)
    with pytest.raises(SegmentError, match="reserve"):
        _open(tmp_path / "b.blocks", n=4, reserve_bytes=vfs.f_bavail * vfs.f_frsize)
    assert not (tmp_path / "b.blocks").exists() or os.path.getsize(tmp_path / "b.blocks") == 0


def test_adoption_after_kill_9_serves_the_written_blocks(tmp_path: Path) -> None:
    path = tmp_path / "pool.blocks"
    script = f"""
import os, signal, numpy as np
from pathlib import Path
from kvtier.disk.blockfile import DiskBlockFile
f, _ = DiskBlockFile.open_or_create(Path({str(path)!r}), 16, {BB}, {FP!r})
for i in range(10):
    f.write(i, (i + 1).to_bytes(4, 'little') * 8, np.random.default_rng(i).integers(0, 256, {BB}, dtype=np.uint8))
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], timeout=60)
    assert r.returncode == -9
    f, adopted = DiskBlockFile.open_or_create(path, 16, BB, FP)
    try:
        assert adopted
        got = f.adopt(0, f.n)
        assert sorted(got.slots.tolist()) == list(range(10))
        for s, k in zip(got.slots.tolist(), got.keys):
            out = np.empty(BB, np.uint8)
            assert k == _key(s) and f.read_into(s, k, out) is not None and np.array_equal(out, _block(s))
    finally:
        f.close()


def test_another_layout_or_a_damaged_header_is_not_adopted(tmp_path: Path) -> None:
    path = tmp_path / "pool.blocks"
    f = _open(path)
    f.write(0, _key(0), _block(0))
    f.close()
    g, adopted = DiskBlockFile.open_or_create(path, 16, BB, b"g" * 32)  # other weights: other fingerprint
    assert not adopted and len(g.adopt(0, g.n).slots) == 0
    g.close()
    with open(path, "r+b") as fh:
        fh.write(b"garbage!")
    h, adopted = DiskBlockFile.open_or_create(path, 16, BB, b"g" * 32)
    assert not adopted
    h.close()


def test_corrupt_torn_and_truncated_blocks_are_misses(tmp_path: Path) -> None:
    path = tmp_path / "pool.blocks"
    f = _open(path)
    for i in range(16):
        f.write(i, _key(i), _block(i))
    off = f.payload_off
    stride = f.stride
    f.close()
    with open(path, "r+b") as fh:
        fh.seek(off + 2 * stride + 1000)  # a flipped byte in block 2's payload
        b = fh.read(1)
        fh.seek(off + 2 * stride + 1000)
        fh.write(bytes([b[0] ^ 0xFF]))
        fh.seek(HEADER_OFF + 5 * SLOT_HDR + 8)  # block 5 torn: its gen left odd by a writer that died
        fh.write((7).to_bytes(8, "little"))
        fh.seek(off + 7 * stride)  # block 7: a new payload whose header was never published
        fh.write(_block(99).tobytes())
    os.truncate(path, off + 12 * stride + 100)  # blocks 12..15 cut off
    f, adopted = DiskBlockFile.open_or_create(path, 16, BB, FP)
    try:
        assert adopted
        got = f.adopt(0, f.n)
        assert 5 not in got.slots.tolist() and max(got.slots.tolist()) == 11
        misses = [i for i in range(16) if f.read_into(i, _key(i), np.empty(BB, np.uint8)) is None]
        assert misses == [2, 5, 7, 12, 13, 14, 15]
        assert os.path.getsize(path) == off + 16 * stride  # the file is whole again
    finally:
        f.close()
    f, _ = DiskBlockFile.open_or_create(path, 16, BB, FP)  # the cut-off headers stay cleared
    try:
        assert max(f.adopt(0, f.n).slots.tolist()) == 11
    finally:
        f.close()


def test_a_full_disk_refuses_the_file_with_a_clear_error(tmp_path: Path) -> None:
    need_root()
    with mounted("tmpfs", tmp_path / "small", "size=4m") as d:
        with pytest.raises(SegmentError, match="cannot allocate|reserve"):
            _open(d / "pool.blocks", n=128)


def test_a_read_only_filesystem_and_injected_enospc_surface_as_disk_faults(tmp_path: Path) -> None:
    need_root()
    with mounted("tmpfs", tmp_path / "ro", "size=16m") as d:
        _open(d / "pool.blocks", n=8).close()
        subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
        with pytest.raises(DiskFault) as ro:
            _open(d / "pool.blocks", n=8)
        assert ro.value.errno == errno.EROFS and "cannot open" in str(ro.value)
    f = _open(tmp_path / "inj.blocks", n=8, faults=IoFaults("enospc:write:2"))
    try:
        f.write(0, _key(0), _block(0))
        with pytest.raises(DiskFault) as e:
            f.write(1, _key(1), _block(1))
        assert e.value.errno == errno.ENOSPC and e.value.op == "write"
        assert f.read_into(1, _key(1), np.empty(BB, np.uint8)) is None  # the failed write is a miss
        assert f.read_into(0, _key(0), np.empty(BB, np.uint8)) is not None
    finally:
        f.close()


def test_injected_eio_on_read_is_a_fault_not_bytes(tmp_path: Path) -> None:
    f = _open(tmp_path / "pool.blocks", n=4, faults=IoFaults("eio:read"))
    try:
        f.write(0, _key(0), _block(0))
        with pytest.raises(DiskFault) as e:
            f.read_into(0, _key(0), np.empty(BB, np.uint8))
        assert e.value.errno == errno.EIO and "injected" in str(e.value)
    finally:
        f.close()
    with pytest.raises(ValueError, match="inject_fault"):
        IoFaults("eio:sometimes")
