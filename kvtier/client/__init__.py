"""What inference workers import: keys, lookup, get, put, prefetch."""

from kvtier.client.client import Client
from kvtier.client.results import Lookup, PutResult
from kvtier.client.sync import SyncClient

__all__ = ["Client", "Lookup", "PutResult", "SyncClient"]
