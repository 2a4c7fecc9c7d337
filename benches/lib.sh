# Shared by the benchmark scripts (sourced, not run): a scratch directory removed on exit with
# every process started into `pids`, free loopback ports, and the nginx `return 200` upstream.

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Waits up to 20 s: under valgrind a server takes seconds to start listening.
wait_port() { for _ in $(seq 400); do (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; sleep 0.05; done; echo "nothing listens on $1" >&2; exit 1; }

# start_upstream [CPU]: nginx answering 200 on a free port, pinned to CPU when given; sets UP.
# With UPSTREAM_IPS (say "127.0.0.1 127.0.0.2 127.0.0.3") it listens on that port of each, and
# bench_rules makes each a target of the upstream.
start_upstream() {
  UP=$(port)
  local listens=""
  for ip in ${UPSTREAM_IPS:-127.0.0.1}; do listens="${listens}listen $ip:$UP reuseport backlog=4096; "; done
  sed -e "s#listen 127.0.0.1:__PORT__ reuseport backlog=4096;#$listens#" -e "s#__DIR__#$work#" \
    benches/nginx/upstream.conf > "$work/upstream.conf"
  if [ -n "${1:-}" ]; then
    taskset -c "$1" nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
  else
    nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
  fi
  wait_port "$UP"
}

# bench_rules DEST: rules/bench.json with its upstream pointed at the one start_upstream started.
bench_rules() {
  sed "s#http://127.0.0.1:8081#http://127.0.0.1:$UP#" rules/bench.json > "$1"
  if [ "$(echo ${UPSTREAM_IPS:-127.0.0.1} | wc -w)" -gt 1 ]; then
    python3 - "$1" "$UP" ${UPSTREAM_IPS} <<'PY'
import json, sys
path, port, ips = sys.argv[1], sys.argv[2], sys.argv[3:]
rules = json.load(open(path))
for u in rules["upstreams"].values():
    u.pop("url")
    u["targets"] = [{"url": f"http://{ip}:{port}"} for ip in ips]
json.dump(rules, open(path, "w"), indent=2)
PY
  fi
}

# tollgate_bin: sets TG, the binary a benchmark measures: TOLLGATE_BIN (a build made elsewhere,
# another commit's say), else this tree's release build, built now.
tollgate_bin() {
  if [ -n "${TOLLGATE_BIN:-}" ]; then
    TG=$TOLLGATE_BIN
  else
    cargo build --release --bin tollgate >&2
    TG=target/release/tollgate
  fi
}
