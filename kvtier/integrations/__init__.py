"""Adapters that plug kvtier into inference engines. Engine imports stay inside each subpackage."""
