"""The compiled copy and checksum (kvtier/shm/native/copy_hash.c, `kvtier.shm._copy_hash`): built by
the project's own install, and exactly the Python path's result: the same bytes land, nothing
outside the destination is touched, the digest is python-xxhash's xxh3-64 of the bytes. Sizes and
offsets straddle its edges: an unaligned destination's head, its 8 KiB pieces, the 32 KiB from
which it streams past the cache, and a tail that is not a multiple of 64 bytes."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.shm import onepass
from kvtier.shm.onepass import checksum, copy_hashed, copy_hashed_py, copy_rows
from kvtier.shm.slots import key_tag

compiled = onepass._copy_hash  # None where it did not build: the first test says so
GUARD = 64


def test_the_compiled_copy_is_built_by_the_install() -> None:
    assert onepass.COMPILED and compiled is not None, (
        "kvtier.shm._copy_hash did not build (setup: pip install -e . compiles kvtier/shm/native/copy_hash.c; "
        "a C compiler and Python's headers are needed): block copies run on the slower numpy path")
    if platform.machine() in ("x86_64", "AMD64"):
        assert compiled.STREAMS == 1  # non-temporal stores, the path the bench measures
    assert compiled.STREAM_MIN % compiled.CHUNK == 0


EDGES = [0, 1, 15, 16, 63, 64, 65, 8191, 8192, 8193, 32767, 32768, 32769, 65536, 65536 + 24, 3 * 8192 + 40000]
sizes = st.one_of(st.sampled_from(EDGES), st.integers(0, 300_000))


@settings(max_examples=300, deadline=None)
@given(n=sizes, src_off=st.integers(0, 63), dst_off=st.integers(0, 63), seed=st.integers(0, 2**32 - 1))
def test_compiled_copy_lands_exactly_the_bytes_and_their_checksum(n: int, src_off: int, dst_off: int,
                                                                   seed: int) -> None:
    assert compiled is not None
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
    field = rng.integers(0, 256, n + dst_off + 2 * GUARD, dtype=np.uint8)
    before = field.copy()
    dst = field[GUARD + dst_off:GUARD + dst_off + n]
    assert compiled.copy_hashed(dst, src) == checksum(src)
    assert np.array_equal(dst, src)
    # Not a byte outside dst: the head before an aligned store, the tail after the last full 64.
    assert np.array_equal(field[:GUARD + dst_off], before[:GUARD + dst_off])
    assert np.array_equal(field[GUARD + dst_off + n:], before[GUARD + dst_off + n:])


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(0, 12), width=st.sampled_from([64, 1000, 8192, 40_000, 65_536]),
       cut=st.integers(0, 64), seed=st.integers(0, 2**32 - 1))
def test_copy_rows_is_copy_hashed_row_by_row(rows: int, width: int, cut: int, seed: int) -> None:
    """Rows in any order, into rows in any order, of part of a row (a slot is wider than its block)."""
    rng = np.random.default_rng(seed)
    nbytes = max(0, width - cut)
    src = rng.integers(0, 256, (rows + 3, width), dtype=np.uint8)
    dst = rng.integers(0, 256, (rows + 2, width), dtype=np.uint8)
    want = dst.copy()
    src_rows = rng.permutation(rows + 3)[:rows].astype(np.int64)
    dst_rows = rng.permutation(rows + 2)[:rows].astype(np.int64)
    for d, s in zip(dst_rows, src_rows):
        want[d, :nbytes] = src[s, :nbytes]
    sums = copy_rows(dst, dst_rows, src, src_rows, nbytes)
    assert sums.tolist() == [checksum(src[s, :nbytes]) for s in src_rows]
    assert np.array_equal(dst, want)


def test_copy_rows_refuses_what_it_cannot_do_before_copying_anything() -> None:
    assert compiled is not None
    src = np.arange(4 * 128, dtype=np.uint8).reshape(4, 128) % 251
    dst = np.zeros((3, 128), np.uint8)
    sums = np.zeros(2, np.uint64)
    rows = np.array([0, 1], np.int64)
    with pytest.raises(IndexError, match="row 1 names dst row 3"):
        compiled.copy_rows(dst, np.array([0, 3], np.int64), src, rows, 128, sums)
    with pytest.raises(IndexError):
        compiled.copy_rows(dst, rows, src, np.array([0, -1], np.int64), 128, sums)
    assert not dst.any()  # the first row was in range, and was still not copied
    with pytest.raises(ValueError, match="do not fit a row"):
        compiled.copy_rows(dst, rows, src, rows, 129, sums)
    with pytest.raises(ValueError, match="2-D uint8"):
        compiled.copy_rows(dst.reshape(-1), rows, src, rows, 128, sums)
    with pytest.raises(ValueError, match="2-D uint8"):
        compiled.copy_rows(dst.view(np.uint16), rows, src, rows, 64, sums)
    with pytest.raises(ValueError, match="2 8-byte integers"):
        compiled.copy_rows(dst, rows, src, np.array([0], np.int64), 128, sums)
    with pytest.raises(ValueError, match="dst_rows must hold 3 8-byte integers"):  # sums say how many
        compiled.copy_rows(dst, rows, src, rows, 128, np.zeros(3, np.uint64))
    frozen = dst.copy()
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        compiled.copy_rows(frozen, rows, src, rows, 128, sums)
    with pytest.raises(ValueError, match="2 8-byte integers"):  # of the wrong kind
        compiled.copy_rows(dst, rows.astype(np.float64), src, rows, 128, sums)
    with pytest.raises(ValueError, match="2 8-byte integers"):
        compiled.copy_rows(dst, rows, src, rows, 128, np.zeros(2, np.float64))
    compiled.copy_rows(dst[:, :0], rows, src, rows, np.int64(0), sums)  # a numpy int is a size too
    assert sums.tolist() == [checksum(b"")] * 2
    with pytest.raises(ValueError, match="dst holds 3 bytes, src 4"):
        compiled.copy_hashed(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
    assert not dst.any()


def test_buffers_the_compiled_copy_cannot_take_are_still_copied() -> None:
    whole = np.random.default_rng(3).integers(0, 256, 6 * 70_000, dtype=np.uint8)
    strided = whole[::2]  # not contiguous: made contiguous first
    for hash_src in (False, True):
        dst = np.zeros(strided.size, np.uint8)
        assert copy_hashed(dst, strided, hash_src=hash_src) == checksum(strided.copy()) and np.array_equal(dst, strided)
    # A strided destination (a write's; a read hashes what landed, which must be contiguous).
    field = np.zeros(2 * strided.size, np.uint8)
    assert copy_hashed(field[::2], strided, hash_src=True) == checksum(strided.copy())
    assert np.array_equal(field[::2], strided) and not field[1::2].any()


def test_the_python_path_where_the_copy_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a host without a compiler runs: the same digests and bytes."""
    monkeypatch.setattr(onepass, "_copy_hash", None)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (5, 70_000), dtype=np.uint8)
    dst = np.zeros((6, 70_000), np.uint8)
    sums = copy_rows(dst, np.array([5, 0, 2], np.int64), src, np.array([1, 4, 0], np.int64), 69_999)
    assert sums.tolist() == [checksum(src[i, :69_999]) for i in (1, 4, 0)]
    assert np.array_equal(dst[5, :69_999], src[1, :69_999]) and not dst[5, 69_999] and not dst[1].any()
    with pytest.raises(IndexError):  # as the compiled copy, not numpy's wrap-around
        copy_rows(dst, np.array([-1], np.int64), src, np.array([0], np.int64), 10)
    before = dst.copy()
    with pytest.raises(IndexError):  # every row checked before any is copied
        copy_rows(dst, np.array([0, 1], np.int64), src, np.array([0, 5], np.int64), 10)
    with pytest.raises(ValueError, match="do not fit a row"):
        copy_rows(dst, np.array([0], np.int64), src, np.array([0], np.int64), -1)
    assert np.array_equal(dst, before)
    one = np.zeros(70_000, np.uint8)
    assert copy_hashed(one, src[2]) == copy_hashed_py(np.zeros(70_000, np.uint8), src[2]) == checksum(src[2])
    assert np.array_equal(one, src[2])


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 120_000), max_size=6), dst_off=st.integers(0, 63), hashed=st.integers(0, 5000),
       seed=st.integers(0, 2**32 - 1))
