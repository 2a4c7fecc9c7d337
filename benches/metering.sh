#!/usr/bin/env bash
# How many usage records the fleet writes, against how hard it is driven: N gateways on one
# redis-server, each flushing every INTERVAL, under a light load and then a heavy one (wrk,
# one key). Records per second should follow N ÷ INTERVAL per key that moved, whatever the
# request rate.
#
# Usage: [TOLLGATE_BIN=path] benches/metering.sh [GATEWAYS=20] [SECONDS=20] [INTERVAL_S=5]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
DUR=${2:-20}
INTERVAL=${3:-5}
KEY=bench-demo-key
for bin in nginx wrk redis-server redis-cli python3; do
  command -v "$bin" >/dev/null || { echo "metering.sh needs $bin" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

start_upstream
RP=$(port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no >/dev/null & pids+=($!)
wait_port "$RP"
bench_rules "$work/rules.json"

ports=()
for i in $(seq "$N"); do
  p=$(port)
  TOLLGATE_LOG=warn "$TG" serve --rules "$work/rules.json" --listen "127.0.0.1:$p" --threads 1 \
    --store "redis://127.0.0.1:$RP" --store-timeout 50ms --instance "gw-$i" \
    --meter-interval "${INTERVAL}s" >/dev/null 2>"$work/gw-$i.err" & pids+=($!)
  ports+=("$p")
done
for p in "${ports[@]}"; do wait_port "$p"; done

# Drives every gateway at once with CONNS connections each for DUR seconds; prints the
# requests made and the records the stream gained meanwhile.
run() {
  local conns=$1 before after reqs=0 outs=()
  before=$(redis-cli -p "$RP" XLEN tollgate:usage)
  for p in "${ports[@]}"; do
    wrk -t1 -c"$conns" -d"${DUR}s" -H "X-API-Key: $KEY" "http://127.0.0.1:$p/v1/orders" > "$work/wrk.$p" &
    outs+=($!)
  done
  wait "${outs[@]}"
  after=$(redis-cli -p "$RP" XLEN tollgate:usage)
  for p in "${ports[@]}"; do
    reqs=$((reqs + $(awk '/requests in/ {print $1}' "$work/wrk.$p")))
  done
  printf '| %s | %s | %.0f | %s | %.2f |\n' "$conns" "$reqs" "$(echo "$reqs / $DUR" | bc -l)" \
    "$((after - before))" "$(echo "($after - $before) / $DUR" | bc -l)"
}

echo "$N gateways, one key, --meter-interval ${INTERVAL}s, ${DUR} s per load:"
echo
echo "| connections per gateway | requests | req/s | records written | records/s |"
echo "|---:|---:|---:|---:|---:|"
run 1
run 8
echo
echo "expected: $N gateways ÷ ${INTERVAL} s = $(echo "$N / $INTERVAL" | bc -l | sed 's/0*$//;s/\.$//') records/s for the one key"
