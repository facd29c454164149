"""What an engine needs of its kvtier pool (`PoolSpec`), checked against the daemon's on every
connection of the engine link (kvtier/integrations/link.py), and the error a pool that does not
fit raises (`PoolMismatch`), in the engine's own terms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.client import SyncClient
from kvtier.client.pools import ClientPool
from kvtier.errors import UnknownPool


class PoolMismatch(ValueError):
    """The daemon's pool cannot hold the engine's blocks (absent, or another size or layout); the
    message says how to configure it."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What an engine needs of its kvtier pool: its name, and (when known) the block's bytes,
    tokens and dtype. The wording of each mismatch is the integration's, in its engine's terms
    (`{name}`, `{have}`: the pool's value, `{want}`: the engine's); `howto()` says how to
    configure a pool that fits."""

    name: str
    block_bytes: int | None = None
    block_tokens: int | None = None
    dtype: str | None = None
    howto: Callable[[], str] = lambda: ""
    tokens_msg: str = "the engine's blocks hold {want} tokens but kvtier pool {name!r} has block_tokens = {have}"
    bytes_msg: str = "the engine's blocks are {want} bytes but kvtier pool {name!r} holds blocks of {have} bytes"
    dtype_msg: str = "the engine's KV dtype is {want} but kvtier pool {name!r} has dtype {have}"

    def check(self, client: SyncClient) -> ClientPool:
        """The pool; PoolMismatch unless it holds the engine's blocks."""
        try:
            p = client.pool(self.name)
        except UnknownPool as e:
            raise PoolMismatch(f"kvtier pool {self.name!r} is not served by the daemon ({e}). {self.howto()}") from e
        problems = [msg.format(name=self.name, have=have, want=want) for msg, have, want in (
            (self.tokens_msg, p.layout.block_tokens, self.block_tokens),
            (self.dtype_msg, p.layout.dtype, self.dtype),
            (self.bytes_msg, p.block_bytes, self.block_bytes)) if want is not None and have != want]
        if problems:
            raise PoolMismatch(f"kvtier pool {self.name!r} does not fit: {'; '.join(problems)}; they must be "
                               f"equal. {self.howto()}")
        return p
