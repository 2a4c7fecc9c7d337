#!/usr/bin/env bash
# Where row R of the matrix (Tollgate on Redis ÷ on the embedded store) spends its time: both
# gateways pinned to CPU 0 with one thread, as in benches/proxy.sh; the upstream (nginx `return
# 200`), redis-server and wrk share CPU 1. For each case and round it prints req/s; the CPU per
# request of the gateway, of redis-server and of the upstream (/proc/PID/stat, all threads) and
# of wrk (/usr/bin/time); how busy that keeps each CPU (µs per request × req/s); and how many
# checks each script call carried (redis-server's `INFO commandstats`). With
# BEFORE_BIN, a third case runs that build on the same redis-server: a change side by side.
#
# Usage: [TOLLGATE_BIN=path] [BEFORE_BIN=path] benches/redis_row.sh [ROUNDS=3] [DURATION_S=6] [CONNECTIONS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
DUR=${2:-6}
CONNS=${3:-32}
for bin in nginx wrk redis-server redis-cli taskset python3 /usr/bin/time; do
  command -v "$bin" >/dev/null || { echo "redis_row.sh needs $bin (apt-get install nginx wrk redis-server redis-tools util-linux time)" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

echo "uptime before: $(uptime)" >&2
start_upstream 1
sleep 0.3
UP_MASTER=$(pgrep -f "$work/upstream.conf" | head -1)
UP_PIDS="$UP_MASTER $(pgrep -P "$UP_MASTER" | tr '\n' ' ')"
RP=$(port)
taskset -c 1 redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no >/dev/null & pids+=($!)
REDIS_PID=$!
wait_port "$RP"
mkdir -p "$work/rules"
bench_rules "$work/rules/rules.json"

CASES="embedded redis"
[ -n "${BEFORE_BIN:-}" ] && CASES="$CASES redis-before"
declare -A PORT PID
for c in $CASES; do
  store=() bin=$TG
  [ "$c" != embedded ] && store=(--store "redis://127.0.0.1:$RP" --store-timeout 50ms)
  [ "$c" = redis-before ] && bin=$BEFORE_BIN
  p=$(port)
  TOLLGATE_LOG=warn taskset -c 0 "$bin" serve --rules "$work/rules/rules.json" --listen "127.0.0.1:$p" --threads 1 \
    --meter-file "$work/$c-usage.db" "${store[@]}" >"$work/$c.out" 2>"$work/$c.err" & pids+=($!)
  PID[$c]=$!
  PORT[$c]=$p
  wait_port "$p"
done

# CPU ticks of PIDS, every thread.
ticks() { local t=0 p f; for p in "$@"; do for f in /proc/"$p"/task/*/stat; do t=$((t + $(awk '{print $14 + $15}' "$f" 2>/dev/null || echo 0))); done; done; echo "$t"; }
evalsha_calls() { redis-cli -p "$RP" INFO commandstats | awk -F'[=,]' '/^cmdstat_evalsha:/{print $2}'; }
hz=$(getconf CLK_TCK)
run() {
  /usr/bin/time -f '%U %S' -o "$work/wrk-time" \
    taskset -c 1 wrk -t1 -c"$CONNS" -d"$1"s -H "X-API-Key: bench-demo-key" "http://127.0.0.1:${PORT[$2]}/v1/orders"
}
for c in $CASES; do run 2 "$c" >/dev/null; done

printf '| round | case | req/s | gateway µs/req | redis-server µs/req | upstream µs/req | wrk µs/req | CPU 0 busy | CPU 1 busy | checks per call | non-2xx |\n'
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for r in $(seq "$ROUNDS"); do
  order=$CASES; [ $((r % 2)) -eq 0 ] && order=$(echo "$CASES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    g0=$(ticks "${PID[$c]}"); s0=$(ticks "$REDIS_PID"); u0=$(ticks $UP_PIDS); e0=$(evalsha_calls); e0=${e0:-0}
    out=$(run "$DUR" "$c" 2>&1)
    g1=$(ticks "${PID[$c]}"); s1=$(ticks "$REDIS_PID"); u1=$(ticks $UP_PIDS); e1=$(evalsha_calls); e1=${e1:-0}
    n=$(echo "$out" | awk '/requests in/{print $1}')
    rps=$(echo "$out" | awk '/Requests\/sec/{print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/{print $NF}')
    python3 - "$r" "$c" "$rps" "$n" "$hz" "$((g1 - g0))" "$((s1 - s0))" "$((u1 - u0))" "$((e1 - e0))" "${non2xx:-0}" "$work/rows.tsv" "$(cat "$work/wrk-time")" <<'PY'
import sys
r, c, rps, n, hz, g, s, u, e, bad, rows, wrk = sys.argv[1:13]
n, hz, rps = int(n), int(hz), float(rps)
us = lambda t: int(t) * 1e6 / hz / n
w = sum(map(float, wrk.split())) * 1e6 / n
per_call = f"{n / int(e):.1f}" if int(e) > 0 else "–"
cpu0 = us(g) * rps / 1e6
cpu1 = (us(s) + us(u) + w) * rps / 1e6
print(f"| {r} | {c} | {rps:,.0f} | {us(g):.1f} | {us(s):.1f} | {us(u):.1f} | {w:.1f} | {cpu0:.0%} | {cpu1:.0%} | {per_call} | {bad} |")
with open(rows, "a") as f:
    f.write(f"{r}\t{c}\t{rps}\t{us(g):.2f}\t{us(s):.2f}\t{us(u):.2f}\t{w:.2f}\n")
PY
  done
done
python3 - "$work/rows.tsv" <<'PY'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
by = {}
for r, c, *v in rows:
    by.setdefault(c, {})[r] = tuple(map(float, v))
print()
print("| case | req/s (median) | gateway µs/req | redis-server µs/req | upstream µs/req | wrk µs/req | ÷ embedded, per round |")
print("|---|---:|---:|---:|---:|---:|---|")
for c, rounds in by.items():
    med = lambda i: statistics.median(v[i] for v in rounds.values())
    per = ", ".join(f"{rounds[r][0] / by['embedded'][r][0]:.2f}" for r in sorted(rounds))
    print(f"| {c} | {med(0):,.0f} | {med(1):.1f} | {med(2):.1f} | {med(3):.1f} | {med(4):.1f} | {per} |")
PY
echo "uptime after: $(uptime)" >&2
