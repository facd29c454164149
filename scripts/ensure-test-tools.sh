#!/usr/bin/env bash
# Tools the test suite checks with, beyond redis-server: systemd-analyze (the unit is verified
# and its security exposure scored), openssl (a throwaway CA for the TLS test) and fio (the disk
# tier's benchmark bound, `kvtier bench --disk`). Install them
# when we can (root on Debian/Ubuntu); otherwise say exactly how.
set -euo pipefail
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v fio >/dev/null 2>&1 || missing+=(fio)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]} with apt-get (for the tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    command -v systemd-analyze >/dev/null 2>&1 && command -v openssl >/dev/null 2>&1 \
        && command -v fio >/dev/null 2>&1 && exit 0
fi
cat >&2 <<MSG
The tests need systemd-analyze, openssl and fio. Install them, then run make test again:
    sudo apt-get update && sudo apt-get install -y ${missing[*]}      # Debian / Ubuntu
MSG
exit 1
