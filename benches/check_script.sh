#!/usr/bin/env bash
# Instructions redis-server spends per call of lua/check.lua, counted by callgrind: the figure
# that stays steady on a noisy machine, for comparing the script at a git revision with the one
# in the working tree. Each shape is 2,000 EVALSHA calls, one at a time, from redis-benchmark;
# the count covers everything redis-server does for a call (reading and parsing the command,
# the script, the reply), in user space.
#
# Shapes (one bucket's rule: 1 token per ms, a burst of 100,000 tokens, never empty):
#   one        one request of one bucket
#   three      one request of three buckets
#   same8      eight requests of one bucket (one client's burst sharing a call)
#   distinct8  eight requests of one bucket each, eight buckets
# A script from before 40becc7 takes the older layout (every bucket in full, the counts first);
# the script decides which by its header. (Since 2c05d85 a blocking limit's bucket takes an 8th
# number; the shapes here block nothing.)
#
# Usage: benches/check_script.sh [REV=HEAD]
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-HEAD}
for bin in redis-server redis-cli redis-benchmark valgrind callgrind_control; do
  command -v "$bin" >/dev/null || { echo "check_script.sh needs $bin (apt-get install redis-server redis-tools valgrind)" >&2; exit 1; }
done
work=$(mktemp -d)
sock=$work/redis.sock
valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" redis-server --port 0 --unixsocket "$sock" --save '' \
  >"$work/redis.log" 2>&1 &
VG=$!
trap 'redis-cli -s "$sock" shutdown nosave >/dev/null 2>&1 || true; kill $VG 2>/dev/null || true; wait $VG 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 100); do redis-cli -s "$sock" ping >/dev/null 2>&1 && break; sleep 0.2; done

R="1000 1 100000000 1000 100000 0 0"
# args LAYOUT SHAPE: KEYS count, KEYS and ARGV of the shape in that layout (old or new).
args() {
  local layout=$1 shape=$2 keys="" pages="" argv="" i
  case $shape in
    one) echo "2 rl:{t}:a rl:page:{t} -1 1 1 $R" ;;
    three) echo "6 rl:{t}:a rl:{t}:b rl:{t}:c rl:page:{t} rl:page:{t} rl:page:{t} -1 1 3 $R $R $R" ;;
    same8)
      if [ "$layout" = new ]; then
        argv="1 1000 1 100000000 1000 100000 2 0"
        for i in $(seq 7); do argv="$argv 1 -1 1000"; done
        echo "2 rl:{t}:a rl:page:{t} -1 8 $argv"
      else
        for i in $(seq 8); do keys="$keys rl:{t}:a"; pages="$pages rl:page:{t}"; argv="$argv $R"; done
        echo "16$keys$pages -1 8 1 1 1 1 1 1 1 1$argv"
      fi ;;
    distinct8)
      for i in $(seq 8); do keys="$keys rl:{t}:b$i"; pages="$pages rl:page:{t}"; done
      if [ "$layout" = new ]; then
        for i in $(seq 8); do argv="$argv 1 $R"; done
        echo "16$keys$pages -1 8$argv"
      else
        for i in $(seq 8); do argv="$argv $R"; done
        echo "16$keys$pages -1 8 1 1 1 1 1 1 1 1$argv"
      fi ;;
  esac
}
# load TEXT: SHA and layout of a script.
load() {
  local sha layout=old
  sha=$(redis-cli -s "$sock" SCRIPT LOAD "$1")
  grep -q -- '-e            minus its place in KEYS' <<<"$1" && layout=new
  echo "$sha $layout"
}
read -r SHA_REV LAYOUT_REV < <(load "$(git show "$REV:lua/bucket.lua"; git show "$REV:lua/check.lua")")
read -r SHA_NOW LAYOUT_NOW < <(load "$(cat lua/bucket.lua lua/check.lua)")
N=2000
# count SHA LAYOUT SHAPE: instructions per call.
count() {
  local a
  read -r -a a <<<"$(args "$2" "$3")"
  callgrind_control -z "$VG" >/dev/null 2>&1
  redis-benchmark -s "$sock" -c 1 -P 1 -n "$N" EVALSHA "$1" "${a[@]}" >/dev/null 2>&1
  callgrind_control -d "$VG" >/dev/null 2>&1
  sleep 0.5
  awk -v n="$N" '/^summary:|^totals:/ {printf "%d", $2 / n; exit}' "$(ls -t "$work"/cg.* | head -1)"
}
echo "| shape | $REV ($LAYOUT_REV layout) | working tree | ratio |"
echo "|---|---:|---:|---:|"
for shape in one three same8 distinct8; do
  a=$(count "$SHA_REV" "$LAYOUT_REV" "$shape"); b=$(count "$SHA_NOW" "$LAYOUT_NOW" "$shape")
  echo "| $shape | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN {printf "%.3f", b / a}') |"
done
