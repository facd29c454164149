# Sourced by the engine venvs' set-up scripts (setup-vllm-venv.sh, setup-sglang-venv.sh,
# setup-lmcache-venv.sh), which set `venv`, `pip` (an array), `constraints` and `torch_version`.

# torch ${torch_version}, the CPU build, first: from /opt/wheels when the machine has it, otherwise
# from the PyTorch CPU index; never PyPI's torch (a CUDA build, and not the +cpu one the engines'
# CPU installs require). Sets torch_before.
install_cpu_torch() {
    local tag=$1
    if ls /opt/wheels/torch-${torch_version}+cpu-*.whl >/dev/null 2>&1; then
        echo "$tag: torch ${torch_version} from the local CPU wheel in /opt/wheels"
        "${pip[@]}" install -q -c "$constraints" --find-links /opt/wheels "torch==${torch_version}"
    else
        echo "$tag: torch ${torch_version} CPU build from the PyTorch CPU index"
        "${pip[@]}" install -q -c "$constraints" --index-url https://download.pytorch.org/whl/cpu "torch==${torch_version}"
    fi
    torch_before=$(torch_installed)
    case "$torch_before" in
        *+cpu) ;;
        *) echo "$tag: expected a +cpu torch, got $torch_before" >&2; exit 1 ;;
    esac
}

torch_installed() {
    "$venv/bin/python" -c 'from importlib.metadata import version; print(version("torch"))'
}

# Fails the set-up if what was installed since install_cpu_torch moved torch.
check_torch_unchanged() {
    local tag=$1 what=$2 torch_after
    torch_after=$(torch_installed)
    if [ "$torch_after" != "$torch_before" ]; then
        echo "$tag: installing $what changed torch: $torch_before -> $torch_after" >&2
        exit 1
    fi
}
