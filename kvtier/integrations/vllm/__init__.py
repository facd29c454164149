"""vLLM integrations: a v1 KV connector (connector.py), a TieringOffloadingSpec secondary tier (secondary_tier.py)."""
