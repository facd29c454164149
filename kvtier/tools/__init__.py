"""Tools behind the kvtier CLI and the engine tests; inference workers never import these."""
