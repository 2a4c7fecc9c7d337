#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback, all in one run, with the same upstream for all:
#   (a) the upstream called directly (nginx `return 200`)
#   (b) Tollgate, route without limits
#   (c) Tollgate, embedded store, the demo limits (a key that stays under its plan)
#   (d) Tollgate on Redis (redis-server on loopback)
#   (e) nginx 1.22 as a reverse proxy with limit_req (benches/nginx/limit_req.conf)
#   (h) as (c), with the express lane off (--no-express: hyper's general path for every request)
#   (m) as (c), with metering off (--no-meter); binaries without metering skip it
#
# Fairness: every proxy gets CPU 0 alone (Tollgate with one worker thread, nginx with one
# worker process); the upstream and wrk share CPU 1. wrk uses the same connections, threads and
# keep-alive for every case. Cases run in alternating order for ROUNDS rounds and the medians
# are reported, with CPU time per request of the proxy process.
#
# Usage: [TOLLGATE_BIN=path] benches/proxy.sh [ROUNDS=5] [DURATION_S=8] [CONNECTIONS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
DUR=${2:-8}
CONNS=${3:-32}
KEY=bench-demo-key

for bin in nginx wrk redis-server taskset python3; do
  command -v "$bin" >/dev/null || { echo "proxy.sh needs $bin (apt-get install nginx wrk redis-server util-linux)" >&2; exit 1; }
done
# TOLLGATE_BIN measures a binary built elsewhere (another commit, say) instead of this tree's.
if [ -n "${TOLLGATE_BIN:-}" ]; then
  TG=$TOLLGATE_BIN
else
  cargo build --release --bin tollgate >&2
  TG=target/release/tollgate
fi

. benches/lib.sh
start_upstream 1

NGX=$(port)
sed -e "s#__PORT__#$NGX#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/limit_req.conf > "$work/proxy.conf"
taskset -c 0 nginx -c "$work/proxy.conf" -p "$work" & pids+=($!)
NGX_PID=$!
wait_port "$NGX"

RP=$(port)
taskset -c 1 redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no >/dev/null & pids+=($!)
wait_port "$RP"

