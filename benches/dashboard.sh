#!/usr/bin/env bash
# What an open dashboard costs the gateway: requests per second while the page's requests come
# in (/admin/ once, then /admin/api/overview every second, as the open page makes them) against
# the same with no page, in alternating rounds of one run, so the host's noise falls on both
# alike. The page's own drawing runs in the user's browser, not here: a browser on this 2-core
# host would take CPU from wrk, not from the gateway, so the requests are replayed with curl.
#
# Usage: [TOLLGATE_BIN=path] benches/dashboard.sh [ROUNDS=5] [SECONDS=10]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
DUR=${2:-10}
for bin in nginx wrk curl python3; do
  command -v "$bin" >/dev/null || { echo "dashboard.sh needs $bin" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

start_upstream 1
bench_rules "$work/rules.json"
GP=$(port)
AP=$(port)
TOLLGATE_LOG=warn taskset -c 0 "$TG" serve --rules "$work/rules.json" --listen "127.0.0.1:$GP" \
  --admin-listen "127.0.0.1:$AP" --threads 1 --meter-file "$work/usage.db" >/dev/null 2>"$work/gw.err" & pids+=($!)
wait_port "$GP"

rps() {
  taskset -c 1 wrk -t1 -c16 -d"${DUR}s" -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$GP/v1/orders" \
    | awk '/Requests\/sec/ {print $2}'
}

closed=()
open=()
for r in $(seq "$ROUNDS"); do
  closed+=("$(rps)")
  (
    for f in /admin/ /admin/app.js /admin/vendor/uPlot.iife.min.js /admin/vendor/uPlot.min.css; do
      curl -s -o /dev/null "http://127.0.0.1:$AP$f"
    done
    while true; do curl -s -o /dev/null "http://127.0.0.1:$AP/admin/api/overview"; sleep 1; done
  ) &
  page=$!
  open+=("$(rps)")
  kill "$page"; wait "$page" 2>/dev/null || true
  echo "round $r: closed ${closed[-1]} req/s, open ${open[-1]} req/s" >&2
done
python3 - "${closed[*]}" "${open[*]}" <<'PY'
import statistics, sys
closed = [float(x) for x in sys.argv[1].split()]
opened = [float(x) for x in sys.argv[2].split()]
print("| rounds | closed, median req/s | open, median req/s | open ÷ closed |")
print("|---:|---:|---:|---:|")
mc, mo = statistics.median(closed), statistics.median(opened)
print(f"| {len(closed)} | {mc:,.0f} | {mo:,.0f} | {mo / mc:.3f} |")
PY
