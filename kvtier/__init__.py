"""kvtier: tiers LLM KV-cache blocks between a GPU pool, a shared-memory CPU arena and Redis."""

__version__ = "0.1.0"
