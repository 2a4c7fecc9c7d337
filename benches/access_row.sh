#!/usr/bin/env bash
# proxy.sh's row 8 alone, for several Tollgate builds at once: one pinned core each, access lines
# on in all (nginx `combined` with `buffer=64k flush=1s`, benches/nginx/access_log.conf; Tollgate
# `--access-log-format FORMAT`, default combined, stderr to a file), wrk -t1 -cCONNECTIONS
# keep-alive. Every proxy gets CPU 0 (Tollgate with one worker thread, nginx one worker); the
# upstream (nginx `return 200`) and wrk share CPU 1. The cases run in alternating order for ROUNDS
# rounds; each Tollgate's ratio to nginx is taken per round (the two ran back to back) and its
# median reported, with CPU time per response and access lines per response. OFF=1 adds row 1
# beside it, the same servers with no access log (nginx-off, NAME-off), to tell what the lines
# cost from what the proxying does.
#
# Usage: [TOLLGATE_BINS="name=path ..."] [FORMAT=combined|json] [OFF=1] benches/access_row.sh [ROUNDS=5] [DURATION_S=8] [CONNECTIONS=32]
#   e.g. TOLLGATE_BINS="before=/tmp/tollgate-before after=target/release/tollgate" benches/access_row.sh 5 8 32
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
DUR=${2:-8}
CONNS=${3:-32}
FORMAT=${FORMAT:-combined}
KEY=bench-demo-key
for bin in nginx wrk taskset python3; do
  command -v "$bin" >/dev/null || { echo "access_row.sh needs $bin (apt-get install nginx wrk util-linux)" >&2; exit 1; }
done
. benches/lib.sh
if [ -z "${TOLLGATE_BINS:-}" ]; then
  tollgate_bin
  TOLLGATE_BINS="tollgate=$TG"
fi

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
start_upstream 1
NGX=$(port)
sed -e "s#__PORT__#$NGX#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/access_log.conf > "$work/access.conf"
taskset -c 0 nginx -c "$work/access.conf" -p "$work" & pids+=($!)
NGX_PID=$!
wait_port "$NGX"
sleep 0.3
# nginx's master forks the worker; its CPU is the proxy's.
NGX_W=$(pgrep -P "$NGX_PID" | tr '\n' ' ')
OFF=${OFF:-}
if [ -n "$OFF" ]; then
  NGX_OFF=$(port)
  sed -e "s#__PORT__#$NGX_OFF#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/limit_req.conf > "$work/off.conf"
  taskset -c 0 nginx -c "$work/off.conf" -p "$work" & pids+=($!)
  NGX_OFF_PID=$!
  wait_port "$NGX_OFF"
  sleep 0.3
fi

# The rules in a directory of their own: the reload watch wakes for every write beside them.
mkdir -p "$work/rules"
bench_rules "$work/rules/rules.json"
declare -A URL PIDS LOGF
URL[nginx]="http://127.0.0.1:$NGX/v1/orders"; PIDS[nginx]=$NGX_W; LOGF[nginx]="$work/nginx-access.log"
CASES="nginx"
if [ -n "$OFF" ]; then
  URL[nginx-off]="http://127.0.0.1:$NGX_OFF/v1/orders"; PIDS[nginx-off]=$(pgrep -P "$NGX_OFF_PID" | tr '\n' ' '); LOGF[nginx-off]=/dev/null
  CASES="$CASES nginx-off"
fi
# start_tg NAME BINARY [ARGS...]: one Tollgate on CPU 0, one worker thread, stderr to a file.
start_tg() {
  local name=$1 bin=$2; shift 2
  local p; p=$(port)
  local meter=()
  if "$bin" serve --help | grep -q -- --no-meter; then meter=(--meter-file "$work/$name-usage.db"); fi
  TOLLGATE_LOG=warn taskset -c 0 "$bin" serve --rules "$work/rules/rules.json" --listen "127.0.0.1:$p" --threads 1 \
    "${meter[@]}" "$@" >"$work/$name.out" 2>"$work/$name.err" & pids+=($!)
  URL[$name]="http://127.0.0.1:$p/v1/orders"; PIDS[$name]=$!; LOGF[$name]="$work/$name.err"
  CASES="$CASES $name"
  wait_port "$p"
}
for nb in $TOLLGATE_BINS; do
  name=${nb%%=*}; bin=$(realpath "${nb#*=}")
  start_tg "$name" "$bin" --access-log-format "$FORMAT"
  if [ -n "$OFF" ]; then start_tg "$name-off" "$bin"; fi
done

cpu_ticks() { local t=0 p; for p in $1; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
# load CASE SECONDS: req/s and responses, tab-separated.
load() {
  taskset -c 1 wrk -t1 -c"$CONNS" -d"$2s" -H "X-API-Key: $KEY" "${URL[$1]}" |
    awk '/Requests\/sec/ {rps=$2} /requests in/ {n=$1} /Non-2xx/ {bad=$5} END {printf "%s\t%s\t%d\n", rps, n, bad}'
}
for c in $CASES; do load "$c" 2 >/dev/null; done
results="$work/results.tsv"
: > "$results"
for r in $(seq "$ROUNDS"); do
  order=$CASES; [ $((r % 2)) -eq 0 ] && order=$(echo "$CASES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    before=$(cpu_ticks "${PIDS[$c]}"); lb=$(wc -l < "${LOGF[$c]}")
    got=$(load "$c" "$DUR")
    # Lines still buffered (nginx's flush=1s, Tollgate's 10 ms batches) land before counting.
    sleep 1.1
    after=$(cpu_ticks "${PIDS[$c]}"); la=$(wc -l < "${LOGF[$c]}")
    printf '%s\t%s\t%s\t%s\t%s\n' "$c" "$r" "$got" "$((after - before))" "$((la - lb))" >> "$results"
    echo "round $r $c: $(cut -f1 <<<"$got") req/s" >&2
  done
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
echo "Load average (1, 5, 15 min): $LOAD_BEFORE before, $LOAD_AFTER after. Rounds: $ROUNDS × $DUR s, wrk -t1 -c$CONNS, access lines $FORMAT."
echo
python3 - "$results" $CASES <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
cases = sys.argv[2:]
def runs(c):
    return sorted((r for r in rows if r[0] == c), key=lambda r: int(r[1]))
print("| proxy | access log | req/s (median) | ÷ nginx per round | ÷ nginx (median of rounds) | CPU µs / response | lines ÷ responses | non-2xx |")
print("|---|---|---:|---|---:|---:|---:|---:|")
for c in cases:
    rs = runs(c)
    # Each against nginx with the same logging: a server with its log off beside nginx's off.
    off = c.endswith("-off")
    ratios = [float(x[2]) / float(y[2]) for x, y in zip(rs, runs("nginx-off" if off else "nginx"))]
    cpu = statistics.median(int(r[5]) / 100 * 1e6 / int(r[3]) for r in rs)
    lines = sum(int(r[6]) for r in rs) / sum(int(r[3]) for r in rs)
    print(f"| {c} | {'off' if off else 'on'} | {statistics.median(float(r[2]) for r in rs):,.0f} | {', '.join(f'{x:.2f}' for x in ratios)} "
          f"| {statistics.median(ratios):.2f} | {cpu:.1f} | {lines:.2f} | {sum(int(r[4]) for r in rs)} |")
PY
