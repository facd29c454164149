#!/usr/bin/env bash
# Create .venv-sglang: SGLang's own HiCache classes beside kvtier, for tests/sglang (`make test-sglang`).
# Its own venv: `pip install sglang==0.5.23` would pull torch 2.14.1 and CUDA-only packages
# (cuda-python, flashinfer, sglang-kernel, ...). So, with constraints.txt on every pip install:
#   1. torch 2.13.0, the CPU build (from /opt/wheels when the machine has it, otherwise the
#      PyTorch CPU index), as for .venv-vllm;
#   2. sglang --no-deps;
#   3. only what `import sglang.srt.mem_cache.hicache_storage` and
#      `sglang.srt.mem_cache.storage.backend_factory` import at module level (sglang/__init__
#      pulls sglang.srt.utils, which imports triton, PIL, zmq, IPython, ... unconditionally);
#   4. kvtier with its test extras, editable; torch must stay as it was (checked).
# Not installable here: SGLang's host memory pools (sglang.srt.mem_cache.pool_host) import the
# model configs, which import torchvision, and no torchvision build runs on torch 2.13.0+cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}
python=${PYTHON:-python3}
torch_version=2.13.0
sglang_version=0.5.23
constraints="$PWD/constraints.txt"
t0=$SECONDS
source scripts/lib-cpu-torch.sh
took() { echo "setup-sglang: $1 done ($((SECONDS - t0)) s so far)"; }

"$(dirname "$0")/ensure-build-tools.sh" "$python"  # kvtier's compiled block copy (kvtier/shm/native/)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip -c "$constraints"
install_cpu_torch setup-sglang
took "torch $torch_before"

echo "setup-sglang: installing sglang ${sglang_version} without its dependencies"
"${pip[@]}" install -q --no-deps "sglang==${sglang_version}"
echo "setup-sglang: installing what its storage modules import"
"${pip[@]}" install -q -c "$constraints" orjson psutil pybase64 requests triton packaging pillow starlette \
    msgspec pydantic pyzmq tqdm ipython aiohttp
took "sglang"

echo "setup-sglang: installing kvtier and its test dependencies"
"${pip[@]}" install -q -c "$constraints" -e '.[test]'
took "kvtier"

check_torch_unchanged setup-sglang "sglang's imports or kvtier"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
import kvtier.client  # noqa: F401
print(f"setup-sglang: ok (sglang {version('sglang')}, torch {torch.__version__})")
PY