def test_a_stream_over_copies_and_updates_is_one_checksum(cuts: list[int], dst_off: int, hashed: int,
                                                          seed: int) -> None:
    """A block that lands in runs (vLLM's per-layer pages, SGLang's strided pages): the compiled
    stream's digest over its copies, after bytes fed by `update`, is the one-shot xxh3 of all."""
    assert compiled is not None
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 256, hashed, dtype=np.uint8)
    src = rng.integers(0, 256, sum(cuts), dtype=np.uint8)
    field = np.zeros(src.size + dst_off, np.uint8)
    dst = field[dst_off:]
    h = onepass.checksum_stream()
    assert isinstance(h, compiled.Stream)
    h.update(head)
    off = 0
    for n in cuts:
        onepass.copy_streamed(h, dst[off:off + n], src[off:off + n])  # h.copy_hashed, compiled
        off += n
    assert h.intdigest() == checksum(np.concatenate([head, src]))
    assert np.array_equal(dst, src) and not field[:dst_off].any()


def test_a_stream_refuses_a_second_thread_while_one_copies() -> None:
    """Its state is used with the GIL released: a call from another thread meanwhile is refused,
    never let race on it (a race could write past the state's buffer), and the copy's digest is
    whole. The main thread asks for the digest until it meets the copy running (its GIL is free
    meanwhile, so it does, within a few tries at most)."""
    import threading

    assert compiled is not None
    big = np.random.default_rng(2).integers(0, 256, 64 << 20, dtype=np.uint8)
    out = np.empty_like(big)
    refused: list[str] = []
    for _ in range(50):
        h = compiled.Stream()
        t = threading.Thread(target=h.copy_hashed, args=(out, big))
        t.start()
        while t.is_alive() and not refused:
            try:
                h.intdigest()
            except RuntimeError as e:
                refused.append(str(e))
                for name, args in (("update", (b"x",)), ("copy_hashed", (np.zeros(1, np.uint8), b"x"))):
                    try:  # still copying: refused too, and feeds nothing; done: would feed "x"
                        if t.is_alive():
                            getattr(h, name)(*args)
                            refused.append("ran")  # the copy ended in between: the digest check below says so
                    except RuntimeError as e2:
                        refused.append(str(e2))
        t.join()
        if "ran" not in refused:  # what was refused fed nothing
            assert h.intdigest() == checksum(big) and np.array_equal(out, big)
        if refused:
            break
    assert refused and refused[0] == "a Stream is used by one thread at a time", refused


