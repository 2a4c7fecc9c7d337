#!/usr/bin/env bash
# Keys made through the admin API at scale, through real gateways on the embedded store: the
# resident memory one such key costs (the VmRSS of a gateway started on a keys file of N keys,
# less that of one started on an empty file, ÷ N), how long a gateway takes to load them, and
# how long one more key takes to make through the API with N already there. The keys file is
# filled directly (the form `tollgate_keys::sqlite` writes), each key with its own tenant and
# its own `plan` numbers, as partners made one by one would have.
#
# Usage: [TOLLGATE_BIN=path] benches/managed_keys.sh [KEYS=100000] [CREATES=5]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100000}
CREATES=${2:-5}
for bin in python3 curl; do
  command -v "$bin" >/dev/null || { echo "managed_keys.sh needs $bin" >&2; exit 1; }
done
. benches/lib.sh
tollgate_bin

fill() { # fill FILE N
  python3 - "$1" "$2" <<'EOF'
import hashlib, json, sqlite3, sys
path, n = sys.argv[1], int(sys.argv[2])
db = sqlite3.connect(path)
db.execute("CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, record TEXT NOT NULL, generation INTEGER NOT NULL UNIQUE)")
at = "2026-12-01T00:00:00Z"
def rec(i):
    return {"id": f"k_{i:08d}", "tenant": f"t{i:08d}", "name": None,
            "limits": {"plan": {"rate": "600/60s", "burst": 20}}, "expires_at": None, "revoked": False,
            "secrets": [{"hash": hashlib.sha256(f"bench-secret-{i}".encode()).hexdigest(), "created_at": at, "not_after": None}],
            "created_at": at, "updated_at": at}
db.executemany("INSERT INTO api_keys VALUES (?, ?, ?)", ((f"k_{i:08d}", json.dumps(rec(i)), i + 1) for i in range(n)))
db.commit()
EOF
}

printf 'an-admin-token-for-the-bench\n' > "$work/token"
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }

start() { # start NAME N: a gateway on a keys file of N keys; sets ADMIN_<NAME>, PID_<NAME>, LOAD_<NAME>
  fill "$work/$1-keys.db" "$2"
  local t0; t0=$(date +%s.%N)
  "$TG" demo --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --threads 1 \
    --admin-token-file "$work/token" --keys-file "$work/$1-keys.db" --meter-file "$work/$1-usage.db" \
    >"$work/$1.out" 2>"$work/$1.err" & pids+=($!)
  local pid=$!
  for _ in $(seq 1200); do grep -q 'admin listening on' "$work/$1.out" && break; sleep 0.05; done
  grep -q 'admin listening on' "$work/$1.out" || { cat "$work/$1.err" >&2; exit 1; }
  local t1; t1=$(date +%s.%N)
  printf -v "ADMIN_$1" '%s' "$(grep -o 'admin listening on http://[0-9.:]*' "$work/$1.out" | sed 's/admin listening on //')"
  printf -v "PID_$1" '%s' "$pid"
  printf -v "LOAD_$1" '%s' "$(python3 -c "print(round($t1 - $t0, 2))")"
}

start empty 0
start full "$N"
sleep 12 # the allocator returns what loading used and no longer holds
rss_empty=$(rss_kib "$PID_empty"); rss_full=$(rss_kib "$PID_full")

creates=()
for i in $(seq "$CREATES"); do
  t=$(curl -s -o /dev/null -w '%{time_total}' -H 'Authorization: Bearer an-admin-token-for-the-bench' \
    -X POST "$ADMIN_full/admin/keys" -d "{\"tenant\": \"new-$i\", \"limits\": {\"plan\": {\"rate\": \"600/60s\", \"burst\": 20}}}")
  creates+=("$t")
done

python3 - "$N" "$rss_empty" "$rss_full" "$LOAD_empty" "$LOAD_full" "${creates[@]}" <<'EOF'
import statistics, sys
n, empty, full = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
load_empty, load_full = float(sys.argv[4]), float(sys.argv[5])
creates = [float(x) for x in sys.argv[6:]]
print(f"keys made through the admin API: {n}")
print(f"resident: {empty} KiB empty, {full} KiB with them: {(full - empty) * 1024 / n:.0f} bytes a key")
print(f"start: {load_empty} s empty, {load_full} s with them")
print(f"one more key made through the API: median {statistics.median(creates) * 1000:.0f} ms ({', '.join(f'{c * 1000:.0f}' for c in creates)} ms)")
EOF
