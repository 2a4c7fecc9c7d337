#!/usr/bin/env bash
# Req/s through a real gateway as the rules grow from 10 to 10,000 routes (issue 24: req/s at
# 10,000 at least 0.9 of req/s at 10), all in one run. Each rules file is rules/bench.json's
# limits and keys with N routes: a `*` catch-all on `/` and N-1 under `/api/v1/` (the shape of
# benches/routes.rs). wrk asks for `/health/live`, which only the catch-all takes: the request
# a linear scan finds last. Every request charges the bench key's plan (never refused).
#
# Fairness as in benches/proxy.sh: each gateway on CPU 0 alone (--threads 1), nginx `return
# 200` and wrk on CPU 1, the same wrk connections for every case, cases in alternating order
# each round, medians reported with the gateway's CPU time per request from /proc/PID/stat.
# `check-rules` on each file is timed once (compile and summary).
#
# Usage: [TOLLGATE_BIN=path] [SCAN_BIN=path] benches/routes.sh [ROUNDS=3] [DURATION_S=8] [CONNECTIONS=32]
#   TOLLGATE_BIN: the binary to measure (default: a release build of this tree)
#   SCAN_BIN: also measure this binary, e.g. a build of a commit whose routes were scanned
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
DUR=${2:-8}
CONNS=${3:-32}
KEY=bench-demo-key
SIZES="10 100 1000 10000"

for bin in nginx wrk taskset python3; do
  command -v "$bin" >/dev/null || { echo "routes.sh needs $bin (apt-get install nginx wrk util-linux)" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin
declare -A BIN
BIN[new]=$TG
BINS="new"
if [ -n "${SCAN_BIN:-}" ]; then BIN[scan]=$SCAN_BIN; BINS="new scan"; fi

start_upstream 1

for n in $SIZES; do
  python3 - "$n" "$UP" > "$work/rules-$n.json" <<'PY'
import json, sys
n, up = int(sys.argv[1]), sys.argv[2]
rules = json.load(open("rules/bench.json"))
rules["upstreams"]["orders"]["url"] = f"http://127.0.0.1:{up}"
routes = [{"name": "fallback", "method": "*", "path": "/", "upstream": "orders", "cost": {"plan": 1}}]
for i in range(n - 1):
    routes.append({"method": ["GET", "POST", "*"][i % 3], "path": f"/api/v1/s{i // 8}/r{i % 8}",
                   "upstream": "orders", "cost": {"plan": 1}})
rules["routes"] = routes
json.dump(rules, sys.stdout)
PY
  for b in $BINS; do
    start=$(date +%s.%N)
    "${BIN[$b]}" check-rules "$work/rules-$n.json" >/dev/null
    end=$(date +%s.%N)
    echo "check-rules, $b, $n routes: $(python3 -c "print(f'{($end - $start) * 1000:.0f} ms')")" >&2
  done
done

declare -A URL PID
CASES=""
for b in $BINS; do
  for n in $SIZES; do
    c="$b-$n"
    p=$(port)
    TOLLGATE_LOG=warn taskset -c 0 "${BIN[$b]}" serve --rules "$work/rules-$n.json" --listen "127.0.0.1:$p" \
      --threads 1 --meter-file "$work/$c-usage.db" >"$work/$c.out" 2>"$work/$c.err" & pids+=($!)
    PID[$c]=$!
    URL[$c]="http://127.0.0.1:$p/health/live"
    CASES="$CASES $c"
    wait_port "$p"
  done
done

cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
for c in $CASES; do
  code=$(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $KEY" "${URL[$c]}")
  [ "$code" = 200 ] || { echo "$c answers $code, not 200" >&2; cat "$work/$c.err" >&2; exit 1; }
  taskset -c 1 wrk -t1 -c"$CONNS" -d2s -H "X-API-Key: $KEY" "${URL[$c]}" >/dev/null
done

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
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$r" "$rps" "$p99" "$((after - before))" "$reqs" "${non2xx:-0}" >> "$results"
    echo "round $r $c: $rps req/s p99 $p99 non-2xx ${non2xx:-0}" >&2
  done
done

python3 - "$results" "$ROUNDS" "$DUR" "$CONNS" <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
rounds, dur, conns = sys.argv[2], sys.argv[3], sys.argv[4]
def ms(v):
    for suf, k in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(suf): return float(v[:-len(suf)]) * k
    return float(v)
print(f"Rounds: {rounds} × {dur} s per case, wrk -t1 -c{conns}, GET /health/live (the catch-all), medians.\n")
print("| matcher | routes | req/s | p99 ms | gateway CPU µs/req | ÷ same matcher at 10 | non-2xx |")
print("|---|---:|---:|---:|---:|---:|---:|")
cases = list(dict.fromkeys(r[0] for r in rows))
med = {}
for c in cases:
    rs = [r for r in rows if r[0] == c]
    med[c] = statistics.median(float(r[2]) for r in rs)
for c in cases:
    rs = [r for r in rows if r[0] == c]
    b, n = c.split("-")
    p99 = statistics.median(ms(r[3]) for r in rs)
    cpu = statistics.median(int(r[4]) / 100 * 1e6 / int(r[5]) for r in rs if int(r[5]) > 0)
    bad = sum(int(r[6]) for r in rs)
    print(f"| {b} | {int(n):,} | {med[c]:,.0f} | {p99:.3f} | {cpu:.1f} | {med[c] / med[b + '-10']:.3f} | {bad} |")
# Per-round ratios of cases measured in the same round say more on a noisy host.
for b in dict.fromkeys(c.split("-")[0] for c in cases):
    per = sorted(float(x[2]) / float(y[2]) for x in rows for y in rows
                 if x[0] == f"{b}-10000" and y[0] == f"{b}-10" and x[1] == y[1])
    print(f"\n{b}: 10,000 ÷ 10 routes per round: {', '.join(f'{v:.3f}' for v in per)}")
PY
