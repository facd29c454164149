"""What inference workers import: keys, lookup, get, put, prefetch; and for engine integrations,
the checksum their own copies are verified with and the manifest entry they register."""

from kvtier.client.client import Client
from kvtier.client.results import ClientStats, DropReason, Lookup, PutResult, ReadCounts
from kvtier.client.sync import SyncClient
from kvtier.core.manifest import ManifestEntry, ModelHoldings
from kvtier.errors import NamespaceConflict
from kvtier.shm.onepass import checksum_stream, copy_streamed
from kvtier.shm.slots import checksum, checksum_parts

__all__ = ["Client", "ClientStats", "DropReason", "Lookup", "ManifestEntry", "ModelHoldings", "NamespaceConflict",
           "PutResult", "ReadCounts", "SyncClient", "checksum", "checksum_parts",
           "checksum_stream", "copy_streamed"]
