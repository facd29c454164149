"""TLS to Redis from config: a `rediss://` URL with the CA to trust in its query string.

A throwaway CA and server certificate (openssl, EC P-256) and a TLS-only redis-server on a free
loopback port. The daemon and its clients work through it; a URL that does not name the CA is
refused at start with a certificate error, not silently sent in clear.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import redis

from kvtier.tools.daemon_process import DaemonProcess
from kvtier.tools.redis_cluster import free_port
from tests.support.daemon_proc import write_config
from tests.support.waiting import wait_until
from tests.support.workload import put_get_roundtrip

pytestmark = pytest.mark.integration


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _certs(d: Path) -> None:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=kvtier test CA",
             "-days", "1", cwd=d)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "1", "-extfile", "san.ext", cwd=d)


@pytest.fixture
def tls_redis(tmp_path):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed for the TLS test (apt-get install openssl)")
    d = tmp_path / "tls"
    d.mkdir()
    _certs(d)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--bind", "127.0.0.1", "--tls-port", str(port),
         "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
         "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(d)],
        stdout=open(d / "redis.log", "wb"), stderr=subprocess.STDOUT)

    def up() -> bool:
        assert proc.poll() is None, (d / "redis.log").read_text()
        c = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(d / "ca.crt"), socket_timeout=1)
        try:
            return bool(c.ping())
        except redis.RedisError:
            return False
        finally:
            c.close()

    try:
        wait_until(up, timeout=10, message="TLS redis-server answers")
        yield port, d / "ca.crt"
    finally:
        proc.kill()
        proc.wait()


def test_daemon_and_clients_over_tls(tmp_path, tls_redis) -> None:
    port, ca = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    cfg = write_config(tmp_path, node=f"tls-{uuid.uuid4().hex[:8]}", redis_url=url)
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start()
    try:
        asyncio.run(put_get_roundtrip(d.runtime_dir))
    finally:
        assert d.stop() == 0

    untrusted = write_config(tmp_path, node=f"tls-bad-{uuid.uuid4().hex[:8]}", redis_url=f"rediss://127.0.0.1:{port}/0")
    b = DaemonProcess(untrusted, untrusted.parent / f"rt-{untrusted.stem}").start(wait_ready=False)
    wait_until(lambda: b.proc.poll() is not None, timeout=30, message="the daemon refuses the server")
    assert b.proc.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in b.log_tail(), b.log_tail()
    b.kill()
