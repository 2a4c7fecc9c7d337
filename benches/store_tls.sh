#!/usr/bin/env bash
# What TLS to the store costs a check: one redis-server listening both plain (port) and with TLS
# (tls-port, a CA made here with openssl), two gateways on the same rules and upstream, one on
# redis:// and one on rediss://, each driven by wrk in turn, ROUNDS times. Prints requests a
# second through each, and redis-server's and the gateway's CPU per request, side by side.
#
# Usage: benches/store_tls.sh SECONDS ROUNDS [CONNECTIONS]   e.g. benches/store_tls.sh 10 3 32
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=$1 ROUNDS=$2 CONNS=${3:-32}
for bin in nginx wrk redis-server openssl python3; do
  command -v "$bin" >/dev/null || { echo "store_tls.sh needs $bin (apt-get install nginx wrk redis-server openssl)" >&2; exit 1; }
done

. benches/lib.sh
tollgate_bin
start_upstream
bench_rules "$work/rules.json"

# A CA and a server certificate for 127.0.0.1.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=bench-ca \
  -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 \
  -keyout "$work/server.key" -out "$work/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\n' > "$work/san.ext"
openssl x509 -req -in "$work/server.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" -CAcreateserial \
  -days 2 -extfile "$work/san.ext" -out "$work/server.pem" 2>/dev/null

RP=$(port) RT=$(port)
redis-server --port "$RP" --tls-port "$RT" --tls-cert-file "$work/server.pem" \
  --tls-key-file "$work/server.key" --tls-ca-cert-file "$work/ca.pem" --tls-auth-clients no \
  --save '' --appendonly no --dir "$work" --logfile "$work/redis.log" & pids+=($!)
REDIS=$!
wait_port "$RP"; wait_port "$RT"

start_gateway() { # NAME STORE [FLAGS…]: a gateway on a free port; sets PORT_NAME
  local name=$1 store=$2; shift 2
  local p; p=$(port)
  "$TG" serve --rules "$work/rules.json" --listen "127.0.0.1:$p" --store "$store" \
    --store-timeout 100ms --no-meter --threads 1 "$@" >"$work/$name.log" 2>&1 & pids+=($!)
  eval "PID_$name=$!"
  wait_port "$p"
  eval "PORT_$name=$p"
}
start_gateway plain "redis://127.0.0.1:$RP"
start_gateway tls "rediss://127.0.0.1:$RT" --store-ca "$work/ca.pem"
grep -h "store found" "$work/plain.log" "$work/tls.log" | sed 's/.*store=/  /'

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rate() { sed -n 's/^Requests\/sec: *//p'; }
echo "| round | store | requests/s | redis-server CPU µs / request | gateway CPU µs / request |"
echo "|---|---|---:|---:|---:|"
for r in $(seq "$ROUNDS"); do
  for name in plain tls; do
    p=$(eval echo "\$PORT_$name") gw=$(eval echo "\$PID_$name")
    before=$(cpu "$REDIS") gw_before=$(cpu "$gw")
    out=$(wrk -t1 -c"$CONNS" -d"${DUR}s" -H 'Authorization: Bearer bench-demo-key' "http://127.0.0.1:$p/v1/orders")
    after=$(cpu "$REDIS") gw_after=$(cpu "$gw")
    rps=$(echo "$out" | rate)
    total=$(echo "$out" | sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
    tick=$(getconf CLK_TCK)
    us=$(python3 -c "print(f'{($after-$before)/$tick*1e6/max($total,1):.2f}')")
    gw_us=$(python3 -c "print(f'{($gw_after-$gw_before)/$tick*1e6/max($total,1):.2f}')")
    echo "| $r | $name | $rps | $us | $gw_us |"
  done
done
