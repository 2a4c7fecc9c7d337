#!/usr/bin/env bash
# Access lines a minute that `tollgate replay` reads and replays (benches/README.md "Replaying
# access logs"): a synthetic JSON access log of LINES lines for the demo rules, as two gateways
# would write it (each line when its request ends, so only nearly in check order): k-7, k-8 and
# k-big on GET /v1/orders, POST /v1/exports and POST /v1/completions (with the tokens the
# upstream reported), callers without a key and with a key id the rules don't know, some
# requests no limit checked. Timed: the log under rules/demo.json; the same under --against a
# copy with k-7's plan and k-big's rate tightened; the log gzipped; and the same lines in the
# combined format.
# Usage: benches/replay_logs.sh [LINES] [BINARY]   (default 2000000, target/release/tollgate)
set -euo pipefail
cd "$(dirname "$0")/.."
LINES=${1:-2000000}
BIN=$(realpath "${2:-target/release/tollgate}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp rules/demo.json rules/demo-jwks.json "$work/"

python3 - "$work" "$LINES" <<'EOF'
import json, random, sys
work, n = sys.argv[1], int(sys.argv[2])
rules = json.load(open(f"{work}/demo.json"))
for k in rules["keys"]:
    if k["id"] == "k-7":
        k["limits"]["plan"]["burst"] = 10
    if k["id"] == "k-big":
        k["limits"]["plan"] = {"rate": "5000/1s", "burst": 10000}
rules["version"] = 2
json.dump(rules, open(f"{work}/tight.json", "w"), indent=1)

random.seed(1)
# 20,000 checks a second from 22:40:00 UTC, Dec 6 2026: the log spans LINES / 20,000 seconds.
t0, step = 1765060800000000, 50
who = [("k-7", 0.05), ("k-8", 0.05), ("k-big", 0.8), (None, 0.07), ("k-404", 0.03)]
keys = [w for w, _ in who]
weights = [p for _, p in who]
routes = [("GET", "/v1/orders", 0.8), ("POST", "/v1/exports", 0.02), ("POST", "/v1/completions", 0.18)]
line = ('{"time":"2026-12-06T22:40:01.123+00:00","remote_addr":"10.0.%d.%d","remote_user":%s,'
        '"request_method":"%s","request_uri":"%s","server_protocol":"HTTP/1.1","status":%d,'
        '"body_bytes_sent":312,"http_referer":null,"http_user_agent":"curl/7.88.1",'
        '"request_id":"%016x","route":null,"limit":null,"client_ip":null,"fingerprint":"none",'
        '"latency_us":%d,"check_us":%s,"path":"%s","instance":"gw-%d","rules_version":1,'
        '"cost_reported":%s}\n')
comb = ('10.0.%d.%d - %s [06/Dec/2026:22:40:01 +0000] "%s %s HTTP/1.1" %d 312 "-" "curl/7.88.1" '
        'request_id=%016x route="-" limit="-" client_ip=- fingerprint=none latency_us=%d '
        'check_us=%s path="%s" instance=gw-%d rules_version=1 cost_reported=%s\n')
ends = []
for i in range(n):
    key = random.choices(keys, weights)[0]
    method, path, _ = random.choices(routes, [r[2] for r in routes])[0]
    check = t0 + i * step
    latency = random.randint(200, 5000)
    unchecked = random.random() < 0.01
    status = 404 if unchecked else (429 if random.random() < 0.02 else 200)
    cost = str(random.randint(1, 400)) if path == "/v1/completions" and status == 200 else "null"
    user = "null" if key is None else '"%s"' % key
    text = line % (i % 200, i % 250, user, method, path, status, i, latency,
                   "null" if unchecked else str(check), path, i % 2 + 1, cost)
    other = comb % (i % 200, i % 250, key or "-", method, path, status, i, latency,
                    "-" if unchecked else str(check), path, i % 2 + 1, "-" if cost == "null" else cost)
    ends.append((check + latency, text, other))
ends.sort(key=lambda e: e[0])
with open(f"{work}/access.log", "w") as f:
    f.writelines(e[1] for e in ends)
with open(f"{work}/combined.log", "w") as f:
    f.writelines(e[2] for e in ends)
EOF
gzip -1 -k "$work/access.log"
size=$(du -m "$work/access.log" | cut -f1)
gz=$(du -m "$work/access.log.gz" | cut -f1)
comb=$(du -m "$work/combined.log" | cut -f1)
echo "access.log: $LINES lines, $size MB ($gz MB gzipped); combined.log: $comb MB"
echo
echo "| run | elapsed | user CPU | peak RSS | lines a minute (elapsed) | lines a minute (user CPU) |"
echo "| --- | --- | --- | --- | --- | --- |"
run() {
  local name=$1 out=$2; shift 2
  /usr/bin/time -f "%e %U %M" -o "$work/time" "$BIN" replay "$@" > "$work/$out" 2> "$work/err" \
    || { echo "$name failed:" >&2; cat "$work/err" >&2; exit 1; }
  read -r elapsed user rss < "$work/time"
  awk -v n="$name" -v e="$elapsed" -v u="$user" -v r="$rss" -v l="$LINES" 'BEGIN {
    printf "| %s | %.2f s | %.2f s | %d MB | %.1f million | %.1f million |\n",
      n, e, u, r / 1024, l * 60 / e / 1e6, l * 60 / (u > 0 ? u : 0.01) / 1e6 }'
}
run "--rules demo.json" running.txt "$work/access.log" --rules "$work/demo.json"
run "--rules demo.json --against tight.json" against.txt "$work/access.log" --rules "$work/demo.json" --against "$work/tight.json"
run "access.log.gz, --rules demo.json" gz.txt "$work/access.log.gz" --rules "$work/demo.json"
run "combined.log, --rules demo.json" combined.txt "$work/combined.log" --rules "$work/demo.json"
# Both formats of the same lines must replay alike, key for key.
cmp <(sed -n '/^key /,$p' "$work/running.txt") <(sed -n '/^key /,$p' "$work/combined.txt") >/dev/null \
  || { echo "the combined log replays otherwise than the JSON one" >&2; exit 1; }
echo
echo "The --against run's summary:"
cat "$work/against.txt"
