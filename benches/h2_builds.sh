#!/usr/bin/env bash
# Two or more Tollgate builds side by side on h2 over TLS: each `serve --threads 1` on CPU 0
# with the demo certificate, the nginx `return 200` upstream and h2load (-t1 -c32 -m10) on CPU
# 1, the builds in turn, the order reversed every other round. Prints each round's req/s and
# the build's CPU time per response (user + system, /proc/PID/stat).
#
# LOAD=wrk runs the matrix's row 1 instead: plain HTTP/1.1 keep-alive (the express lane), wrk
# -t1 -c32 on CPU 1.
#
# Usage: [LOAD=wrk] benches/h2_builds.sh ROUNDS SECONDS BINARY [BINARY ...]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: benches/h2_builds.sh ROUNDS SECONDS BINARY [BINARY ...]" >&2; exit 2; }
ROUNDS=$1 DUR=$2; shift 2
LOAD=${LOAD:-h2}
for t in nginx taskset $([ "$LOAD" = wrk ] && echo wrk || echo h2load); do command -v "$t" >/dev/null || { echo "h2_builds.sh: needs $t" >&2; exit 1; }; done
. benches/lib.sh
start_upstream 1
mkdir -p "$work/rules"
bench_rules "$work/rules/rules.json"
KEY=bench-demo-key
declare -A PORT PID
tls=(--tls-cert certs/demo-cert.pem --tls-key certs/demo-key.pem)
[ "$LOAD" = wrk ] && tls=()
i=0
for b in "$@"; do
  p=$(port)
  TOLLGATE_LOG=warn taskset -c 0 "$b" serve --rules "$work/rules/rules.json" --listen "127.0.0.1:$p" --threads 1 \
    --meter-file "$work/usage-$i.db" "${tls[@]}" \
    >"$work/tg-$i.out" 2>"$work/tg-$i.err" & pids+=($!)
  PID[$b]=$!; PORT[$b]=$p; i=$((i + 1))
  wait_port "$p"
done
# h2 BINARY SECONDS: the load, its summary in h2load's words (wrk's turned into them).
h2() {
  if [ "$LOAD" = wrk ]; then
    taskset -c 1 wrk -t1 -c32 -d"$2s" -H "X-API-Key: $KEY" "http://127.0.0.1:${PORT[$1]}/v1/orders" |
      awk '/requests in/ {n = $1} /Non-2xx/ {bad = $NF} /Requests\/sec/ {r = $2}
        END {print "finished in x, " r " req/s"; print "requests: x x x x x x " n; print "status codes: " n - bad}'
  else
    taskset -c 1 h2load -t1 -c32 -m10 -D "$2" -H "x-api-key: $KEY" "https://127.0.0.1:${PORT[$1]}/v1/orders"
  fi
}
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
for b in "$@"; do h2 "$b" 2 >/dev/null; done
echo -e "round\tbinary\treq/s\t2xx\tresponses\tCPU µs per response"
for r in $(seq "$ROUNDS"); do
  order=("$@"); [ $((r % 2)) -eq 0 ] && mapfile -t order < <(printf '%s\n' "$@" | tac)
  for b in "${order[@]}"; do
    t0=$(ticks "${PID[$b]}")
    out=$(h2 "$b" "$DUR")
    t1=$(ticks "${PID[$b]}")
    rps=$(echo "$out" | awk '/^finished in/ {gsub(",", "", $4); print $4}')
    done_=$(echo "$out" | awk '/^requests:/ {print $8}')
    ok=$(echo "$out" | awk '/^status codes:/ {print $3}')
    us=$(awk -v t="$((t1 - t0))" -v n="$done_" -v hz="$(getconf CLK_TCK)" 'BEGIN {printf "%.1f", n ? t * 1e6 / hz / n : 0}')
    echo -e "$r\t$b\t$rps\t$ok\t$done_\t$us"
  done
done
