#!/usr/bin/env bash
# Req/s and memory through real gateways as the embedded store's buckets grow from 1 to
# 10,000,000 (issue 24: bytes per key ≤ 64, req/s at 10 M keys at least 0.8 of req/s at 1),
# all in one run. Each size has a gateway of its own whose store is filled first, one request
# per distinct value of a header-dimension limit (`X-Client`), then every size is measured side
# by side with wrk picking a value at random from those filled (benches/wrk/clients.lua).
#
# The limit's numbers differ by size, and only they: a bucket the sweeper finds full again is
# dropped, so the filled sizes refill slowly (1 per hour, a burst with room for every request
# the rounds can send a value: a bucket charged once stays below full for an hour), while the
# one-bucket size must admit the whole load (1,000,000 a second). The code a request runs is the same. Every request also charges the bench key's
# plan, so a request is two buckets: the key's and the client's.
#
# Fairness as in benches/proxy.sh: each gateway on CPU 0 (--threads 1), nginx `return 200` and
# wrk on CPU 1, the same wrk connections and script for every size, sizes in alternating order
# each round, medians reported with the gateway's CPU time per request from /proc/PID/stat.
# Bytes per bucket are the gateway's VmRSS growth across its fill (read 12 s after it, once the
# allocator has returned the pages of the tables the store outgrew) ÷ the buckets filled.
#
# Usage: [TOLLGATE_BIN=path] [SIZES="1 1000 100000 1000000 10000000"] benches/keys.sh [ROUNDS=3] [DURATION_S=8] [CONNECTIONS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
DUR=${2:-8}
CONNS=${3:-32}
KEY=bench-demo-key
SIZES=${SIZES:-1 1000 100000 1000000 10000000}

for bin in nginx wrk taskset python3 curl; do
  command -v "$bin" >/dev/null || { echo "keys.sh needs $bin (apt-get install nginx wrk util-linux curl)" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

echo "uptime before: $(uptime)" >&2
start_upstream 1

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }

declare -A URL PID FILL_S BYTES
CASES=""
for n in $SIZES; do
  mkdir -p "$work/rules-$n"
  python3 - "$n" "$UP" "$ROUNDS" "$DUR" > "$work/rules-$n/rules.json" <<'PY'
