"""Whether loading a prefix beats recomputing it, and how long a load may take (pure).

An engine integration asks before it promises blocks to the engine:
- a load's time is its bytes over the bandwidth measured for the tier that holds them (this
  node's shared memory, Redis), each a moving average of real loads;
- a recompute's time is its tokens over the prefill throughput the engine showed.
Blocks are loaded only where they pay (a tier whose blocks cost more than `margin` times their
recompute is left out, and with it every block after it), and every load gets a deadline: what
recomputing its blocks would take (a load slower than that has lost), or `slack` times its own
estimate if longer, at least `floor_s`, at most `ceiling_s` (the deadline until the engine's
prefill is measured). Before a figure is measured its side is unknown, and loads are assumed to
pay. The deadline runs from when the load starts: loads queued behind others are not cut short
for the wait (measured: a burst of twelve missed theirs, and each recomputed its prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class MovingRate:
    """An exponentially weighted average of observed rates; None until the first one."""

    weight: float = 0.3
    value: float | None = None

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else self.value + self.weight * (rate - self.value)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    local: int  # leading blocks to load from this node's shared memory
    remote: int  # blocks after those to read through from Redis
    deadline_s: float  # the load is given up (and recomputed) past this
    not_worth: int  # blocks held somewhere that were left out because recomputing is cheaper


@dataclass(slots=True)
class LoadCosts:
    block_bytes: int
    block_tokens: int
    ceiling_s: float = 5.0  # no load waits longer than this, measured or not
    floor_s: float = 0.05  # nor shorter (a loaded machine's scheduling noise)
    slack: float = 3.0  # the deadline over the estimate
    margin: float = 0.8  # a tier's blocks must load in under this share of their recompute time
    shm: MovingRate = field(default_factory=MovingRate)  # bytes/s from this node's shared memory
    redis: MovingRate = field(default_factory=MovingRate)  # bytes/s read through from Redis
    prefill: MovingRate = field(default_factory=MovingRate)  # tokens/s the engine computes

    def observe_load(self, local_blocks: int, remote_blocks: int, seconds: float) -> None:
        """One load (or a sum of them): the Redis share of its time is what the shared-memory
        blocks would not have taken at the measured shm rate (at least a tenth of it)."""
        if seconds <= 0 or local_blocks + remote_blocks <= 0:
            return
        if remote_blocks == 0:
            self.shm.observe(local_blocks * self.block_bytes, seconds)
            return
        local_s = 0.0 if self.shm.value is None else local_blocks * self.block_bytes / self.shm.value
        self.redis.observe(remote_blocks * self.block_bytes, max(seconds - local_s, seconds / 10))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def _block_s(self, rate: MovingRate) -> float | None:
        return None if rate.value is None else self.block_bytes / rate.value

    def recompute_s(self, blocks: int) -> float | None:
        v = self.prefill.value
        return None if v is None else blocks * self.block_tokens / v

    def plan(self, local: int, remote: int) -> LoadPlan:
        """What to load of `local` blocks in shared memory followed by `remote` more in Redis."""
        per_block = self.recompute_s(1)
        shm_s, redis_s = self._block_s(self.shm), self._block_s(self.redis)

        def pays(cost: float | None) -> bool:
            return per_block is None or cost is None or cost < self.margin * per_block

        keep_local = local if pays(shm_s) else 0
        keep_remote = remote if keep_local == local and pays(redis_s) else 0
        estimate = keep_local * (shm_s or 0.0) + keep_remote * (redis_s or 0.0)
        recompute = self.recompute_s(keep_local + keep_remote)
        # Given up only once it has taken as long as recomputing would (by then it has lost),
        # or `slack` times its own estimate if that is longer (a margin for a busy machine).
        deadline = self.ceiling_s if recompute is None else max(self.floor_s, self.slack * estimate, recompute)
        return LoadPlan(keep_local, keep_remote, min(deadline, self.ceiling_s),
                        local + remote - keep_local - keep_remote)
