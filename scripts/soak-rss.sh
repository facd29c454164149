#!/usr/bin/env bash
# The daemon's memory under sustained load (issue 32): `kvtier demo` for SECONDS (default 3600)
# with its daemon's RSS sampled every INTERVAL seconds (default 60) into OUT (a CSV), then the
# verdict: the growth over the last half of the run, which must stay under 5% once warm.
#
#   scripts/soak-rss.sh [SECONDS] [OUT] [INTERVAL]
#
# The demo saturates the cores it has (3 client processes and the daemon): run nothing else
# beside it. The demo's own output goes to OUT.demo.log.
set -euo pipefail
cd "$(dirname "$0")/.."
dur=${1:-3600}
out=${2:-soak-rss.csv}
every=${3:-60}
py=.venv/bin/python
[[ -x $py ]] || { echo "soak-rss: no .venv (run make setup first)" >&2; exit 2; }

"$py" -m kvtier.cli demo --duration "$dur" > "$out.demo.log" 2>&1 &
demo=$!
trap 'kill "$demo" 2>/dev/null || true' EXIT

daemon=""
for _ in $(seq 1 120); do  # the daemon's pid: the demo's child running `kvtier.cli daemon`
    daemon=$(pgrep -P "$demo" -f "kvtier.cli daemon" | head -n1 || true)
    [[ -n $daemon ]] && break
    kill -0 "$demo" 2>/dev/null || { echo "soak-rss: the demo exited:" >&2; tail -20 "$out.demo.log" >&2; exit 1; }
    sleep 0.5
done
[[ -n $daemon ]] || { echo "soak-rss: no daemon process found under the demo" >&2; exit 1; }

start=$(date +%s)
echo "t_s,rss_kib,rss_anon_kib,fds" > "$out"
while kill -0 "$daemon" 2>/dev/null && kill -0 "$demo" 2>/dev/null; do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$daemon/status" 2>/dev/null || true)
    anon=$(awk '/^RssAnon:/ {print $2}' "/proc/$daemon/status" 2>/dev/null || true)
    nfd=$(ls "/proc/$daemon/fd" 2>/dev/null | wc -l)
    [[ -n $rss ]] && echo "$(( $(date +%s) - start )),$rss,$anon,$nfd" >> "$out"
    printf 'soak-rss: %5ss  rss %s KiB  anon %s KiB  fds %s\n' "$(( $(date +%s) - start ))" "$rss" "$anon" "$nfd"
    sleep "$every"
done
wait "$demo" || true
trap - EXIT

"$py" - "$out" <<'EOF'
import csv, sys
rows = [(int(r["t_s"]), int(r["rss_kib"]), int(r["rss_anon_kib"] or 0)) for r in csv.DictReader(open(sys.argv[1]))]
if len(rows) < 4:
    sys.exit("soak-rss: too few samples for a verdict")
end = rows[-1][0]
half = [r for r in rows if r[0] >= end / 2]
first, last, peak = half[0][1], rows[-1][1], max(r[1] for r in rows)
growth = (last - first) / first
print(f"soak-rss: {len(rows)} samples over {end} s; RSS {rows[0][1] // 1024} MiB at start, "
      f"{first // 1024} MiB at {half[0][0]} s, {last // 1024} MiB at the end (peak {peak // 1024} MiB); "
      f"last half growth {growth:+.1%} (must be under 5%)")
sys.exit(0 if growth < 0.05 else 1)
EOF
