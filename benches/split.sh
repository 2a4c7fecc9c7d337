#!/usr/bin/env bash
# Where a response's CPU goes, kernel against user space, for Tollgate and another proxy side by
# side, as the matrix (benches/proxy.sh) runs them: each alone on CPU 0, the load and the upstream
# on CPU 1, logs off.
#   MODE=plain (the default): row 1, Tollgate beside nginx, wrk -t1 -c32 keep-alive.
#   MODE=h2: row 5, Tollgate over TLS beside HAProxy, h2load -t1 -c32 -m10.
#
# Each round runs the two proxies in turn (the order reversed every other round) under the same
# load for SECONDS, reads the proxy's CPU time from /proc/PID/stat, and samples it with
# `perf record -e cpu-clock` to split that time between the kernel and user space. Per
# response: the CPU in all, the kernel's and user space's µs, and the kernel's share.
#
# Usage: [MODE=h2] [TOLLGATE_BIN=path] benches/split.sh ROUNDS SECONDS    e.g. benches/split.sh 3 6
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=$1 DUR=$2 MODE=${MODE:-plain}
need=(nginx wrk perf taskset python3)
[ "$MODE" = h2 ] && need+=(haproxy h2load)
for bin in "${need[@]}"; do
  command -v "$bin" >/dev/null || { echo "split.sh needs $bin (apt-get install nginx wrk linux-perf util-linux haproxy nghttp2-client)" >&2; exit 1; }
done

. benches/lib.sh
tollgate_bin
start_upstream 1
bench_rules "$work/rules.json"

TP=$(port)
tls=()
[ "$MODE" = h2 ] && tls=(--tls-cert "$PWD/certs/demo-cert.pem" --tls-key "$PWD/certs/demo-key.pem")
env -C "$work" TOLLGATE_LOG=warn taskset -c 0 "$(realpath "$TG")" serve --rules "$work/rules.json" \
  --listen "127.0.0.1:$TP" --threads 1 "${tls[@]}" >/dev/null 2>"$work/tollgate.err" & pids+=($!)
TPID=$!
wait_port "$TP"
if [ "$MODE" = h2 ]; then
  OTHER=haproxy
  cat certs/demo-cert.pem certs/demo-key.pem > "$work/demo.pem"
  HP=$(port); HTLS=$(port); OP=$(port); HLOG=$(port)
  sed -e "s#__PORT__#$HP#" -e "s#__TLS_PORT__#$HTLS#" -e "s#__H2_PORT__#$OP#" -e "s#__LOG_PORT__#$HLOG#" \
    -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__PEM__#$work/demo.pem#g" benches/haproxy/pinned.cfg > "$work/haproxy.cfg"
  taskset -c 0 haproxy -db -f "$work/haproxy.cfg" >/dev/null 2>"$work/haproxy.err" & pids+=($!)
  OPID=$!
  wait_port "$OP"
else
  OTHER=nginx
  OP=$(port)
  sed -e "s#__PORT__#$OP#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/limit_req.conf > "$work/proxy.conf"
  taskset -c 0 nginx -c "$work/proxy.conf" -p "$work" & pids+=($!)
  NMASTER=$!
  wait_port "$OP"
  sleep 0.3
  OPID=$(pgrep -P "$NMASTER")
fi

# load PORT SECONDS: the row's load on CPU 1; prints the responses completed.
load() {
  if [ "$MODE" = h2 ]; then
    taskset -c 1 h2load -t1 -c32 -m10 -D "$2" -H "x-api-key: bench-demo-key" "https://127.0.0.1:$1/v1/orders" |
      awk '/^requests:/ {print $8}'
  else
    taskset -c 1 wrk -t1 -c32 -d"$2s" -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$1/v1/orders" |
      awk '/requests in/ {print $1}'
  fi
}

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

# case NAME PID PORT: one measured run; prints "NAME responses cpu_us kernel_share".
case_run() {
  local name=$1 pid=$2 p=$3 a b out n
  load "$p" 1 >/dev/null
  a=$(ticks "$pid")
  load "$p" "$DUR" >"$work/load.out" &
  local w=$!
  perf record -q -F 997 -e cpu-clock -p "$pid" -o "$work/perf.$name" -- sleep "$((DUR - 1))" 2>/dev/null
  wait "$w"
  b=$(ticks "$pid")
  n=$(cat "$work/load.out")
  # The kernel's share of the samples: its symbols are marked [k].
  out=$(perf report -i "$work/perf.$name" --no-children --sort dso --stdio 2>/dev/null |
    awk '/^ *[0-9.]+%/ {gsub("%","",$1); if ($2 == "[kernel.kallsyms]") k += $1; t += $1} END {printf "%.4f", k / t}')
  echo "$name $n $(python3 -c "print(($b - $a) / $hz * 1e6 / $n)") $out"
}

echo "| round | proxy | responses | CPU µs per response | kernel µs | user µs | kernel share |"
echo "|---|---|---:|---:|---:|---:|---:|"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="t n"; else order="n t"; fi
  for c in $order; do
    if [ "$c" = t ]; then line=$(case_run tollgate "$TPID" "$TP"); else line=$(case_run "$OTHER" "$OPID" "$OP"); fi
    read -r name n us share <<<"$line"
    python3 -c "print(f'| $r | $name | {int($n):,} | {$us:.1f} | {$us * $share:.1f} | {$us * (1 - $share):.1f} | {$share:.2f} |')"
  done
done
