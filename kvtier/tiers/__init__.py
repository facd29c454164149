"""The tier workers: they move blocks between the gpu pool, the cpu shared-memory arena and Redis."""