sed "s#http://127.0.0.1:8081#http://127.0.0.1:$UP#" rules/bench.json > "$work/rules.json"
# Binaries since metering write usage records; keep them in the scratch directory.
METER=()
if "$TG" serve --help | grep -q -- --no-meter; then METER=(yes); fi
start_tg() { # name, extra args...
  local name=$1; shift
  local p; p=$(port)
  local meter_args=()
  [ ${#METER[@]} -gt 0 ] && meter_args=(--meter-file "$work/$name-usage.db")
  TOLLGATE_LOG=warn taskset -c 0 "$TG" serve --rules "$work/rules.json" --listen "127.0.0.1:$p" --threads 1 "${meter_args[@]}" "$@" \
    >"$work/$name.out" 2>"$work/$name.err" & pids+=($!)
  eval "${name}_PID=$!"
  eval "${name}_PORT=$p"
  wait_port "$p"
}
start_tg mem
start_tg general --no-express
start_tg redis --store "redis://127.0.0.1:$RP" --store-timeout 50ms
CASES="a b c d e h"
if [ ${#METER[@]} -gt 0 ]; then
  start_tg nometer --no-meter
  CASES="a b c d e h m"
fi

declare -A URL PID
URL[a]="http://127.0.0.1:$UP/v1/orders";       PID[a]=""
URL[b]="http://127.0.0.1:$mem_PORT/open";      PID[b]=$mem_PID
URL[c]="http://127.0.0.1:$mem_PORT/v1/orders"; PID[c]=$mem_PID
URL[d]="http://127.0.0.1:$redis_PORT/v1/orders"; PID[d]=$redis_PID
URL[e]="http://127.0.0.1:$NGX/v1/orders";      PID[e]=$NGX_PID
URL[h]="http://127.0.0.1:$general_PORT/v1/orders"; PID[h]=$general_PID
if [ ${#METER[@]} -gt 0 ]; then URL[m]="http://127.0.0.1:$nometer_PORT/v1/orders"; PID[m]=$nometer_PID; fi
# nginx's master forks the worker: measure the worker's CPU.
sleep 0.3
NGX_WORKER=$(pgrep -P "$NGX_PID" | head -1); PID[e]=${NGX_WORKER:-$NGX_PID}

cpu_ticks() { [ -z "$1" ] && { echo 0; return; }; awk '{print $14+$15}' "/proc/$1/stat"; }

# Warm every path (pools, caches) before measuring.
for c in $CASES; do taskset -c 1 wrk -t1 -c"$CONNS" -d2s -H "X-API-Key: $KEY" "${URL[$c]}" >/dev/null; done

results="$work/results.tsv"
: > "$results"
for r in $(seq "$ROUNDS"); do
  order=$CASES; [ $((r % 2)) -eq 0 ] && order=$(echo "$CASES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    before=$(cpu_ticks "${PID[$c]}")
    out=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${DUR}s" --latency -H "X-API-Key: $KEY" "${URL[$c]}")
    after=$(cpu_ticks "${PID[$c]}")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    p50=$(echo "$out" | awk '$1=="50%" {print $2}')
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$rps" "$p50" "$p99" "$((after - before))" "$reqs" "${non2xx:-0}" >> "$results"
    echo "round $r case $c: $rps req/s p50 $p50 p99 $p99 non-2xx ${non2xx:-0}" >&2
  done
done

python3 - "$results" "$ROUNDS" "$DUR" "$CONNS" <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
rounds, dur, conns = sys.argv[2], sys.argv[3], sys.argv[4]
names = {"a": "(a) upstream direct", "b": "(b) Tollgate, no limits", "c": "(c) Tollgate, embedded, demo limits",
         "d": "(d) Tollgate, Redis", "e": "(e) nginx limit_req",
         "h": "(h) as (c), express lane off", "m": "(m) as (c), metering off"}
def ms(v):
    if v.endswith("us"): return float(v[:-2]) / 1000
    if v.endswith("ms"): return float(v[:-2])
    if v.endswith("s"): return float(v[:-1]) * 1000
    return float(v)
hz = 100  # USER_HZ
med = {}
cases = [c for c in "abcdehm" if any(r[0] == c for r in rows)]
for c in cases:
    rs = [r for r in rows if r[0] == c]
    rps = statistics.median(float(r[1]) for r in rs)
    p50 = statistics.median(ms(r[2]) for r in rs)
    p99 = statistics.median(ms(r[3]) for r in rs)
    cpu = [int(r[4]) / hz * 1e6 / int(r[5]) for r in rs if int(r[5]) > 0 and c != "a"]
    non2xx = sum(int(r[6]) for r in rs)
    med[c] = (rps, p50, p99, statistics.median(cpu) if cpu else None, non2xx)
print(f"Rounds: {rounds} × {dur} s per case, wrk -t1 -c{conns}, medians.\n")
print("| case | req/s | p50 ms | p99 ms | proxy CPU µs/req | ÷ (a) | ÷ (e) | non-2xx |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for c in cases:
    rps, p50, p99, cpu, bad = med[c]
    cpu_s = f"{cpu:.1f}" if cpu is not None else "–"
    print(f"| {names[c]} | {rps:,.0f} | {p50:.3f} | {p99:.3f} | {cpu_s} | {rps/med['a'][0]:.2f} | {rps/med['e'][0]:.2f} | {bad} |")
print(f"\n(c) ÷ (b) = {med['c'][0]/med['b'][0]:.3f}   (c) ÷ (e) = {med['c'][0]/med['e'][0]:.3f}   (c) ÷ (h) = {med['c'][0]/med['h'][0]:.3f}")
# Per-round ratios, measured back to back, say more on a noisy host than ratios of medians.
ce = sorted(float(c[1]) / float(e[1]) for c, e in zip([r for r in rows if r[0] == "c"], [r for r in rows if r[0] == "e"]))
print(f"(c) ÷ (e) per round: {', '.join(f'{x:.3f}' for x in ce)}")
if "m" in med:
    cm = sorted(float(c[1]) / float(m[1]) for c, m in zip([r for r in rows if r[0] == "c"], [r for r in rows if r[0] == "m"]))
    print(f"metering on ÷ off, (c) ÷ (m) = {med['c'][0]/med['m'][0]:.3f}; per round: {', '.join(f'{x:.3f}' for x in cm)}")
PY
