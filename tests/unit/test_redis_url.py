"""The Redis URLs kvtier accepts (kvtier/redis_url.py): one server, a cluster, Sentinels."""

from __future__ import annotations

import pytest

from kvtier.redis_url import Mode, cluster_url, parse_redis_url, redact_url


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://u:p@host:6380/2?ssl_ca_certs=/ca.pem",
                                 "unix:///run/redis.sock?db=1", "redis://localhost"])
def test_one_server_urls_pass_through_as_given(url):
    t = parse_redis_url(url)
    assert t.mode is Mode.SINGLE and t.node_url == url and t.nodes == ()


def test_a_cluster_url_lists_its_seeds_and_keeps_credentials_tls_and_options():
    t = parse_redis_url("rediss+cluster://user:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002?ssl_ca_certs=%2Fca.pem")
    assert t.mode is Mode.CLUSTER and t.tls
    assert t.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert t.node_url == "rediss://user:pw@10.0.0.1:7000/0?ssl_ca_certs=%2Fca.pem"


def test_a_sentinel_url_names_the_master_and_keeps_the_sentinels_own_password_apart():
    t = parse_redis_url("redis+sentinel://:masterpw@s1:26379,s2/mymaster/3?sentinel_password=spw&socket_keepalive=1")
    assert t.mode is Mode.SENTINEL and t.service == "mymaster" and not t.tls
    assert t.nodes == (("s1", 26379), ("s2", 26379))
    assert t.sentinel_options == (("sentinel_password", "spw"),)
    assert t.node_url == "redis://:masterpw@s1:26379/3?socket_keepalive=1"


@pytest.mark.parametrize("url, why", [
    ("http://x", "expected a URL starting with"),
    ("redis://a:1,b:2", "redis\\+cluster://"),
    ("redis+cluster://", "at least one host"),
    ("redis+cluster://h:1/2", "only database 0"),
    ("redis+cluster://h:99999", "port out of range"),
    ("redis+cluster://h:1?sentinel_password=x", "redis\\+sentinel:// URLs only"),
    ("redis+sentinel://s:1", "names the master"),
    ("redis+sentinel://s:1/m/x", "database must be a number"),
    ("redis+cluster://h:1,bad host", "not a host"),
])
def test_bad_urls_say_what_is_wrong(url, why):
    with pytest.raises(ValueError, match=why):
        parse_redis_url(url)


def test_a_one_server_url_becomes_the_cluster_url_of_the_same_node():
    assert cluster_url("redis://u:p@h:7000") == "redis+cluster://u:p@h:7000"
    assert cluster_url("rediss://h:7000/0?ssl_ca_certs=x") == "rediss+cluster://h:7000?ssl_ca_certs=x"
    assert parse_redis_url(cluster_url("redis://h:7000/")).nodes == (("h", 7000),)
    with pytest.raises(ValueError, match="only database 0"):
        cluster_url("redis://h:7000/4")
    with pytest.raises(ValueError):
        cluster_url("unix:///tmp/s")


def test_passwords_are_redacted_in_every_form():
    assert redact_url("redis+cluster://u:secret@h:1,h:2") == "redis+cluster://u:***@h:1,h:2"
    assert redact_url("redis+sentinel://s:1/m?sentinel_password=secret&x=1") == \
        "redis+sentinel://s:1/m?sentinel_password=***&x=1"
    assert redact_url("redis://h:1/0?password=secret") == "redis://h:1/0?password=***"


def test_an_ipv6_first_seed_keeps_its_brackets_in_the_node_url():
    from redis.asyncio.connection import parse_url

    t = parse_redis_url("redis+cluster://[::1]:7000,10.0.0.2:7001")
    assert t.nodes[0] == ("::1", 7000) and t.node_url == "redis://[::1]:7000/0"
    assert parse_url(t.node_url)["host"] == "::1" and parse_url(t.node_url)["port"] == 7000
    s = parse_redis_url("redis+sentinel://[fe80::1]/kv")
    assert s.node_url == "redis://[fe80::1]:26379/0"
    assert parse_redis_url(cluster_url("redis://[::1]:7000")).node_url == "redis://[::1]:7000/0"
