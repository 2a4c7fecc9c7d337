#!/usr/bin/env bash
# Instructions per request, counted by callgrind over all of the process's threads (the access
# log's writer included), of one release binary serving `GET /v1/orders` with the bench key
# (rules/bench.json, embedded store, one runtime thread) in front of nginx's `return 200`,
# under wrk -t1 -c8 for SECONDS, with each kind of access line:
#   event     no flag, TOLLGATE_LOG=info: the default `tollgate::access` event
#   combined  --access-log-format combined
#   json      --access-log-format json
#   none      no flag, TOLLGATE_LOG=warn: no access line at all
# Usage: benches/access_log.sh SECONDS [BINARY]   (default target/release/tollgate)
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=$1
BIN=$(realpath "${2:-target/release/tollgate}")
for bin in nginx wrk valgrind python3; do
  command -v "$bin" >/dev/null || { echo "access_log.sh needs $bin (apt-get install nginx wrk valgrind)" >&2; exit 1; }
done
. benches/lib.sh
start_upstream
bench_rules "$work/rules.json"

echo "| access line | requests | lines written | instructions / request |"
echo "|---|---:|---:|---:|"
for run in event:info: combined:info:combined json:info:json none:warn:; do
  IFS=: read -r name log fmt <<<"$run"
  flag=""; [ -n "$fmt" ] && flag="--access-log-format $fmt"
  p=$(port); out="$work/cg.$name"
  env -C "$work" TOLLGATE_LOG="$log" valgrind --tool=callgrind --callgrind-out-file="$out" "$BIN" serve \
    --rules "$work/rules.json" --listen "127.0.0.1:$p" --threads 1 $flag >/dev/null 2>"$work/err.$name" &
  vg=$!
  # A start under valgrind can take longer than wait_port's 20 s on a loaded machine.
  for _ in $(seq 1200); do (exec 3<>/dev/tcp/127.0.0.1/"$p") 2>/dev/null && break; sleep 0.05; done
  # Warm up, zero the counters, then measure: start-up and warm-up are not counted.
  wrk -t1 -c8 -d1s -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$p/v1/orders" >/dev/null
  callgrind_control -z "$vg" >/dev/null 2>&1
  reqs=$(wrk -t1 -c8 -d"${DUR}s" -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$p/v1/orders" | awk '/requests in/ {print $1}')
  kill -INT "$vg"; wait "$vg" 2>/dev/null || true
  total=$(cat "$out"* | awk '/^summary:/ {s += $2} END {print s}')
  # Lines of the warm-up too, written at exit; every line names its request id.
  lines=$(grep -c 'request_id' "$work/err.$name" || true)
  python3 -c "print(f'| $name | {int(\"$reqs\"):,} | {int(\"$lines\"):,} | {int(\"$total\") / int(\"$reqs\"):,.0f} |')"
done
