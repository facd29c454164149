"""The compatibility manifest against a real daemon and Redis: an engine's link enters its
namespace, `kvtier status` lists which models the pool holds with what they stored, and a
namespace registered for other page bytes keeps the newcomer's link down (never read)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import structlog

from kvtier.client import ManifestEntry
from kvtier.core.manifest import manifest_key
from kvtier.integrations.counters import Counters
from kvtier.integrations.link import LINK_COUNTERS, EngineLink
from kvtier.integrations.pool_spec import PoolSpec
from kvtier.runtime import STATS, read_json
from kvtier.status import render_status
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

BLOCK_BYTES = 8192  # the test pool's
NS = "0123456789abcdef0123456789abcdef"


def entry(model: str = "llama", page_bytes: int = BLOCK_BYTES) -> ManifestEntry:
    return ManifestEntry(namespace=NS, engine="test-engine", engine_version="1.0", model=model,
                         weights={"weights": "content:0badc0ffee", "revision": "abc123"},
                         page={"page_bytes": page_bytes}, extra={})


def link_for(runtime_dir) -> EngineLink:
    return EngineLink(runtime_dir=str(runtime_dir), spec=PoolSpec("t", block_bytes=BLOCK_BYTES),
                      counters=Counters(LINK_COUNTERS), log=structlog.get_logger("test"), retry_s=0.2, watch_s=0.1,
                      mismatch_retry_s=0.2, stored_flush_s=0.1, call_timeout_s=2.0)


def models(runtime_dir) -> dict | None:
    """The pool's models in stats.json (None until the daemon has written it once)."""
    try:
        return read_json(runtime_dir / STATS)["pools"]["t"].get("models")
    except FileNotFoundError:
        return None


def test_status_lists_the_models_and_a_conflicting_namespace_is_refused(daemon_factory, redis_server):
    d = daemon_factory()
    first = link_for(d.runtime_dir)
    first.register(entry())
    first.start(first=True)
    try:
        c = first.client()
        assert c is not None
        keys = [bytes([i]) * 32 for i in range(1, 4)]
        staged = first.put_with(c, keys, lambda i, dst: np.copyto(dst, np.full(dst.shape, i, np.uint8)),
                                parent=None, wait_s=2.0)
        assert staged == 3
        got = wait_until(lambda: (m := models(d.runtime_dir)) and m["models"] and m["models"][0]["stored_blocks"] == 3
                         and m, timeout=10, message="the manifest in stats.json with the stored counts")
        (m,) = got["models"]
        assert (m["model"], m["namespace"], m["stored_bytes"]) == ("llama", NS, 3 * BLOCK_BYTES)
        text = render_status(read_json(d.runtime_dir / STATS))
        assert "models: 1 key namespaces" in text and "llama  test-engine 1.0  weights content:0badc0ffee" in text
        assert "rev abc123" in text and "stored 3 blocks, 24 KiB" in text

        # Another served name, the same namespace and page: it shares (the readable fields may differ).
        same = link_for(d.runtime_dir)
        same.register(entry(model="llama-copy"))
        same.start(first=True)
        assert same.client() is not None
        same.close()

        # The same namespace with other page bytes: refused once, with both sides in the error.
        with structlog.testing.capture_logs() as logs:
            other = link_for(d.runtime_dir)
            other.register(entry(page_bytes=2 * BLOCK_BYTES))
            other.start(first=True)
            try:
                assert other.client() is None and "page_bytes: 8192 registered, 16384 here" in other.mismatch
                assert other.guard("lookup", "miss", lambda c: "hit") == "miss"
                wait_until(lambda: other.counters.snapshot()["namespace_conflicts"] == 1, timeout=5)
                lines = [x for x in logs if x["event"].endswith("namespace_conflict")]
                assert len(lines) == 1 and "test-engine 1.0 serving 'llama'" in lines[0]["error"]
            finally:
                other.close()

        # A malformed entry in Redis: dropped from status and counted, never trusted.
        r = redis_server.client()
        try:
            r.hset(manifest_key("t"), "f" * 32, json.dumps({"namespace": "f" * 32, "page": 5}))
        finally:
            r.close()
        wait_until(lambda: (models(d.runtime_dir) or {}).get("malformed") == 1, timeout=10,
                   message="the malformed entry counted")
    finally:
        first.close()


def test_a_registration_redis_could_not_take_is_made_when_it_is_back(daemon_factory, redis_server):
    """Redis down at the engine's start: its local blocks stay usable (the link is up, the failure
    counted), and its entry reaches the manifest once Redis answers again."""
    d = daemon_factory()
    link = link_for(d.runtime_dir)
    link.start(first=True)
    try:
        assert link.client() is not None
        redis_server.stop()
        link.register(entry(model="late"))
        assert link.client() is not None and link.counters.snapshot()["manifest_errors"] >= 1
        redis_server.start()
        wait_until(lambda: any(m["model"] == "late" for m in (models(d.runtime_dir) or {}).get("models", [])),
                   timeout=30, message="the entry registered once Redis is back")
        assert link.client() is not None and link.counters.snapshot()["namespace_conflicts"] == 0
    finally:
        link.close()
        if not redis_server.running:
            redis_server.start()
