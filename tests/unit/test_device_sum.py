"""The device checksum (kvtier/shm/device_sum.py) and the verification paths of a device gpu pool,
run on CPU tensors: the same code benchmarks/gpu_check.py runs on CUDA."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvtier.client.pools import read_device_block
from kvtier.core.events import Tier
from kvtier.core.index import TierIndex
from kvtier.shm.device_sum import device_sum, device_sums
from kvtier.shm.directory import DirectoryWriter, directory_bytes, directory_capacity
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable, checksum, segment_bytes
from kvtier.tiers.local import LocalTier

BB = 64 << 10
FP = b"\x07" * 32


def blocks(n: int, bb: int = BB, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, bb), dtype=np.uint8))


@pytest.mark.parametrize("bb", [2, 6, 4096, BB, 3 * 4096, 2 << 20])
def test_the_sum_is_a_function_of_the_bytes_and_the_batch_agrees_with_one_at_a_time(bb):
    b = blocks(3, bb)
    sums = device_sums(b)
    assert sums == [device_sum(b[i]) for i in range(3)]
    assert sums == device_sums(b.clone()), "same bytes, same sum"
    assert len(set(sums)) == 3 and all(0 <= s < 2**64 for s in sums)


def test_a_changed_byte_or_two_swapped_words_change_the_sum():
    b = blocks(1)[0]
    ref = device_sum(b)
    for pos in (0, 1, 777, BB - 1):
        c = b.clone()
        c[pos] ^= 0x01
        assert device_sum(c) != ref
    words = b.clone().view(torch.int16)
    for i, j in ((0, 1), (5, 5 + 1024), (3, 3 + 7 * 1024 + 9)):  # same row, same column, neither
        if words[i] == words[j]:
            continue
        c = words.clone()
        c[i], c[j] = words[j], words[i]
        assert device_sum(c.view(torch.uint8)) != ref, (i, j)
    torn = b.clone()
    torn[BB // 2:] = blocks(1, seed=9)[0][BB // 2:]  # half old, half new: a torn copy
    assert device_sum(torn) != ref


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        device_sums(torch.zeros((2, 3), dtype=torch.uint8))  # odd length
    with pytest.raises(ValueError):
        device_sums(torch.zeros((2, 4), dtype=torch.int16))


@pytest.fixture
def device_tier():
    """A gpu tier whose payload is a torch tensor: the CUDA pool's code, on a CPU tensor."""
    n = 4
    hdr = ShmSegment.create(f"kvtier.devsum-{uuid.uuid4().hex[:8]}.gpu", segment_bytes(n, BB, with_payload=False))
    dseg = ShmSegment.create(f"kvtier.devsum-{uuid.uuid4().hex[:8]}.dir", directory_bytes(directory_capacity(n)))
    try:
        table = SlotTable.format(hdr, Kind.GPU_HEADERS, n, BB, FP)
        directory = DirectoryWriter.create(dseg, directory_capacity(n), FP)
        payload = torch.zeros((n, BB), dtype=torch.uint8)
        yield LocalTier(Tier.GPU, table, TierIndex(n), directory, device_payload=payload), table, payload
        table.close()
    finally:
        for s in (hdr, dseg):
            s.close()
            s.unlink()


def test_a_device_pool_holds_device_sums_and_every_read_verifies_its_own_copy(device_tier):
    tier, table, payload = device_tier
    data = blocks(2, seed=3).numpy()
    keys = [bytes([i + 1]) * 32 for i in range(2)]
    for k, row in zip(keys, data):
        e = tier.index.reserve(k, None)
        tier.fill(e, row, checksum(row))
        tier.index.commit(k)
    assert table.header(tier.slot_of(keys[0])).checksum == device_sum(payload[tier.slot_of(keys[0])])
    out = np.empty(BB, dtype=np.uint8)
    # The daemon's read (a demote): verified on the device, then the xxh3 of what reached the host.
    assert tier.read(keys[0], out) == checksum(data[0]) and np.array_equal(out, data[0])
    # A client's read through the mapping: verified on its own copy, on the copy's device.
    dst = torch.empty(BB, dtype=torch.uint8)
    s1 = tier.slot_of(keys[1])
    assert read_device_block(payload, table, s1, keys[1], dst) and np.array_equal(dst.numpy(), data[1])
    assert not read_device_block(payload, table, s1, keys[0], dst), "another key's slot is a miss"
    payload[s1, 100] ^= 0xFF  # a client wrote the mapping
    assert tier.read(keys[1], out) is None
    assert not read_device_block(payload, table, s1, keys[1], dst)
