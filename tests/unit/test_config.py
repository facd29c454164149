"""The config loader: defaults, file, env overrides, and reporting every problem at once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier.config import (
    DEMO_POOL,
    Config,
    ConfigError,
    config_to_dict,
    format_config,
    load_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "kvtier.toml"

POOL = """
[pools.llama]
model = "m"
layers = 2
kv_heads = 2
head_dim = 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def problems_of(path: Path | None, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ or {})
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def test_defaults_load_with_demo_pool() -> None:
    cfg = load_config(None, {})
    assert cfg.pools == (DEMO_POOL,)
    assert cfg.pools[0].block_shape == (4, 2, 2, 16, 64)
    assert cfg.log.level == "info" and cfg.log.format == "auto"
    assert cfg.redis.url == "" and cfg.redis.block_ttl_s == 86400
    assert cfg.embedded_redis.maxmemory_policy == "volatile-lru"
    assert cfg.bus.block_ms == 500 and cfg.daemon.persist_arena is True
    assert (cfg.policy.low_watermark, cfg.policy.high_watermark) == (0.75, 0.9)
    assert cfg.node.runtime_dir.is_absolute()


def test_default_runtime_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    cfg = load_config(None, {"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert cfg.node.runtime_dir == Path("/run/user/1000/kvtier")
    assert load_config(None, {}).node.runtime_dir == Path("/tmp/kvtier-1000")
    monkeypatch.setattr("os.geteuid", lambda: 0)
    assert load_config(None, {}).node.runtime_dir == Path("/run/kvtier")


def test_default_node_id_is_a_sanitized_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "gpu node#7." + "x" * 80)
    node_id = load_config(None, {}).node.id
    assert node_id.startswith("gpu-node-7.") and len(node_id) == 64


def test_example_file_loads() -> None:
    cfg = load_config(EXAMPLE, {})
    (pool,) = cfg.pools
    assert pool.name == "llama3-8b" and pool.model.startswith("meta-llama/Meta-Llama-3-8B@")  # weights + revision
    assert pool.block_shape == (32, 2, 8, 16, 128)
    assert (pool.dtype, pool.gpu_blocks, pool.cpu_blocks) == ("bfloat16", 64, 512)
    assert cfg.node.id == "node-a"


def test_file_pools_replace_the_demo_pool(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, POOL), {})
    assert [p.name for p in cfg.pools] == ["llama"]
    assert cfg.pools[0].block_tokens == 16 and cfg.pools[0].device == "auto"


def test_env_overrides_int_bool_str_and_pool_key(tmp_path: Path) -> None:
    env = {
        "KVTIER__BUS__READ_COUNT": "64",
        "KVTIER__DAEMON__PERSIST_ARENA": "false",
        "kvtier__log__level": "debug",  # names are case-insensitive
        "KVTIER__NODE__ID": "0042",  # a string key keeps digits as text
        "KVTIER__REDIS__URL": '"redis://10.0.0.1:6379/0"',
        "KVTIER__DAEMON__SHUTDOWN_GRACE_S": "3",  # float keys accept ints
        "KVTIER__POOLS__LLAMA__CPU_BLOCKS": "1024",
        "KVTIER_UNRELATED": "ignored",
    }
    cfg = load_config(write(tmp_path, POOL), env)
    assert cfg.bus.read_count == 64
    assert cfg.daemon.persist_arena is False
    assert cfg.log.level == "debug"
    assert cfg.node.id == "0042"
    assert cfg.redis.url == "redis://10.0.0.1:6379/0"
    assert cfg.daemon.shutdown_grace_s == 3.0 and isinstance(cfg.daemon.shutdown_grace_s, float)
    assert cfg.pools[0].cpu_blocks == 1024


def test_env_can_define_a_whole_pool() -> None:
    env = {f"KVTIER__POOLS__QWEN__{k}": v for k, v in
           {"MODEL": "Qwen/Qwen2-7B", "LAYERS": "28", "KV_HEADS": "4", "HEAD_DIM": "128"}.items()}
    (pool,) = load_config(None, env).pools
    assert pool.name == "qwen" and pool.layers == 28
    del env["KVTIER__POOLS__QWEN__MODEL"]
    assert problems_of(None, env) == [
        "pools.qwen.model: required key is missing (set by KVTIER__POOLS__QWEN__HEAD_DIM)"]