def test_a_stream_refuses_bad_arguments() -> None:
    assert compiled is not None
    with pytest.raises(TypeError):
        compiled.Stream(1)
    h = compiled.Stream()
    with pytest.raises(ValueError, match="dst holds 3 bytes, src 4"):
        h.copy_hashed(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
    with pytest.raises(TypeError):
        h.copy_hashed(np.zeros(3, np.uint8))
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        h.copy_hashed(frozen, np.zeros(4, np.uint8))
    assert h.intdigest() == checksum(b"")  # nothing was fed by the refused calls


def test_the_python_stream_where_the_copy_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onepass, "_copy_hash", None)
    src = np.random.default_rng(9).integers(0, 256, 600_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    h = onepass.checksum_stream()
    assert compiled is None or not isinstance(h, compiled.Stream)
    onepass.copy_streamed(h, dst[:300_001], src[:300_001])
    onepass.copy_streamed(h, dst[300_001:], src[300_001:], hash_src=True)
    assert h.intdigest() == checksum(src) and np.array_equal(dst, src)


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.binary(min_size=32, max_size=32), max_size=40), seed=st.integers(0, 2**32 - 1))
def test_key_tags_are_key_tag_of_each_key_compiled_and_in_python(keys: list[bytes], seed: int) -> None:

    sums = np.random.default_rng(seed).integers(0, 2**64 - 1, len(keys), dtype=np.uint64, endpoint=True)
    want = [key_tag(k, int(c)) for k, c in zip(keys, sums)]
    assert onepass.key_tags(b"".join(keys), sums).tolist() == want
    with pytest.MonkeyPatch.context() as m:
        m.setattr(onepass, "_copy_hash", None)  # the path where the copy did not build
        assert onepass.key_tags(b"".join(keys), sums).tolist() == want


