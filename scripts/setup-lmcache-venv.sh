#!/usr/bin/env bash
# Create .venv-lmcache: LMCache 0.5.6 for the peer benchmark (benchmarks/peer_lmcache.py) only.
# LMCache's wheel pulls CUDA packages and a newer torch if asked for its dependencies, so it goes
# in with --no-deps beside torch 2.13.0, the CPU build (from /opt/wheels when the machine has it,
# else the PyTorch CPU index). The benchmark needs only its native RESP client
# (lmcache.lmcache_redis), which imports with torch alone. Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-lmcache}
python=${PYTHON:-python3}
torch_version=2.13.0
lmcache_version=0.5.6
constraints="$PWD/constraints.txt"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
source scripts/lib-cpu-torch.sh
install_cpu_torch setup-lmcache
"${pip[@]}" install -q --no-deps "lmcache==${lmcache_version}"
"${pip[@]}" install -q -c "$constraints" numpy  # the benchmark's buffers
"$venv/bin/python" -c 'from lmcache.lmcache_redis import LMCacheRedisClient; print("setup-lmcache: ok")' 2>/dev/null
