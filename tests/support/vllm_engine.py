"""A real vLLM engine in its own process (kvtier.tools.vllm_engine serve), driven request by request."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

ENGINE_START_S = 180.0  # a cold start on 2 busy cores; about 20 s when the machine is idle
REQUEST_S = 60.0


def connector_config(pool: str, runtime_dir: Path, role: str = "kv_both", **extra) -> dict:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool": pool, "runtime_dir": str(runtime_dir), **extra}}


class EngineProcess:
    def __init__(self, model: Path, log_path: Path, kv_transfer_config: dict | None = None,
                 prefix_caching: bool = True, env: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "kvtier.tools.vllm_engine", "serve", "--model", str(model)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **(env or {})})
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._expect("KVTIER-READY", ENGINE_START_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with prefix; fails with the log tail on exit or timeout."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"no {prefix} from the engine within {timeout:.0f} s:\n{self.log_tail()}") from None
            if line is None:
                raise AssertionError(f"engine exited ({self.proc.wait()}) before {prefix}:\n{self.log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def generate(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                           "cache_salt": cache_salt}) + "\n").encode())
        self.proc.stdin.flush()
        return json.loads(self._expect("KVTIER-RESULT", REQUEST_S))

    def log_tail(self, n: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the engine's loop ends and it shuts down cleanly
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
