#!/usr/bin/env bash
# Install kvtier as a systemd service on this node (run as root from a checkout):
#   venv    /opt/kvtier/venv      (torch pinned exactly, as in development)
#   config  /etc/kvtier/kvtier.toml  (kept if present: an upgrade never overwrites it)
#   unit    /etc/systemd/system/kvtier.service, sysusers and tmpfiles snippets
# Then: edit the config, `kvtier config check /etc/kvtier/kvtier.toml`, `systemctl enable --now kvtier`.
# Upgrading: run it again, then `systemctl restart kvtier`; the cpu arena survives the restart
# (RemoveIPC=no, daemon.persist_arena) as long as the pool layouts stay the same.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "install-node: run as root" >&2; exit 1; }
prefix=${KVTIER_PREFIX:-/opt/kvtier}
install -d -m 0755 "$prefix"
# Each install gets its own venv (venvs cannot be moved: their scripts name their own path);
# $prefix/venv is a symlink switched in one rename, so a running daemon keeps its files until
# it restarts. The previous venv is kept for a rollback; older ones are removed.
new="$prefix/venv-$(date +%Y%m%d%H%M%S)"
KVTIER_INSTALL=node scripts/setup-venv.sh "$new"
previous=$(readlink "$prefix/venv" 2>/dev/null || true)
ln -sfn "$new" "$prefix/venv.link" && mv -T "$prefix/venv.link" "$prefix/venv"
for old in "$prefix"/venv-*; do
    [ "$old" = "$new" ] || [ "$old" = "$previous" ] || rm -rf "$old"
done
install -d -m 0755 /etc/kvtier
[ -e /etc/kvtier/kvtier.toml ] || install -m 0640 config/kvtier.toml /etc/kvtier/kvtier.toml
install -m 0644 systemd/kvtier.service /etc/systemd/system/kvtier.service
install -D -m 0644 systemd/kvtier.sysusers.conf /usr/lib/sysusers.d/kvtier.conf
install -D -m 0644 systemd/kvtier.tmpfiles.conf /usr/lib/tmpfiles.d/kvtier.conf
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemd-sysusers
    systemd-tmpfiles --create /usr/lib/tmpfiles.d/kvtier.conf
    chgrp kvtier /etc/kvtier/kvtier.toml
    systemctl daemon-reload
fi
"$prefix/venv/bin/kvtier" config check /etc/kvtier/kvtier.toml >/dev/null && echo "install-node: config ok"
echo "install-node: done; start with: systemctl enable --now kvtier"