def test_env_errors_name_the_variable(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL), {
        "KVTIER__DAEMON__SHUTDOWN_GRACE": "3",
        "KVTIER__DAEMN__X": "1",
        "KVTIER__BUS__READ_COUNT": "many",
        "KVTIER__POOLS__LLAMA": "1",
    })
    assert any(p.startswith("daemon.shutdown_grace: unknown key (did you mean 'shutdown_grace_s'?)")
               and "KVTIER__DAEMON__SHUTDOWN_GRACE" in p for p in problems)
    assert any(p.startswith("[daemn]: unknown section (did you mean 'daemon'?)")
               and "KVTIER__DAEMN__X" in p for p in problems)
    assert any(p.startswith("bus.read_count: expected an integer in 1..10000, got 'many'")
               and "KVTIER__BUS__READ_COUNT" in p for p in problems)
    assert any(p.startswith("KVTIER__POOLS__LLAMA: expected") for p in problems)
    assert len(problems) == 4


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL + """
cpu_blocks = "x"
[daemon]
shutdown_grace = 3.0
[daemn]
stats_interval_s = 2.0
"""))
    assert problems == [
        "[daemn]: unknown section (did you mean 'daemon'?)",
        "daemon.shutdown_grace: unknown key (did you mean 'shutdown_grace_s'?)",
        "pools.llama.cpu_blocks: expected an integer >= 1, got 'x'",
    ]


def test_types_are_strict(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL + """
[redis]
retries = true
socket_timeout_s = "5"
[daemon]
persist_arena = 1
[log]
level = "verbose"
"""))
    assert len(problems) == 4
    assert "redis.retries: expected an integer >= 0, got True" in problems
    assert "redis.socket_timeout_s: expected a number > 0, got '5'" in problems
    assert "daemon.persist_arena: expected true or false, got 1" in problems
    assert problems[0].startswith("log.level: expected one of 'debug', 'info'")


def test_allkeys_policy_is_rejected_with_reason(tmp_path: Path) -> None:
    (problem,) = problems_of(write(tmp_path, POOL + """
[embedded_redis]
maxmemory_policy = "allkeys-lru"
"""))
    assert problem.startswith("embedded_redis.maxmemory_policy: 'allkeys-lru' is not allowed")
    assert "streams" in problem and "consumer groups" in problem


def test_watermarks_cross_check(tmp_path: Path) -> None:
    (problem,) = problems_of(write(tmp_path, POOL + """
[policy]
high_watermark = 0.6
low_watermark = 0.8
"""))
    assert problem.startswith("policy.low_watermark: must be less than policy.high_watermark")
    # An individually invalid key skips the cross-check instead of piling on.
    (problem,) = problems_of(write(tmp_path, POOL + "[policy]\nhigh_watermark = 1.5\n"))
    assert problem == "policy.high_watermark: expected a number in (0, 1], got 1.5"


def test_block_ms_must_stay_below_socket_timeout(tmp_path: Path) -> None:
    (problem,) = problems_of(write(tmp_path, POOL), {"KVTIER__REDIS__SOCKET_TIMEOUT_S": "0.5"})
    assert problem.startswith("bus.block_ms: must be less than redis.socket_timeout_s * 1000")
    assert "KVTIER__REDIS__SOCKET_TIMEOUT_S" in problem


def test_invalid_pool_name(tmp_path: Path) -> None:
    (problem,) = problems_of(write(tmp_path, POOL.replace("llama", '"bad name"')))
    assert problem.startswith("pools.bad name: invalid pool name")


def test_missing_required_pool_fields(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL.replace("layers = 2\n", "").replace(
        'model = "m"\n', "")))
    assert problems == ["pools.llama.model: required key is missing",
                        "pools.llama.layers: required key is missing"]


def test_pool_values_are_checked(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL + 'dtype = "int4"\ndevice = "tpu"\n'))
    assert problems[0].startswith("pools.llama.dtype: expected one of 'float16'")
    assert problems[1].startswith("pools.llama.device: expected a string of 'auto', 'cpu'")


def test_empty_pools_table_is_an_error(tmp_path: Path) -> None:
    (problem,) = problems_of(write(tmp_path, "[pools]\n"))
    assert problem.startswith("pools: expected one or more [pools.<name>] tables")


def test_toml_syntax_error_has_position(tmp_path: Path) -> None:
    path = write(tmp_path, "[log]\nlevel = \n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}: invalid TOML:")
    assert "line 2" in problem and "column" in problem


def test_missing_file(tmp_path: Path) -> None:
    (problem,) = problems_of(tmp_path / "nope.toml")
    assert "cannot read config file" in problem


def test_config_is_frozen() -> None:
    cfg = load_config(None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bus.block_ms = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pools = ()  # type: ignore[misc]


def test_dict_and_text_round_trip(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE, {"KVTIER__NODE__RUNTIME_DIR": "/run/kvtier"})
    data = config_to_dict(cfg)
    assert json.loads(json.dumps(data)) == data
    assert data["node"]["runtime_dir"] == "/run/kvtier"
    assert data["pools"]["llama3-8b"]["layers"] == 32
    again = load_config(write(tmp_path, format_config(cfg)), {})
    assert again == cfg and isinstance(again, Config)


def test_format_config_quotes_dotted_pool_names(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, POOL.replace("llama", '"llama3.1"')), {})
    text = format_config(cfg)
    assert '[pools."llama3.1"]' in text
    assert load_config(write(tmp_path, text), {}) == cfg