import json, sys
n, up, rounds, dur = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rules = json.load(open("rules/bench.json"))
rules["upstreams"]["orders"]["url"] = f"http://127.0.0.1:{up}"
# Room for twice the requests a value gets at 100,000 req/s over every round, plus its fill.
burst = max(100, -(-2 * rounds * dur * 100_000 // n) + 1)
rate, burst = ("1000000/1s", 1000000) if n == 1 else ("1/3600s", burst)
rules["limits"]["client"] = {"dimension": {"header": "X-Client"}, "rate": rate, "burst": burst,
                             "description": "One bucket per client value (benches/keys.sh)."}
rules["routes"].insert(0, {"name": "clients", "method": "GET", "path": "/v1/clients",
                           "upstream": "orders", "cost": {"plan": 1, "client": 1}})
json.dump(rules, sys.stdout)
PY
  p=$(port)
  TOLLGATE_LOG=warn taskset -c 0 "$TG" serve --rules "$work/rules-$n/rules.json" --listen "127.0.0.1:$p" \
    --threads 1 --meter-file "$work/$n-usage.db" >"$work/$n.out" 2>"$work/$n.err" & pids+=($!)
  PID[$n]=$!
  URL[$n]="http://127.0.0.1:$p/v1/clients"
  CASES="$CASES $n"
  wait_port "$p"
  code=$(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $KEY" -H "X-Client: c0" "${URL[$n]}")
  [ "$code" = 200 ] || { echo "size $n answers $code, not 200" >&2; cat "$work/$n.err" >&2; exit 1; }
done

# Fill: each client value once, in order; wrk writes $work/filled at the Nth answer (and exits
# at any answer but 200).
for n in $CASES; do
  before=$(rss_kib "${PID[$n]}")
  start=$(date +%s.%N)
  rm -f "$work/filled"
  taskset -c 1 wrk -t1 -c"$CONNS" -d3600s -s benches/wrk/clients.lua "${URL[$n]}" -- fill "$n" "$KEY" "$work/filled" \
    >"$work/fill-$n.out" 2>&1 &
  wrk_pid=$!
  while [ ! -f "$work/filled" ]; do
    kill -0 "$wrk_pid" 2>/dev/null || { echo "fill of $n ended early:" >&2; cat "$work/fill-$n.out" >&2; exit 1; }
    sleep 0.2
  done
  end=$(date +%s.%N)
  kill -INT "$wrk_pid"; wait "$wrk_pid" || true
  # jemalloc gives freed pages back after its 10 s decay: the tables a store outgrew are freed,
  # not yet returned, until then.
  sleep 12
  after=$(rss_kib "${PID[$n]}")
  FILL_S[$n]=$(python3 -c "print(f'{$end - $start:.1f}')")
  BYTES[$n]=$(python3 -c "print(f'{($after - $before) * 1024 / $n:.1f}' if $n >= 100000 else '–')")
  echo "filled $n buckets in ${FILL_S[$n]} s: RSS $before → $after KiB" >&2
done

results="$work/results.tsv"
: > "$results"
for r in $(seq "$ROUNDS"); do
  order=$CASES; [ $((r % 2)) -eq 0 ] && order=$(echo "$CASES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    before=$(cpu_ticks "${PID[$c]}")
    out=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${DUR}s" --latency -s benches/wrk/clients.lua "${URL[$c]}" -- random "$c" "$KEY")
    after=$(cpu_ticks "${PID[$c]}")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$r" "$rps" "$p99" "$((after - before))" "$reqs" "${non2xx:-0}" "$(rss_kib "${PID[$c]}")" >> "$results"
    echo "round $r size $c: $rps req/s p99 $p99 non-2xx ${non2xx:-0}" >&2
    # A refusal is a shorter path than an admission: a round with any is not a measurement.
    [ -z "$non2xx" ] || { echo "size $c answered $non2xx non-2xx: the burst is too small for this load" >&2; exit 1; }
  done
done
echo "uptime after: $(uptime)" >&2

for n in $CASES; do echo -e "$n\t${FILL_S[$n]}\t${BYTES[$n]}"; done > "$work/fill.tsv"
python3 - "$results" "$work/fill.tsv" "$ROUNDS" "$DUR" "$CONNS" <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
fill = {l.split('\t')[0]: l.rstrip('\n').split('\t')[1:] for l in open(sys.argv[2])}
rounds, dur, conns = sys.argv[3], sys.argv[4], sys.argv[5]
def ms(v):
    for suf, k in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(suf): return float(v[:-len(suf)]) * k
    return float(v)
print(f"Rounds: {rounds} × {dur} s per size, wrk -t1 -c{conns}, GET /v1/clients with a random filled X-Client, medians.\n")
print("| buckets filled | fill s | bytes per bucket | req/s | p99 ms | gateway CPU µs/req | ÷ req/s at 1 | gateway RSS MiB | non-2xx |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
sizes = list(dict.fromkeys(r[0] for r in rows))
med = {c: statistics.median(float(r[2]) for r in rows if r[0] == c) for c in sizes}
for c in sizes:
    rs = [r for r in rows if r[0] == c]
    p99 = statistics.median(ms(r[3]) for r in rs)
    cpu = statistics.median(int(r[4]) / 100 * 1e6 / int(r[5]) for r in rs if int(r[5]) > 0)
    bad = sum(int(r[6]) for r in rs)
    rss = max(int(r[7]) for r in rs) / 1024
    print(f"| {int(c):,} | {fill[c][0]} | {fill[c][1]} | {med[c]:,.0f} | {p99:.3f} | {cpu:.1f} | {med[c] / med[sizes[0]]:.3f} | {rss:.0f} | {bad} |")
for c in sizes[1:]:
    per = sorted(float(x[2]) / float(y[2]) for x in rows for y in rows
                 if x[0] == c and y[0] == sizes[0] and x[1] == y[1])
    print(f"\n{int(c):,} ÷ {int(sizes[0]):,} per round: {', '.join(f'{v:.3f}' for v in per)}")
PY
