#!/usr/bin/env bash
# kvtier's embedded default and its tests start private redis-server processes, so the binary
# must be on PATH. Install it when we can (root on Debian/Ubuntu); otherwise say exactly how.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: redis-server not found; installing it with apt-get"
    # Install the binary without starting the distribution's own service on port 6379.
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && made_policy=1
    fi
    trap '[ "$made_policy" = 1 ] && rm -f "$policy"' EXIT
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
    command -v redis-server >/dev/null 2>&1 && exit 0
fi
cat >&2 <<'MSG'
kvtier needs redis-server on PATH (the daemon's embedded default and the tests start their own).
Install it, then run make again:
    sudo apt-get update && sudo apt-get install -y redis-server      # Debian / Ubuntu
MSG
exit 1
