"""The throwaway Redis Cluster's nodes (kvtier/tools/redis_cluster.py) on free ports: a port that
another process takes between `free_port` finding it free and redis-server binding it (the tests
start many servers side by side) costs a retry on new ports at a node's first start, never the
test; a node started again keeps its ports, which the other nodes know, and says so when it
cannot have them."""

from __future__ import annotations

import socket
from contextlib import closing

import pytest

from kvtier.tools.redis_cluster import ClusterNode, PortTaken, free_port


def squat(port: int) -> socket.socket:
    """Hold `port` as an outgoing connection's socket holds its own: bound, not listening."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    return s


def test_a_port_taken_before_the_first_start_is_traded_for_a_free_one(tmp_path):
    node = ClusterNode(tmp_path / "n")
    taken = node.port
    with closing(squat(taken)):
        try:
            node.start()
            assert node.running and node.port != taken
            with node.client() as c:
                assert c.ping()
            assert "Address already in use" in (tmp_path / "n" / "redis.log").read_text()
            node.stop()
            with closing(squat(node.port)):  # started again, it wants its own port back
                with pytest.raises(PortTaken):
                    node.start()
            assert not node.running
        finally:
            node.stop()


def test_free_ports_are_below_the_range_outgoing_connections_take_theirs_from():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
