"""The disk tier's on-disk formats and I/O (no asyncio, no Redis)."""
