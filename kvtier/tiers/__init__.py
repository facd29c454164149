"""Tiers: the gpu pool, the cpu shared-memory arena and Redis; the pure index and placement policy."""
