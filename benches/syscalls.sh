#!/usr/bin/env bash
# System calls per request of Tollgate binaries and of nginx, counted by `strace -c` while wrk
# runs: a count, steady on a noisy machine, of what each proxy asks of the kernel per request.
#
# Each binary serves `GET /v1/orders` with the bench key (rules/bench.json, embedded store, one
# thread) in front of nginx's `return 200`; nginx is benches/nginx/limit_req.conf with one
# worker. Under strace each proxy is slower, so the request counts differ; the counts per
# request are what compare.
#
# TOLLGATE_ARGS adds arguments to every Tollgate (split on spaces), e.g. an access log:
#   TOLLGATE_ARGS="--access-log-format combined" (the lines go to stderr, here /dev/null).
#
# Usage: [TOLLGATE_ARGS=...] benches/syscalls.sh SECONDS BINARY [BINARY ...]   e.g.
#   benches/syscalls.sh 2 /tmp/tollgate-before target/release/tollgate
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=$1; shift
for bin in nginx wrk strace python3; do
  command -v "$bin" >/dev/null || { echo "syscalls.sh needs $bin (apt-get install nginx wrk strace)" >&2; exit 1; }
done

. benches/lib.sh
start_upstream
bench_rules "$work/rules.json"

# count NAME PID PORT: the system calls of PID and its threads per request of a wrk run.
runs=0
count() {
  local name=$1 pid=$2 port=$3 n out
  runs=$((runs + 1))
  out="$work/strace.$runs"
  wrk -t1 -c8 -d1s -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$port/v1/orders" >/dev/null
  timeout $((DUR + 2)) strace -f -c -p "$pid" -o "$out" 2>/dev/null &
  local tracer=$!
  sleep 0.5
  n=$(wrk -t1 -c8 -d"${DUR}s" -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$port/v1/orders" | awk '/requests in/ {print $1}')
  wait "$tracer" || true
  echo "### $name ($n requests)"
  echo
  echo "| system call | per request |"
  echo "|---|---:|"
  awk -v n="$n" '$NF != "total" && $4 ~ /^[0-9]+$/ && $4 / n >= 0.01 {printf "| %s | %.2f |\n", $NF, $4 / n}' "$out" | sort -t'|' -k3 -nr
  echo
}

i=0
for bin in "$@"; do
  i=$((i + 1))
  p=$(port)
  env -C "$work" TOLLGATE_LOG=warn "$(realpath "$bin")" serve --rules "$work/rules.json" --listen "127.0.0.1:$p" \
    --meter-file "$work/usage.$i.db" --threads 1 ${TOLLGATE_ARGS:-} >/dev/null 2>&1 & pids+=($!)
  tg=$!
  wait_port "$p"
  count "Tollgate $bin" "$tg" "$p"
done

NGX=$(port)
sed -e "s#__PORT__#$NGX#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/limit_req.conf > "$work/proxy.conf"
nginx -c "$work/proxy.conf" -p "$work" & pids+=($!)
master=$!
wait_port "$NGX"
sleep 0.3
count "nginx 1.22, one worker" "$(pgrep -P "$master" | head -1)" "$NGX"
