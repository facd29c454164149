#!/usr/bin/env bash
# Create the virtual environment and install kvtier with its test extras.
# pyproject.toml states ranges (what kvtier works with); constraints.txt pins the exact versions
# we test with, and every pip install here passes it (`-c`; pip adds it to any constraint file
# its own configuration names).
# torch is installed first, pinned exactly, from the local CPU wheel when the machine has one:
# a looser pin (or uv/poetry) would download a multi-GB CUDA build onto a CPU-only machine.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
torch_version=2.13.0
constraints="$(cd "$(dirname "$0")/.." && pwd)/constraints.txt"

"$(dirname "$0")/ensure-build-tools.sh" "$python"  # the compiled block copy (kvtier/shm/native/)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip -c "$constraints"

if ls /opt/wheels/torch-${torch_version}+cpu-*.whl >/dev/null 2>&1; then
    echo "setup: torch ${torch_version} from the local CPU wheel in /opt/wheels"
    "${pip[@]}" install -q -c "$constraints" --find-links /opt/wheels "torch==${torch_version}"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup: no GPU here; torch ${torch_version} CPU build from the PyTorch CPU index"
    "${pip[@]}" install -q -c "$constraints" --index-url https://download.pytorch.org/whl/cpu "torch==${torch_version}" \
        || "${pip[@]}" install -q -c "$constraints" "torch==${torch_version}"
else
    "${pip[@]}" install -q -c "$constraints" "torch==${torch_version}"
fi

if [ "${KVTIER_INSTALL:-dev}" = node ]; then  # scripts/install-node.sh: a plain install, no test extras
    echo "setup: installing kvtier"
    "${pip[@]}" install -q -c "$constraints" .
else
    echo "setup: installing kvtier and its test dependencies"
    "${pip[@]}" install -q -c "$constraints" -e '.[test]'
fi
"$venv/bin/python" -c 'import torch, kvtier.shm.onepass as o; print(f"setup: ok (torch {torch.__version__}, cuda {torch.cuda.is_available()}, compiled block copy {o.COMPILED})")'
