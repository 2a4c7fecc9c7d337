#!/usr/bin/env bash
# What exporting a span per request costs, side by side in one run: `tollgate demo` (its
# built-in demo upstream, rules/bench.json so the key is never limited)
#   (off)  without --otlp-endpoint
#   (r0)   --otlp-endpoint, --otlp-sample-ratio 0: ids, the upstream's traceparent, no span
#   (on)   --otlp-endpoint, ratio 1.0: every request's span exported to a local receiver
# The receiver is a small Python OTLP/HTTP endpoint that answers 200 to every POST /v1/traces
# and counts bodies and bytes. Each gateway gets CPU 0 alone with one worker thread; wrk and the
# receiver share CPU 1. Cases alternate order for ROUNDS rounds; medians and per-round ratios.
#
# Usage: [TOLLGATE_BIN=path] benches/otel.sh [ROUNDS=5] [DURATION_S=8] [CONNECTIONS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
DUR=${2:-8}
CONNS=${3:-32}
KEY=bench-demo-key

for bin in wrk taskset python3 curl; do
  command -v "$bin" >/dev/null || { echo "otel.sh needs $bin (apt-get install wrk util-linux curl)" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin


RX=$(port)
cat > "$work/receiver.py" <<'PY'
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
stats = {"posts": 0, "bytes": 0}
lock = threading.Lock()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        with lock:
            stats["posts"] += 1
            stats["bytes"] += n
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def do_GET(self):
        body = f'{stats["posts"]} {stats["bytes"]}\n'.encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
taskset -c 1 python3 "$work/receiver.py" "$RX" & pids+=($!)
wait_port "$RX"

start_tg() { # name, extra args...
  local name=$1; shift
  local p a; p=$(port); a=$(port)
  TOLLGATE_LOG=warn taskset -c 0 "$TG" demo --rules rules/bench.json --listen "127.0.0.1:$p" --admin-listen "127.0.0.1:$a" \
    --threads 1 --meter-file "$work/$name-usage.db" "$@" >"$work/$name.out" 2>"$work/$name.err" & pids+=($!)
  eval "${name}_PID=$!"
  eval "${name}_PORT=$p"
  eval "${name}_ADMIN=$a"
  wait_port "$p"
}
start_tg off
start_tg r0 --otlp-endpoint "http://127.0.0.1:$RX" --otlp-sample-ratio 0
start_tg on --otlp-endpoint "http://127.0.0.1:$RX" --otlp-sample-ratio 1.0
CASES="off r0 on"
declare -A URL PID
for c in $CASES; do
  eval "URL[$c]=http://127.0.0.1:\${${c}_PORT}/v1/orders"
  eval "PID[$c]=\${${c}_PID}"
done

cpu_ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
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
    p99=$(echo "$out" | awk '$1=="99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $5}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$c" "$rps" "$p99" "$((after - before))" "$reqs" "${non2xx:-0}" >> "$results"
    echo "round $r case $c: $rps req/s p99 $p99 non-2xx ${non2xx:-0}" >&2
  done
done

# Let the last batch go out, then read what arrived and what was dropped.
sleep 6
received=$(curl -s "http://127.0.0.1:$RX/")
dropped=$(curl -s "http://127.0.0.1:$on_ADMIN/metrics" | awk '/^tollgate_otlp_spans_dropped_total/ {print $2}')
requests_on=$(curl -s "http://127.0.0.1:$on_ADMIN/metrics" | awk '/^tollgate_requests_total/ {s+=$2} END {print s}')

python3 - "$results" "$ROUNDS" "$DUR" "$CONNS" "$received" "${dropped:-?}" "${requests_on:-?}" <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
rounds, dur, conns, received, dropped, requests_on = sys.argv[2:8]
names = {"off": "(off) no --otlp-endpoint", "r0": "(r0) exporter on, ratio 0", "on": "(on) ratio 1.0, every span exported"}
def ms(v):
    if v.endswith("us"): return float(v[:-2]) / 1000
    if v.endswith("ms"): return float(v[:-2])
    if v.endswith("s"): return float(v[:-1]) * 1000
    return float(v)
by = {c: [r for r in rows if r[1] == c] for c in names}
med = {}
for c, rs in by.items():
    med[c] = (statistics.median(float(r[2]) for r in rs),
              statistics.median(ms(r[3]) for r in rs),
              statistics.median(int(r[4]) / 100 * 1e6 / int(r[5]) for r in rs if int(r[5]) > 0),
              sum(int(r[6]) for r in rs))
print(f"Rounds: {rounds} × {dur} s per case, wrk -t1 -c{conns}, medians.\n")
print("| case | req/s | p99 ms | gateway CPU µs/req | ÷ (off) | non-2xx |")
print("|---|---:|---:|---:|---:|---:|")
for c in names:
    rps, p99, cpu, bad = med[c]
    print(f"| {names[c]} | {rps:,.0f} | {p99:.3f} | {cpu:.1f} | {rps/med['off'][0]:.3f} | {bad} |")
for c in ("r0", "on"):
    per = sorted(float(a[2]) / float(b[2]) for a, b in zip(by[c], by["off"]))
    print(f"\n({c}) ÷ (off) per round: {', '.join(f'{x:.3f}' for x in per)}", end="")
posts, nbytes = received.split()
print(f"\n\nreceiver: {posts} OTLP posts, {int(nbytes)/1e6:.1f} MB; (on) answered {requests_on} requests, dropped {dropped} spans")
PY
