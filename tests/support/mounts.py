"""Mounts the huge-page tests make for themselves (root only): a tmpfs with huge=, a hugetlbfs,
and huge pages set aside for it, each undone when the test ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting tmpfs huge= and hugetlbfs needs root (CI runs as root)")


@contextlib.contextmanager
def mounted(fstype: str, where: Path, options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", fstype, "-o", options, "none", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def huge_pages_set_aside(extra: int) -> Iterator[int]:
    """Raise vm.nr_hugepages by `extra` 2 MiB pages; put it back afterwards. Yields how many the
    kernel actually set aside (it gives fewer when memory is fragmented)."""
    before = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(before + extra))
    try:
        yield int(NR_HUGEPAGES.read_text()) - before
    finally:
        NR_HUGEPAGES.write_text(str(before))
