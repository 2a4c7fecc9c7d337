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
start_upstream() {
  UP=$(port)
  sed -e "s#__PORT__#$UP#" -e "s#__DIR__#$work#" benches/nginx/upstream.conf > "$work/upstream.conf"
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
