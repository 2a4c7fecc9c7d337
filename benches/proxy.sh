#!/usr/bin/env bash
# Side-by-side proxy benchmark on loopback, all in one run, with the same upstream for all.
#
# Default: Tollgate's cases beside nginx, one pinned core each:
#   (a) the upstream called directly (nginx `return 200`)
#   (b) Tollgate, route without limits
#   (c) Tollgate, embedded store, the demo limits (a key that stays under its plan)
#   (d) Tollgate on Redis (redis-server on loopback)
#   (l) as (d), with the key's plan spent from leased blocks (README: leased blocks), the rules
#       for a key too hot for one shard
#   (e) nginx 1.22 as a reverse proxy with limit_req (benches/nginx/limit_req.conf)
#   (h) as (c), with the express lane off (--no-express: hyper's general path for every request)
#   (m) as (c), with metering off (--no-meter); binaries without metering skip it
#
# MATRIX=full: the matrix of issue 24 instead, Tollgate, nginx and HAProxy 2.6 (stick-table +
# http_req_rate, benches/haproxy/) doing the same job in each row:
#   1  one pinned core each, logs off (plain HTTP/1.1 keep-alive, wrk)
#   2  default threads, logs off (unpinned: Tollgate's one worker per CPU, nginx
#      `worker_processes auto`, HAProxy's default nbthread; wrk -t2 unpinned)
#   3  as 2, access logs on in all three, each to a file
#   4  TLS 1.3, HTTP/1.1 keep-alive (wrk over https), one pinned core each
#   5  h2 over TLS (h2load -c CONNECTIONS -m10), one pinned core each
#   6  new TLS connections, concurrent: wrk with `Connection: close`, every connection a full
#      handshake (benches/wrk/fresh_session.c drops the session wrk would offer back)
#   7  as 6 with wrk as it is: it offers its last session back, each server resumes it or not
#   8  as 1, access logs on in all three, each to a file
#   R  Tollgate on Redis (d) ÷ embedded (c), both as in row 1
#   L  as R with the plan leased, (l) ÷ (c)
#
# Fairness: every pinned proxy gets CPU 0 alone (Tollgate with one worker thread, nginx with one
# worker process, HAProxy with one thread); the upstream, Redis and the load tool share CPU 1.
# The load tool uses the same connections, threads and keep-alive for every server of a row.
# Cases run in alternating order for ROUNDS rounds and the medians are reported, with CPU time
# per request of the proxy's processes.
#
# Usage: [TOLLGATE_BIN=path] [MATRIX=full] benches/proxy.sh [ROUNDS=5] [DURATION_S=8] [CONNECTIONS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
DUR=${2:-8}
CONNS=${3:-32}
MATRIX=${MATRIX:-}
KEY=bench-demo-key
case "$MATRIX" in
  "" | full) ;;
  *) echo "proxy.sh: MATRIX is 'full' or unset, not '$MATRIX'" >&2; exit 2 ;;
esac

