"""Client staging segments as the daemon sees them: attached on first use, reaped when the client dies.

A client writes new blocks into its own staging segment and names it in a Put event. The bytes are
untrusted: the worker copies them, verifies key, length and checksum under the seqlock, and only
then stores them.
"""

from __future__ import annotations

import os
import re

from kvtier.errors import SegmentError
from kvtier.tiers.segment import SHM_DIR, ShmSegment
from kvtier.tiers.slots import Flags, Kind, SlotTable


def staging_prefix(node: str) -> str:
    return f"kvtier.{node}.stage."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StagingSegments:
    def __init__(self, node: str, log) -> None:
        self._prefix = staging_prefix(node)
        self._name_re = re.compile(re.escape(self._prefix) + r"[0-9]+\.[0-9a-f]{8,32}")
        self._open: dict[str, SlotTable] = {}
        self.log = log

    def get(self, name: str, block_bytes: int) -> SlotTable:
        """The staging table `name`, attached and validated; SegmentError if it cannot be trusted."""
        table = self._open.get(name)
        if table is None:
            if not self._name_re.fullmatch(name):
                raise SegmentError(f"{name!r} is not a staging segment of this node")
            seg = ShmSegment.attach(name, writable=True)
            try:
                table = SlotTable.open(seg, Kind.STAGING)
            except SegmentError:
                seg.close()
                raise
            self._open[name] = table
        if table.block_bytes != block_bytes:
            raise SegmentError(f"staging {name} holds blocks of {table.block_bytes} bytes, pool needs {block_bytes}")
        return table

    def release(self, name: str, block_bytes: int, slot: int, gen: int) -> bool:
        """Hand a staging slot back to its client, unless the client already rewrote it."""
        try:
            table = self.get(name, block_bytes)
            if table.gen(slot) != gen:
                return False
            table.set_flags(slot, Flags.FREE)
            return True
        except (SegmentError, IndexError) as e:
            self.log.warning("staging.release_failed", segment=name, slot=slot, error=str(e))
            return False

    def reap(self) -> int:
        """Detach from, and unlink, staging segments whose client process is gone."""
        reaped = 0
        try:
            names = [p.name for p in SHM_DIR.iterdir() if p.name.startswith(self._prefix)]
        except OSError:
            return 0
        for name in names:
            try:
                pid = int(name[len(self._prefix):].split(".")[0])
            except ValueError:
                continue
            if _pid_alive(pid):
                continue
            table = self._open.pop(name, None)
            if table is not None:
                table.seg.close()
            if ShmSegment.unlink_name(name):
                reaped += 1
                self.log.info("staging.reaped", segment=name, pid=pid)
        return reaped

    def close(self) -> None:
        for table in self._open.values():
            table.seg.close()
        self._open.clear()
