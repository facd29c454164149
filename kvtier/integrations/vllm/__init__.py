"""vLLM integrations: a v1 KV connector (connector.py) and a TieringOffloadingSpec secondary tier (secondary_tier.py)."""