def test_key_tags_refuse_keys_and_checksums_that_do_not_pair() -> None:
    assert compiled is not None
    with pytest.raises(ValueError, match="32 bytes of keys"):
        onepass.key_tags(bytes(32), np.zeros(2, dtype=np.uint64))
    with pytest.raises(ValueError, match="33 bytes"):
        onepass.key_tags(bytes(33), np.zeros(1, dtype=np.uint64))
    with pytest.raises(ValueError, match="whole 32-byte keys"):
        compiled.key_tags(bytes(33), np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64))
    with pytest.raises(ValueError, match="key_tags: tags must hold 1"):
        compiled.key_tags(bytes(32), np.zeros(1, dtype=np.uint64), np.zeros(2, dtype=np.uint64))


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def test_the_avx2_kernel_runs_where_the_cpu_has_it() -> None:
    """xxh3's AVX2 kernel is picked at import (copy_hash.c `hash_update`); this test process runs
    it wherever the CPU has AVX2, so every digest test above checked it against python-xxhash."""
    import os

    assert compiled is not None
    if os.environ.get("KVTIER_HASH_KERNEL") == "baseline":
        assert compiled.HASH_KERNEL == "baseline", "the switch keeps SSE2"
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        assert compiled.HASH_KERNEL == "baseline"
        return
    assert compiled.HASH_KERNEL == ("avx2" if _cpu_has_avx2() else "baseline")
    assert onepass.HASH_KERNEL == compiled.HASH_KERNEL


BASELINE_CHECK = """
import numpy as np, xxhash
from kvtier.shm import onepass
from kvtier.shm.onepass import checksum_stream, copy_hashed, copy_rows
assert onepass.HASH_KERNEL == "baseline", onepass.HASH_KERNEL
rng = np.random.default_rng(7)
for n in [0, 1, 63, 64, 240, 241, 8191, 8192, 8193, 32768, 65536 + 24, 300_001]:
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    assert copy_hashed(dst, src) == xxhash.xxh3_64_intdigest(src.tobytes()) and np.array_equal(dst, src), n
    h = checksum_stream()
    h.copy_hashed(dst[:n // 3], src[:n // 3]); h.update(src[n // 3:])
    assert h.intdigest() == xxhash.xxh3_64_intdigest(src.tobytes()), n
rows = rng.integers(0, 256, (4, 70_000), dtype=np.uint8)
out = np.zeros_like(rows)
sums = copy_rows(out, np.arange(4), rows, np.arange(4), 70_000)
assert [int(s) for s in sums] == [xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows] and np.array_equal(out, rows)
print("baseline ok")
"""


def test_the_baseline_kernel_gives_the_same_digests() -> None:
    """KVTIER_HASH_KERNEL=baseline keeps the SSE2 kernel (read at import, so in a process of its
    own): the kernel every non-AVX2 x86-64 runs, checked here against python-xxhash too."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVTIER_HASH_KERNEL": "baseline"}
    done = subprocess.run([sys.executable, "-c", BASELINE_CHECK], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "baseline ok" in done.stdout, done.stderr[-2000:]


UNOPTIMISED_CHECK = """
import importlib.machinery, importlib.util, sys
import numpy as np, xxhash
loader = importlib.machinery.ExtensionFileLoader("_copy_hash", sys.argv[1])
mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("_copy_hash", loader))
loader.exec_module(mod)
rng = np.random.default_rng(11)
for n in [300_001, 65536, 8193, 241]:
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    want = xxhash.xxh3_64_intdigest(src.tobytes())
    assert mod.copy_hashed(dst, src) == want and np.array_equal(dst, src), n
    h = mod.Stream()
    h.update(src[:n // 2]); h.update(src[n // 2:])
    assert h.intdigest() == want, n
print("kernel", mod.HASH_KERNEL)
"""


def test_the_kernels_hold_without_the_optimiser(tmp_path) -> None:
    """copy_hash.c built at -O0, where the compiler keeps xxh3's functions apart and realigns no
    stack: the AVX2 kernel's accumulators must be aligned by the source itself (XXH_ACC_ALIGN), or
    it crashes (it did, in two runs of three, before they were)."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    native = Path(onepass.__file__).parent / "native"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler builds the extension at install, so one is here"
    out = tmp_path / f"_copy_hash{sysconfig.get_config_var('EXT_SUFFIX')}"
    built = subprocess.run([cc, "-O0", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", f"-I{native}",
                            str(native / "copy_hash.c"), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_HASH_KERNEL"}
    for _ in range(3):  # an unaligned vector store crashed two runs of three
        done = subprocess.run([sys.executable, "-c", UNOPTIMISED_CHECK, str(out)], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert done.stdout.strip() == f"kernel {'avx2' if _cpu_has_avx2() else 'baseline'}"
