#!/usr/bin/env bash
# Instructions per request of one or more Tollgate binaries, counted by callgrind: the figure
# that stays steady on a noisy machine, for comparing two builds (two commits, say).
#
# Each binary serves `GET /v1/orders` with the bench key (rules/bench.json, embedded store, one
# thread) in front of nginx's `return 200`, under wrk -t1 -c8 for SECONDS; the binary's user
# space instructions (callgrind's total) are divided by the requests wrk completed.
#
# Usage: benches/callgrind.sh SECONDS BINARY [BINARY ...]   e.g.
#   benches/callgrind.sh 8 /tmp/tollgate-before target/release/tollgate
#   benches/callgrind.sh 8 target/release/tollgate --no-express   (flags after a binary apply to it)
#   UPSTREAM_IPS="127.0.0.1 127.0.0.2 127.0.0.3" benches/callgrind.sh 8 BINARY   (three targets)
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=$1; shift
for bin in nginx wrk valgrind python3; do
  command -v "$bin" >/dev/null || { echo "callgrind.sh needs $bin (apt-get install nginx wrk valgrind)" >&2; exit 1; }
done

. benches/lib.sh
start_upstream
bench_rules "$work/rules.json"

# Binaries, each followed by its own flags.
runs=(); cur=""
for a in "$@"; do
  if [[ "$a" == --* ]]; then cur="$cur $a"; else [ -n "$cur" ] && runs+=("$cur"); cur="$a"; fi
done
[ -n "$cur" ] && runs+=("$cur")

echo "| binary | flags | requests | instructions / request |"
echo "|---|---|---:|---:|"
n=0
for run in "${runs[@]}"; do
  read -r bin flags <<<"$run"
  n=$((n + 1))
  p=$(port)
  out="$work/cg.$n"
  # Run in the scratch directory, where a binary with metering writes its usage file.
  bin=$(realpath "$bin")
  env -C "$work" TOLLGATE_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" serve \
    --rules "$work/rules.json" --listen "127.0.0.1:$p" --threads 1 $flags >/dev/null 2>"$work/err.$n" &
  vg=$!
  wait_port "$p"
  # Warm the pools, zero the counters, then measure: start-up and warm-up are not counted.
  wrk -t1 -c8 -d1s -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$p/v1/orders" >/dev/null
  callgrind_control -z "$vg" >/dev/null 2>&1
  reqs=$(wrk -t1 -c8 -d"${DUR}s" -H "X-API-Key: bench-demo-key" "http://127.0.0.1:$p/v1/orders" | awk '/requests in/ {print $1}')
  kill -INT "$vg"; wait "$vg" 2>/dev/null || true
  total=$(cat "$out"* | awk '/^summary:/ {s += $2} END {print s}')
  # CALLGRIND_KEEP=DIR keeps each run's profile for callgrind_annotate.
  if [ -n "${CALLGRIND_KEEP:-}" ]; then mkdir -p "$CALLGRIND_KEEP"; cp "$out" "$CALLGRIND_KEEP/callgrind.out.$n"; fi
  # The dump at exit holds what ran since the zeroing: the measured requests and shutdown.
  python3 -c "print(f'| {\"$bin\"} | {\"$flags\".strip() or \"-\"} | {int(\"$reqs\"):,} | {int(\"$total\") / int(\"$reqs\"):,.0f} |')"
done
