#!/usr/bin/env bash
# Create .venv-lmcache: vLLM's CPU build with LMCache 0.5.6, the peer `kvtier bench --vllm --peer`
# runs on the same engine, model and prompts (../shared/research/interop.md, section 6). Not part
# of `make test`. LMCache's in-process connector refuses CPU engines; its multi-process mode (a
# per-node server with a shared-memory pool, and LMCacheMPConnector) runs.
#   1. the vLLM venv recipe (scripts/setup-vllm-venv.sh), into .venv-lmcache;
#   2. lmcache and the one exporter its server imports, --no-deps: their pins (numpy, protobuf,
#      opentelemetry, prometheus_client) would move vLLM's; none of them breaks this path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-lmcache}
scripts/setup-vllm-venv.sh "$venv"
echo "setup-lmcache: installing lmcache 0.5.6 (--no-deps)"
"$venv/bin/python" -m pip --disable-pip-version-check install -q --no-deps lmcache==0.5.6 \
    opentelemetry-exporter-prometheus==0.66b2
"$venv/bin/python" -c "import lmcache, vllm; print('setup-lmcache: lmcache', lmcache.__version__ if hasattr(lmcache, '__version__') else '0.5.6', 'on vllm', vllm.__version__)"
