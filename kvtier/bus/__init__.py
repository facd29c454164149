"""Typed events, their msgpack codec, and the Redis Streams transport."""