def test_capacity_in_bytes(tmp_path: Path) -> None:
    # 2 layers * 2 (k, v) * 2 heads * 16 tokens * 8 dims * 2 bytes = 2 KiB blocks
    cfg = load_config(write(tmp_path, POOL + 'gpu_bytes = "10KiB"\ncpu_bytes = 1_000_000\n'), {})
    (pool,) = cfg.pools
    assert (pool.gpu_blocks, pool.cpu_blocks) == (5, 488)  # whole blocks only: 1e6 // 2048
    env = {"KVTIER__POOLS__LLAMA__CPU_BYTES": "1.5MiB"}
    assert load_config(write(tmp_path, POOL), env).pools[0].cpu_blocks == 768
    assert load_config(write(tmp_path, format_config(cfg)), {}) == cfg, "a formatted config reloads"


def test_capacity_in_bytes_is_checked(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, POOL + 'gpu_bytes = "1KiB"\ncpu_bytes = "4 GiB"\ncpu_blocks = 3\n'))
    assert problems == [
        "pools.llama.gpu_bytes: 1024 bytes hold no whole block of this layout (2048 bytes)",
        "pools.llama.cpu_bytes: 4294967296 bytes are 2097152 blocks of 2048 bytes, but cpu_blocks is 3; "
        "set one of them",
    ]
    (problem,) = problems_of(write(tmp_path, POOL + 'cpu_bytes = "lots"\n'))
    assert problem.startswith("pools.llama.cpu_bytes: expected a size in bytes")
    (problem,) = problems_of(write(tmp_path, POOL + "cpu_bytes = -1\n"))
    assert problem.startswith("pools.llama.cpu_bytes: expected a size in bytes")


def test_printed_config_hides_redis_passwords(tmp_path: Path) -> None:
    from kvtier.config import redact_url

    assert redact_url("redis://kv:s3cr%40t@host:6379/0") == "redis://kv:***@host:6379/0"
    assert redact_url("rediss://:pw@host:6380") == "rediss://:***@host:6380"
    assert redact_url("unix://kv@/run/redis.sock?db=1&password=pw") == "unix://kv@/run/redis.sock?db=1&password=***"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    cfg = load_config(write(tmp_path, POOL + '[redis]\nurl = "redis://kv:s3cret@127.0.0.1:6379/0"\n'), {})
    assert "s3cret" not in format_config(cfg, redact=True) and "s3cret" in format_config(cfg)


def test_redis_urls_are_checked_by_the_parser_and_shown_redacted(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, POOL), {"KVTIER__REDIS__URL": "redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
                                              "KVTIER__REDIS__BUS_URL": "redis+sentinel://s1,s2/kv"})
    assert cfg.redis.url.startswith("redis+cluster://") and cfg.redis.bus_url.endswith("/kv")
    problems = problems_of(write(tmp_path, POOL), {"KVTIER__REDIS__URL": "redis+cluster://:hunter2@h:1/5"})
    assert problems == ["redis.url: a Redis Cluster has only database 0; got 'redis+cluster://:***@h:1/5'"
                        " (set by KVTIER__REDIS__URL)"]


def test_example_config_documents_every_key() -> None:
    """config/kvtier.toml is the reference: every key the schema has appears there, set or as a
    commented-out example, so a new knob cannot ship undocumented."""
    text = EXAMPLE.read_text()
    data = config_to_dict(load_config(EXAMPLE, {}))
    missing = []
    for section, values in data.items():
        if section == "pools":
            values = next(iter(values.values()))
        if not isinstance(values, dict):
            continue
        missing += [f"{section}.{k}" for k in values
                    if not any(line.lstrip("# ").startswith(f"{k} =") for line in text.splitlines())]
    assert missing == []


def test_the_policy_knobs_are_the_policy_section_by_name() -> None:
    """The core's knobs (kvtier/core/knobs.py) are built from `[policy]` key by key: the same
    names, the config's defaults, and the policy's choices as enums."""
    from kvtier.config import PolicyConfig
    from kvtier.config.fields import checked_fields
    from kvtier.core.events import Tier
    from kvtier.core.knobs import PolicyKnobs, RedisWrite
    from kvtier.daemon.pools import policy_knobs

    assert [f.name for f in dataclasses.fields(PolicyKnobs)] == list(checked_fields(PolicyConfig))
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(PolicyKnobs)), \
        "a default of the core's own would shadow the config's"
    default = policy_knobs(PolicyConfig())
    assert dataclasses.asdict(default) == {**dataclasses.asdict(PolicyConfig()), "redis_write": RedisWrite.WRITE_BACK,
                                           "prefetch_to": Tier.CPU}
    cfg = load_config(None, {"KVTIER__POLICY__REDIS_WRITE": "write-through", "KVTIER__POLICY__PREFETCH_TO": "gpu",
                             "KVTIER__POLICY__HIGH_WATERMARK": "0.95"})
    knobs = policy_knobs(cfg.policy)
    assert (knobs.redis_write, knobs.prefetch_to, knobs.high_watermark) == (RedisWrite.WRITE_THROUGH, Tier.GPU, 0.95)