need=(nginx wrk redis-server taskset python3)
[ "$MATRIX" = full ] && need+=(haproxy h2load gcc)
for bin in "${need[@]}"; do
  command -v "$bin" >/dev/null || { echo "proxy.sh needs $bin (apt-get install nginx wrk redis-server util-linux haproxy nghttp2-client gcc)" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

echo "uptime before: $(uptime)" >&2
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
start_upstream 1

# pin CPU CMD...: CMD on CPU, or unpinned when CPU is empty.
pin() { local cpu=$1; shift; if [ -n "$cpu" ]; then taskset -c "$cpu" "$@"; else "$@"; fi; }

NGX=$(port)
sed -e "s#__PORT__#$NGX#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" benches/nginx/limit_req.conf > "$work/proxy.conf"
taskset -c 0 nginx -c "$work/proxy.conf" -p "$work" & pids+=($!)
NGX_PID=$!
wait_port "$NGX"

RP=$(port)
taskset -c 1 redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no >/dev/null & pids+=($!)
wait_port "$RP"

# The rules in a directory of their own, as /etc/tollgate: the reload watch wakes for every
# write to any file beside the rules, and the access-log row writes a line a request here.
mkdir -p "$work/rules"
bench_rules "$work/rules/rules.json"
# The same rules with the plan leased: only keys at 500 a second or more may set its numbers.
mkdir -p "$work/rules-lease"
python3 - "$work/rules/rules.json" > "$work/rules-lease/rules.json" <<'PY'
import json, re, sys
rules = json.load(open(sys.argv[1]))
rules["limits"]["plan"]["lease"] = {"block": "auto"}
def per_s(rate):
    n, d = re.fullmatch(r"(\d+)/(\d*)s", rate).groups()
    return int(n) / int(d or 1)
rules["keys"] = [k for k in rules["keys"] if per_s(k["limits"]["plan"]["rate"]) >= 500]
json.dump(rules, sys.stdout)
PY
# Binaries since metering write usage records; keep them in the scratch directory.
METER=()
if "$TG" serve --help | grep -q -- --no-meter; then METER=(yes); fi
# start_tg NAME [ARGS...]; TG_PIN (CPU, default 0; empty: unpinned), TG_THREADS (default 1;
# empty: Tollgate's default), TG_LOG (TOLLGATE_LOG, default warn: no access lines) and TG_RULES
# (default the rules above) may be set for the call. Stderr, where the access lines go, is $work/NAME.err.
start_tg() {
  local name=$1; shift
  local p; p=$(port)
  local extra=()
  [ ${#METER[@]} -gt 0 ] && extra+=(--meter-file "$work/$name-usage.db")
  local threads=${TG_THREADS-1} cpu=${TG_PIN-0} taskset=()
  [ -n "$threads" ] && extra+=(--threads "$threads")
  # Not through `pin`: $! must be Tollgate itself (taskset execs it), not a subshell.
  [ -n "$cpu" ] && taskset=(taskset -c "$cpu")
  TOLLGATE_LOG=${TG_LOG:-warn} "${taskset[@]}" "$TG" serve --rules "${TG_RULES:-$work/rules/rules.json}" --listen "127.0.0.1:$p" "${extra[@]}" "$@" \
    >"$work/$name.out" 2>"$work/$name.err" & pids+=($!)
  eval "${name}_PID=$!"
  eval "${name}_PORT=$p"
  wait_port "$p"
}
start_tg mem
start_tg redis --store "redis://127.0.0.1:$RP" --store-timeout 50ms
TG_RULES=$work/rules-lease/rules.json start_tg lease --store "redis://127.0.0.1:$RP" --store-timeout 50ms

# workers MASTER: nginx's master forks the workers; their CPU is the proxy's.
workers() { sleep 0.3; pgrep -P "$1" | tr '\n' ' '; }

# One case: URL, processes whose CPU is the proxy's, the load tool (wrk: keep-alive; close: a
# new connection per request, full handshakes on TLS; resume: the same, wrk offering its last
# session back; h2: h2load), the CPU the load runs on (empty: unpinned), wrk threads and the
# access log file whose lines are counted.
declare -A URL PIDS TOOL LOADCPU THREADS LOGF
def_case() { # id tool load-cpu wrk-threads url pids [log-file]
  TOOL[$1]=$2; LOADCPU[$1]=$3; THREADS[$1]=$4; URL[$1]=$5; PIDS[$1]=$6; LOGF[$1]=${7:-}
}

if [ "$MATRIX" = full ]; then
  cat certs/demo-cert.pem certs/demo-key.pem > "$work/demo.pem"
  gcc -O2 -shared -fPIC -o "$work/fresh_session.so" benches/wrk/fresh_session.c -ldl

  # Pinned (rows 1, 4-8): nginx's TLS and logging instance beside the plain one above, HAProxy
  # with all four listeners, Tollgate's TLS listener (h2 and HTTP/1.1 by ALPN) and a logging one.
  NGX_TLS=$(port); NGX_H2=$(port); NGX_PL=$(port)
  sed -e "s#__TLS_PORT__#$NGX_TLS#" -e "s#__H2_PORT__#$NGX_H2#" -e "s#__LOG_PORT__#$NGX_PL#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#" \
    -e "s#__CERT__#$PWD/certs/demo-cert.pem#" -e "s#__KEY__#$PWD/certs/demo-key.pem#" benches/nginx/tls.conf > "$work/tls.conf"
  taskset -c 0 nginx -c "$work/tls.conf" -p "$work" & pids+=($!)
  NGX_TLS_PID=$!
  wait_port "$NGX_TLS"
  HAP=$(port); HAP_TLS=$(port); HAP_H2=$(port); HAP_PL=$(port)
  sed -e "s#__PORT__#$HAP#" -e "s#__TLS_PORT__#$HAP_TLS#" -e "s#__H2_PORT__#$HAP_H2#" -e "s#__LOG_PORT__#$HAP_PL#" \
    -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__PEM__#$work/demo.pem#g" benches/haproxy/pinned.cfg > "$work/haproxy-pinned.cfg"
  haproxy -c -q -f "$work/haproxy-pinned.cfg"
  taskset -c 0 haproxy -db -f "$work/haproxy-pinned.cfg" >"$work/haproxy-pinned-access.log" 2>"$work/haproxy-pinned.err" & pids+=($!)
  HAP_PID=$!
  wait_port "$HAP"
  start_tg tls --tls-cert certs/demo-cert.pem --tls-key certs/demo-key.pem

  # Default threads (rows 2, 3), unpinned; one instance of nginx and of HAProxy serves both rows
  # on two ports, one logging and one not.
  NGX_T=$(port); NGX_TL=$(port)
  sed -e "s#__PORT__#$NGX_T#" -e "s#__LOG_PORT__#$NGX_TL#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" -e "s#__DIR__#$work#g" \
    benches/nginx/threads.conf > "$work/threads.conf"
  nginx -c "$work/threads.conf" -p "$work" & pids+=($!)
  NGX_T_PID=$!
  wait_port "$NGX_T"
  HAP_T=$(port); HAP_TL=$(port)
  sed -e "s#__PORT__#$HAP_T#" -e "s#__LOG_PORT__#$HAP_TL#" -e "s#__UPSTREAM__#127.0.0.1:$UP#" \
    benches/haproxy/threads.cfg > "$work/haproxy-threads.cfg"
  haproxy -c -q -f "$work/haproxy-threads.cfg"
  haproxy -db -f "$work/haproxy-threads.cfg" >"$work/haproxy-access.log" 2>"$work/haproxy-threads.err" & pids+=($!)
  HAP_T_PID=$!
  wait_port "$HAP_T"
  TG_PIN='' TG_THREADS='' start_tg thr
  # Row 3 logs nginx's own `combined` line in all three where the binary can (since
  # `--access-log-format`); older binaries write their event line (TOLLGATE_LOG=info).
  if "$TG" serve --help | grep -q -- --access-log-format; then
    TG_PIN='' TG_THREADS='' start_tg thrlog --access-log-format combined
    start_tg pinlog --access-log-format combined
  else
    TG_PIN='' TG_THREADS='' TG_LOG=info start_tg thrlog
    TG_LOG=info start_tg pinlog
  fi

  NW=$(workers "$NGX_PID"); NTW=$(workers "$NGX_TLS_PID"); NTHW=$(workers "$NGX_T_PID")
  O=/v1/orders
  def_case 1t wrk 1 1 "http://127.0.0.1:$mem_PORT$O" "$mem_PID"
  def_case 1n wrk 1 1 "http://127.0.0.1:$NGX$O" "$NW"
  def_case 1h wrk 1 1 "http://127.0.0.1:$HAP$O" "$HAP_PID"
  def_case 1d wrk 1 1 "http://127.0.0.1:$redis_PORT$O" "$redis_PID"
  def_case 1l wrk 1 1 "http://127.0.0.1:$lease_PORT$O" "$lease_PID"
  def_case 2t wrk '' 2 "http://127.0.0.1:$thr_PORT$O" "$thr_PID"
  def_case 2n wrk '' 2 "http://127.0.0.1:$NGX_T$O" "$NTHW"
  def_case 2h wrk '' 2 "http://127.0.0.1:$HAP_T$O" "$HAP_T_PID"
  def_case 3t wrk '' 2 "http://127.0.0.1:$thrlog_PORT$O" "$thrlog_PID" "$work/thrlog.err"
  def_case 3n wrk '' 2 "http://127.0.0.1:$NGX_TL$O" "$NTHW" "$work/nginx-access.log"
  def_case 3h wrk '' 2 "http://127.0.0.1:$HAP_TL$O" "$HAP_T_PID" "$work/haproxy-access.log"
  def_case 8t wrk 1 1 "http://127.0.0.1:$pinlog_PORT$O" "$pinlog_PID" "$work/pinlog.err"
  def_case 8n wrk 1 1 "http://127.0.0.1:$NGX_PL$O" "$NTW" "$work/nginx-pinned-access.log"
  def_case 8h wrk 1 1 "http://127.0.0.1:$HAP_PL$O" "$HAP_PID" "$work/haproxy-pinned-access.log"
  for row in 4:wrk 5:h2 6:close 7:resume; do
    r=${row%%:*}; tool=${row#*:}
    tp=$NGX_TLS; hp=$HAP_TLS
    [ "$tool" = h2 ] && { tp=$NGX_H2; hp=$HAP_H2; }
    def_case "${r}t" "$tool" 1 1 "https://127.0.0.1:$tls_PORT$O" "$tls_PID"
    def_case "${r}n" "$tool" 1 1 "https://127.0.0.1:$tp$O" "$NTW"
    def_case "${r}h" "$tool" 1 1 "https://127.0.0.1:$hp$O" "$HAP_PID"
  done
  CASES="1t 1n 1h 1d 1l 2t 2n 2h 3t 3n 3h 4t 4n 4h 5t 5n 5h 6t 6n 6h 7t 7n 7h 8t 8n 8h"
else
  start_tg general --no-express
  CASES="a b c d e h l"
  if [ ${#METER[@]} -gt 0 ]; then
    start_tg nometer --no-meter
    CASES="a b c d e h l m"
  fi
  def_case a wrk 1 1 "http://127.0.0.1:$UP/v1/orders" ""
  def_case b wrk 1 1 "http://127.0.0.1:$mem_PORT/open" "$mem_PID"
  def_case c wrk 1 1 "http://127.0.0.1:$mem_PORT/v1/orders" "$mem_PID"
  def_case d wrk 1 1 "http://127.0.0.1:$redis_PORT/v1/orders" "$redis_PID"
  def_case e wrk 1 1 "http://127.0.0.1:$NGX/v1/orders" "$(workers "$NGX_PID")"
  def_case h wrk 1 1 "http://127.0.0.1:$general_PORT/v1/orders" "$general_PID"
  def_case l wrk 1 1 "http://127.0.0.1:$lease_PORT/v1/orders" "$lease_PID"
  if [ ${#METER[@]} -gt 0 ]; then def_case m wrk 1 1 "http://127.0.0.1:$nometer_PORT/v1/orders" "$nometer_PID"; fi
fi

# cpu_ticks PIDS: user+system ticks of those processes (all their threads), 0 for none.
cpu_ticks() { local t=0 p; for p in $1; do t=$((t + $(awk '{print $14+$15}' "/proc/$p/stat"))); done; echo "$t"; }
lines() { if [ -n "$1" ] && [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }

# load ID SECONDS: runs the case's load tool; prints req/s, p50, p99 (wrk's; "-" for h2load),
# responses, non-2xx and errors (wrk's socket errors, h2load's failed requests), tab-separated.
load() {
  local c=$1 d=$2 out
  case ${TOOL[$c]} in
    h2)
      out=$(pin "${LOADCPU[$c]}" h2load -t1 -c"$CONNS" -m10 -D "$d" -H "x-api-key: $KEY" "${URL[$c]}")
      echo "$out" | awk '
        /^finished in/ {gsub(",", "", $4); rps=$4}
        /^requests:/ {done=$6; bad=$10}
        /^status codes:/ {non2xx=$5+$7+$9}
        END {printf "%s\t-\t-\t%s\t%s\t%s\n", rps, done, non2xx, bad}'
      ;;
    *)
      local pre=() hdr=()
      [ "${TOOL[$c]}" = close ] && pre=(env LD_PRELOAD="$work/fresh_session.so")
      [ "${TOOL[$c]}" = close ] || [ "${TOOL[$c]}" = resume ] && hdr=(-H "Connection: close")
      out=$(pin "${LOADCPU[$c]}" "${pre[@]}" wrk -t"${THREADS[$c]}" -c"$CONNS" -d"${d}s" --latency -H "X-API-Key: $KEY" "${hdr[@]}" "${URL[$c]}")
      echo "$out" | awk '
        /Requests\/sec/ {rps=$2}
        /requests in/ {reqs=$1}
        $1=="50%" {p50=$2}
        $1=="99%" {p99=$2}
        /Non-2xx/ {non2xx=$5}
        /Socket errors/ {gsub(",", ""); errs=$4+$6+$8+$10}
        END {printf "%s\t%s\t%s\t%s\t%d\t%d\n", rps, p50, p99, reqs, non2xx, errs}'
      ;;
  esac
}

# Warm every path (pools, caches, TLS session caches) before measuring.
for c in $CASES; do load "$c" 2 >/dev/null; done

results="$work/results.tsv"
: > "$results"
for r in $(seq "$ROUNDS"); do
  order=$CASES; [ $((r % 2)) -eq 0 ] && order=$(echo "$CASES" | tr ' ' '\n' | tac | tr '\n' ' ')
  for c in $order; do
    before=$(cpu_ticks "${PIDS[$c]}")
    lines_before=$(lines "${LOGF[$c]}")
    got=$(load "$c" "$DUR")
    after=$(cpu_ticks "${PIDS[$c]}")
    lines_after=$(lines "${LOGF[$c]}")
    # case, round, req/s, p50, p99, responses, non-2xx, socket errors, CPU ticks, log lines
    printf '%s\t%s\t%s\t%s\t%s\n' "$c" "$r" "$got" "$((after - before))" "$((lines_after - lines_before))" >> "$results"
    echo "round $r case $c: $(echo "$got" | awk -F'\t' '{printf "%s req/s p50 %s p99 %s non-2xx %s errors %s", $1, $2, $3, $5, $6}')" >&2
  done
done
echo "uptime after: $(uptime)" >&2
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

if [ "$MATRIX" = full ]; then
  echo "Versions: $(nginx -v 2>&1 | sed 's/.*: //'), $(haproxy -v | head -1 | cut -d' ' -f1-3), Tollgate $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "($TG), wrk $(wrk -v 2>&1 | head -1 | cut -d' ' -f2), $(h2load --version), $(openssl version | cut -d' ' -f1-2), kernel $(uname -r)."
  echo "Load average (1, 5, 15 min): $LOAD_BEFORE before, $LOAD_AFTER after."
  echo
  python3 - "$results" "$ROUNDS" "$DUR" "$CONNS" <<'PY'
import sys, statistics
# case, round, req/s, p50, p99, responses, non-2xx, errors, CPU ticks, log lines
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
rounds, dur, conns = sys.argv[2], sys.argv[3], sys.argv[4]
hz = 100  # USER_HZ
def runs(c):
    return sorted((r for r in rows if r[0] == c), key=lambda r: int(r[1]))
def rps(c):
    return statistics.median(float(r[2]) for r in runs(c))
def cpu(c):
    v = [int(r[8]) / hz * 1e6 / int(r[5]) for r in runs(c) if int(r[5]) > 0]
    return statistics.median(v) if v else float("nan")
def per_round(a, b):
    return [float(x[2]) / float(y[2]) for x, y in zip(runs(a), runs(b))]
def fmt(xs):
    return ", ".join(f"{x:.2f}" for x in xs)
# row, what, load, goal ÷ nginx (None: no goal)
table = [
    ("1", "1 core each, logs off", f"wrk -t1 -c{conns}, keep-alive", 1.05),
    ("2", "default threads, logs off", f"wrk -t2 -c{conns}, unpinned", 1.05),
    ("3", "default threads, access logs on in all three", f"wrk -t2 -c{conns}, unpinned", 1.05),
    ("4", "TLS 1.3, HTTP/1.1 keep-alive, 1 core", f"wrk -t1 -c{conns} https", 1.05),
    ("5", "h2 over TLS, 1 core", f"h2load -t1 -c{conns} -m10", 1.05),
    ("6", "new TLS connections/s, full handshakes, 1 core", f"wrk -c{conns} `Connection: close`", 1.0),
    ("7", "new TLS connections/s, session offered back, 1 core", f"wrk -c{conns} `Connection: close`", None),
    ("8", "1 core each, access logs on in all three", f"wrk -t1 -c{conns}, keep-alive", 1.05),
]
print(f"Rounds: {rounds} × {dur} s per case, alternating order; medians of rounds.\n")
print("| row | load | Tollgate req/s | nginx req/s | HAProxy req/s | ÷ nginx | ÷ HAProxy | goal | ÷ nginx per round | ÷ HAProxy per round |")
print("|---|---|---:|---:|---:|---:|---:|---|---|---|")
for row, what, tool, goal in table:
    t, n, h = rps(row + "t"), rps(row + "n"), rps(row + "h")
    if goal is None:
        verdict = "– (not a goal row)"
    else:
        missed = []
        if t / n < goal: missed.append(f"÷ nginx < {goal:.2f}")
        if t / h < 1.0: missed.append("÷ HAProxy < 1.00")
        verdict = "met" if not missed else "missed (" + "; ".join(missed) + ")"
    print(f"| {row}. {what} | {tool} | {t:,.0f} | {n:,.0f} | {h:,.0f} | {t/n:.2f} | {t/h:.2f} | {verdict} "
          f"| {fmt(per_round(row + 't', row + 'n'))} | {fmt(per_round(row + 't', row + 'h'))} |")
d, c = rps("1d"), rps("1t")
verdict = "met" if d / c >= 0.8 else "missed (< 0.80)"
print(f"| R. Redis (d) ÷ embedded (c), 1 core | wrk -t1 -c{conns} | (d) {d:,.0f} | | | | | "
      f"{verdict}: (d) ÷ (c) = {d/c:.2f} | (d) ÷ (c) per round: {fmt(per_round('1d', '1t'))} | |")
l = rps("1l")
verdict = "met" if l / c >= 0.8 else "missed (< 0.80)"
print(f"| L. Redis, plan leased (l) ÷ embedded (c), 1 core | wrk -t1 -c{conns} | (l) {l:,.0f} | | | | | "
      f"{verdict}: (l) ÷ (c) = {l/c:.2f} | (l) ÷ (c) per round: {fmt(per_round('1l', '1t'))} | |")
print("\nCPU time of the proxy's processes per response (µs), medians; non-2xx, errors and access-log")
print("lines ÷ responses summed over the rounds:\n")
print("| row | Tollgate µs | nginx µs | HAProxy µs | non-2xx T/N/H | errors T/N/H | log lines ÷ responses T/N/H |")
print("|---|---:|---:|---:|---|---|---|")
extra = [("1d", "R. Tollgate on Redis (d)", None, None), ("1l", "L. Tollgate on Redis, plan leased (l)", None, None)]
for row, what, _, _ in table + extra:
    ids = [row] if row in ("1d", "1l") else [row + s for s in "tnh"]
    us = [f"{cpu(i):.1f}" for i in ids] + [""] * (3 - len(ids))
    bad = "/".join(str(sum(int(r[6]) for r in runs(i))) for i in ids)
    errs = "/".join(str(sum(int(r[7]) for r in runs(i))) for i in ids)
    logs = "/".join(f"{sum(int(r[9]) for r in runs(i)) / max(1, sum(int(r[5]) for r in runs(i))):.2f}" for i in ids) if row in ("3", "8") else "–"
    print(f"| {what if row in ('1d', '1l') else row + '. ' + what} | {' | '.join(us)} | {bad} | {errs} | {logs} |")
PY
  exit 0
fi

python3 - "$results" "$ROUNDS" "$DUR" "$CONNS" <<'PY'
import sys, statistics
rows = [l.rstrip('\n').split('\t') for l in open(sys.argv[1])]
# case, round, req/s, p50, p99, responses, non-2xx, errors, CPU ticks, log lines
rows = [[r[0], r[2], r[3], r[4], r[8], r[5], r[6]] for r in rows]
rounds, dur, conns = sys.argv[2], sys.argv[3], sys.argv[4]
names = {"a": "(a) upstream direct", "b": "(b) Tollgate, no limits", "c": "(c) Tollgate, embedded, demo limits",
         "d": "(d) Tollgate, Redis", "e": "(e) nginx limit_req",
         "h": "(h) as (c), express lane off", "l": "(l) as (d), plan leased", "m": "(m) as (c), metering off"}
def ms(v):
    if v.endswith("us"): return float(v[:-2]) / 1000
    if v.endswith("ms"): return float(v[:-2])
    if v.endswith("s"): return float(v[:-1]) * 1000
    return float(v)
hz = 100  # USER_HZ
med = {}
cases = [c for c in "abcdehlm" if any(r[0] == c for r in rows)]
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
dl = [(float(d[1]) / float(c[1]), float(l[1]) / float(c[1])) for c, d, l in
      zip(*([r for r in rows if r[0] == k] for k in "cdl"))]
print(f"Redis ÷ embedded per round, (d) ÷ (c): {', '.join(f'{x:.3f}' for x, _ in dl)}; (l) ÷ (c): {', '.join(f'{y:.3f}' for _, y in dl)}")
if "m" in med:
    cm = sorted(float(c[1]) / float(m[1]) for c, m in zip([r for r in rows if r[0] == "c"], [r for r in rows if r[0] == "m"]))
    print(f"metering on ÷ off, (c) ÷ (m) = {med['c'][0]/med['m'][0]:.3f}; per round: {', '.join(f'{x:.3f}' for x in cm)}")
PY
