"""The kvtier configuration: one frozen dataclass tree, loaded once.

Sources, later wins: built-in defaults, a TOML file, then environment variables
`KVTIER__<SECTION>__<KEY>` and `KVTIER__POOLS__<NAME>__<KEY>`. Everything wrong with the
result is collected and raised together as one `ConfigError`, so an operator fixes a config in
one pass. `loader` is the only module that reads the environment, and only through the mapping
handed to `load_config`.

Modules: `fields` (value checks), `schema` (the dataclass tree), `loader` (file + environment ->
Config), `render` (Config -> dict or TOML). Import from here.
"""

from kvtier.config.loader import load_config
from kvtier.config.render import config_to_dict, format_config, redact_url
from kvtier.config.schema import (
    DEMO_POOL,
    ENV_PREFIX,
    ArenaConfig,
    BusConfig,
    Config,
    ConfigError,
    DaemonConfig,
    DiskConfig,
    EmbeddedRedisConfig,
    EventsConfig,
    IngestConfig,
    LogConfig,
    MetricsConfig,
    NodeConfig,
    PinsConfig,
    PolicyConfig,
    PoolConfig,
    PrefixIndexConfig,
    RedisConfig,
    TenantsConfig,
)

__all__ = [
    "DEMO_POOL", "ENV_PREFIX", "ArenaConfig", "BusConfig", "Config", "ConfigError", "DaemonConfig",
    "DiskConfig", "EmbeddedRedisConfig",
    "EventsConfig", "IngestConfig", "LogConfig", "MetricsConfig", "NodeConfig", "PinsConfig", "PolicyConfig",
    "PoolConfig",
    "PrefixIndexConfig", "RedisConfig", "TenantsConfig",
    "config_to_dict", "format_config", "load_config", "redact_url",
]
