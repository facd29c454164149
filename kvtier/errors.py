"""The one exception hierarchy. Expected outcomes (a miss, no room) are return values, not these."""


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class UnknownPool(KvtierError, KeyError):
    """A request named a pool that the daemon does not serve."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown pool"


class BadRequest(KvtierError, ValueError):
    """A caller passed something malformed: a key of the wrong length, a tensor of the wrong shape."""


class MalformedEvent(KvtierError, ValueError):
    """A stream entry failed validation; `reason` goes to the dead-letter stream."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CorruptBlock(KvtierError):
    """Bytes read from Redis or shared memory failed verification."""


class DiskFault(KvtierError, OSError):
    """A disk tier I/O failed (ENOSPC, EIO, EROFS, ...): the tier turns itself off."""

    def __init__(self, err: int, op: str, message: str) -> None:
        super().__init__(err, message)
        self.op = op

    def __str__(self) -> str:
        return str(self.strerror)


class SegmentError(KvtierError, OSError):
    """A shared-memory segment could not be created, attached or trusted."""


class DaemonUnavailable(KvtierError, ConnectionError):
    """No running daemon could be found, or it stopped answering."""


class RedisUnavailable(KvtierError, ConnectionError):
    """Redis could not be reached or refused a call the client had to make (a prefetch, `where`,
    an epoch): the redis-py error is its cause. Reads and lookups never raise it: a miss instead."""


class CallTimeout(KvtierError, TimeoutError):
    """A SyncClient call ran past its `timeout` and was cancelled: it has unwound, so nothing it
    started writes into the caller's memory afterwards."""


class NamespaceConflict(KvtierError, ValueError):
    """A key namespace is registered in the manifest for other page bytes (core/manifest.py):
    this engine's blocks cannot be the ones stored under it, so it must not use it."""
