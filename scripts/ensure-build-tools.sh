#!/usr/bin/env bash
# kvtier's install compiles one C extension, the block copy (kvtier/shm/native/copy_hash.c): it
# needs a C compiler and the headers of the Python the venv is made from. Install them when we can
# (root on Debian/Ubuntu); otherwise say exactly how. Without them kvtier still installs, and copies
# blocks with numpy, slower (`kvtier bench` and the set-up say which copy runs).
set -euo pipefail
python=${1:-python3}
has_headers() {
    "$python" - <<'PY'
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
}
if command -v cc >/dev/null 2>&1 && has_headers; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: a C compiler or Python's headers are missing; installing gcc and python3-dev with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev python3-dev
    command -v cc >/dev/null 2>&1 && has_headers && exit 0
fi
cat >&2 <<'MSG'
setup: WARNING: no C compiler or no Python headers for this Python, so kvtier's block copy will not
be compiled and blocks are copied with numpy (slower; the test of the build fails). To build it:
    sudo apt-get update && sudo apt-get install -y gcc python3-dev      # Debian / Ubuntu
(for a Python not from the distribution, its own headers), then run make again.
MSG
exit 0
