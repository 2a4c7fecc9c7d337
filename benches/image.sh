#!/usr/bin/env bash
# Builds the Dockerfile's image with podman on a machine with no Docker daemon and no container
# registry, runs it, and checks what the README says of it:
#   - the base images are made from Debian's package mirror when missing: debian:bookworm-slim
#     by mmdebstrap (minbase, without docs, man pages and locales, as Docker's slim image), and
#     rust:1-bookworm as that plus a C toolchain and this machine's Rust toolchain;
#   - `podman build` of the Dockerfile as the README's `docker build -t tollgate .` runs it;
#   - `tollgate --version` prints the version Cargo.toml gives;
#   - the README's `docker run … tollgate demo` serves the demo's curl transcript: 200, 429 once
#     the burst is spent, 401 for an unknown key;
#   - the HEALTHCHECK command passes inside the container while the gateway runs;
#   - the gateway runs as uid 10001 on a read-only root, writing only its working directory, and
#     says which flag moves its files when that directory is not writable;
#   - SIGTERM drains and exits 0 within the Kubernetes manifest's grace (55 s);
#   - what the Dockerfile adds to its runtime base, which must stay under 25 MB.
# Servers listen on 127.0.0.1, on ports the OS picks. Run as root (apt-get, podman, mounts):
#   benches/image.sh            # IMAGE=localhost/tollgate:latest, as `podman build -t tollgate`
# `test && ok … || fail …` throughout: ok never fails, so fail runs only when the test does.
# shellcheck disable=SC2015
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/tollgate:latest}
SLIM=docker.io/library/debian:bookworm-slim
RUST=docker.io/library/rust:1-bookworm
TOOLCHAIN=${TOOLCHAIN:-$(rustc --print sysroot 2>/dev/null || echo /root/.rustup/toolchains/stable-x86_64-unknown-linux-gnu)}
LIMIT_MB=25
GRACE_S=55   # the manifest's terminationGracePeriodSeconds,
PRESTOP_S=5  # less its preStop sleep: what is left for the process after SIGTERM

die() { echo "image.sh: $*" >&2; exit 1; }
step() { echo "== $*"; }

[ "$(id -u)" = 0 ] || die "run as root: podman builds here as root, and the checks mount the image"

work=$(mktemp -d /tmp/tollgate-image.XXXXXX)
containers=()
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT

missing=()
for tool in podman buildah mmdebstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]}"
  { apt-get update -q && apt-get install -y "${missing[@]}"; } >"$work/apt.log" 2>&1 \
    || { tail -20 "$work/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
fi
for tool in curl unshare readelf file; do command -v "$tool" >/dev/null || die "needs $tool"; done

# The runtime base: Debian's minbase, slimmed as Docker's debian:*-slim is, from whatever mirror
# this machine's apt uses (mmdebstrap reads its sources when given no mirror). The merged-/usr
# hook does what debootstrap does; without it mmdebstrap installs usrmerge, and with it perl.
if ! podman image exists "$SLIM"; then
  step "making $SLIM with mmdebstrap"
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
    bookworm "$work/slim.tar" >"$work/mmdebstrap.log" 2>&1 \
    || { tail -20 "$work/mmdebstrap.log" >&2; die "mmdebstrap bookworm failed"; }
  podman import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$work/slim.tar" "$SLIM" >"$work/import.log" 2>&1 \
    || { cat "$work/import.log" >&2; die "podman import of $SLIM failed"; }
  rm -f "$work/slim.tar"
fi

# The builder: the slim base, a C toolchain for the crates that build C (jemalloc, SQLite), and
# the Rust toolchain this machine has, since no registry serves the official rust image here.
if ! podman image exists "$RUST"; then
  step "making $RUST from $SLIM and $TOOLCHAIN"
  [ -x "$TOOLCHAIN/bin/cargo" ] || die "no cargo in $TOOLCHAIN (set TOOLCHAIN to a Rust toolchain's directory)"
  c=$(buildah from --pull-never "$SLIM") || die "buildah from $SLIM failed"
  containers+=("$c")
  buildah run --isolation chroot --network host "$c" -- sh -c \
    'apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev make cmake perl pkg-config ca-certificates && rm -rf /var/lib/apt/lists/*' \
    >"$work/builder.log" 2>&1 || { tail -20 "$work/builder.log" >&2; die "apt-get in the builder failed"; }
  buildah copy "$c" "$TOOLCHAIN" /usr/local/rust >/dev/null || die "copying $TOOLCHAIN into the builder failed"
  # This machine's bundle: it is the one that reaches crates.io from here.
  buildah copy "$c" /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt >/dev/null
  buildah config --env PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env CARGO_HOME=/usr/local/cargo "$c"
  buildah commit -q "$c" "$RUST" >/dev/null || die "buildah commit $RUST failed"
fi

# Docker's image format: OCI's has no HEALTHCHECK, and podman would drop it.
step "podman build --format docker -t $IMAGE ."
start=$(date +%s)
podman rmi -i "$IMAGE" >/dev/null 2>&1 || true
podman build --format docker --isolation chroot --network host --pull=never -t "$IMAGE" . \
  >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; die "podman build failed (log above)"; }
podman image exists "$IMAGE" || { tail -20 "$work/build.log" >&2; die "podman build made no $IMAGE"; }
echo "built in $(($(date +%s) - start)) s"

# What the image says of itself, for running it the way a container runtime would.
inspect() { podman image inspect --format "$1" "$IMAGE"; }
IMG_USER=$(inspect '{{.Config.User}}')
WORKDIR=$(inspect '{{.Config.WorkingDir}}')
mapfile -t IMG_ENV < <(inspect '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t ENTRY < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t HEALTH < <(inspect '{{range .Config.Healthcheck.Test}}{{println .}}{{end}}' | sed '/^$/d')
[ "${HEALTH[0]:-}" = CMD ] || die "the image has no HEALTHCHECK in exec form: ${HEALTH[*]:-none}"
HEALTH=("${HEALTH[@]:1}")

# `podman run` fails here (crun cannot set RLIMIT_NOFILE, and cgroups are in hybrid mode), and
# `buildah run` has no read-only root. So each run is what a runtime does, by hand: the image's
# files mounted read-only as /, /proc and /dev, a host directory on the working directory as the
# VOLUME (or the manifest's emptyDir) would be, the image's environment only, its user, its
# working directory, its entrypoint; the host's network, as `--network host`.
c=$(buildah from --pull-never "$IMAGE") || die "buildah from $IMAGE failed"
containers+=("$c")
IMG_ROOT=$(buildah mount "$c") || die "buildah mount $c failed"
mkdir "$work/root"

# volume NAME: a fresh directory owned as the image's working directory is, as a new volume is.
volume() {
  local dir="$work/$1"
  mkdir "$dir"
  chown "$(stat -c %u:%g "$IMG_ROOT$WORKDIR")" "$dir"
  echo "$dir"
}

# image_cmd [-v SRC:DST[:ro]]… [VAR=value…] -- CMD…: sets RUN to the command line that runs CMD
# in the image (its entrypoint's arguments, or with --exec a command of its own, as HEALTHCHECK
# runs), SRC bind-mounted on DST. One simple command, so that `"${RUN[@]}" &` gives the gateway's
# own pid to signal: unshare, sh, chroot and env each exec the next.
image_cmd() {
  local binds=() vars=() cmd=()
  while [ "$1" = -v ]; do binds+=("$2"); shift 2; done
  while [ "$1" != -- ]; do vars+=("$1"); shift; done
  shift
  if [ "${1:-}" = --exec ]; then shift; cmd=("$@"); else cmd=("${ENTRY[@]}" "$@"); fi
  # shellcheck disable=SC2016 # expanded by the inner sh
  RUN=(unshare --mount --propagation private -- sh -euc '
    root=$1 img=$2 wd=$3 user=$4 binds=$5
    shift 5
    mount --bind "$img" "$root"
    mount -o remount,bind,ro "$root"
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    for b in $binds; do
      src=${b%%:*} rest=${b#*:}
      dst=${rest%%:*}
      mount --bind "$src" "$root$dst"
      case $rest in *:ro) mount -o remount,bind,ro "$root$dst" ;; esac
    done
    exec chroot --userspec="$user" "$root" /usr/bin/env -i -C "$wd" "$@"' \
    sh "$work/root" "$IMG_ROOT" "$WORKDIR" "$IMG_USER" "${binds[*]}" "${IMG_ENV[@]}" "${vars[@]}" "${cmd[@]}")
}
in_image() { image_cmd "$@"; "${RUN[@]}"; }

# start NAME [in_image's arguments]: a gateway from the image in the background, on ports the
# OS picks; sets PID, ADDR (public) and ADMIN.
start() {
  local name=$1 out
  shift
  out="$work/$name.out"
  : >"$out"
  image_cmd "$@"
  "${RUN[@]}" >"$out" 2>"$work/$name.err" &
  PID=$!
  pids+=("$PID")
  ADDR="" ADMIN=""
  for _ in $(seq 200); do
    ADDR=$(sed -n 's#^tollgate listening on http://\([^ ]*\).*#\1#p' "$out")
    ADMIN=$(sed -n 's#^admin listening on http://\([^ ]*\).*#\1#p' "$out")
    [ -n "$ADDR" ] && [ -n "$ADMIN" ] && return 0
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
  done
  cat "$work/$name.out" "$work/$name.err" >&2
  die "$name: the gateway did not start listening"
}

ok() { echo "ok   $*"; }
fail() { echo "FAIL $*" >&2; failed=1; }
failed=0
LOOPBACK=(TOLLGATE_LISTEN=127.0.0.1:0 TOLLGATE_ADMIN_LISTEN=127.0.0.1:0)

# --version, as `docker run tollgate --version` runs it.
want=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
got=$(in_image -- --version) || die "tollgate --version failed in the image"
[[ "$got" == *"$want"* ]] && ok "tollgate --version: $got" || fail "tollgate --version says '$got', Cargo.toml $want"

# The process: the image's user, root read-only, the working directory writable.
[ "$IMG_USER" = 10001:10001 ] && ok "USER $IMG_USER" || fail "the image's USER is '$IMG_USER', not 10001:10001"
id=$(in_image -- --exec id -u)
[ "$id" = 10001 ] && ok "runs as uid $id" || fail "runs as uid $id"
if in_image -- --exec touch /probe 2>/dev/null; then fail "the root filesystem is writable"; else ok "root filesystem read-only"; fi

# The README's `docker run -p 8080:8080 tollgate demo`, on loopback ports the OS picks.
data=$(volume demo-data)
start demo -v "$data:$WORKDIR" "${LOOPBACK[@]}" -- demo
BASE="http://$ADDR"
ok "demo listening on $ADDR, admin $ADMIN"
code() { curl -s -o "$work/body" -w '%{http_code}' "$@" || true; }
K7=(-H 'Authorization: Bearer k7-demo-key')
curl -s -i "${K7[@]}" "$BASE/v1/orders" -o "$work/first"
grep -q '^HTTP/1.1 200' "$work/first" && grep -qi '^ratelimit: "plan-burst";r=19;t=1' "$work/first" \
  && ok "k7-demo-key: 200, ratelimit r=19 of the burst of 20" \
  || { cat "$work/first" >&2; fail "the demo's first order is not 200 with r=19"; }
# One curl, one connection: the README's loop of 25 curls, but quick enough that the refill (a
# token every 100 ms) does not keep up with it on a loaded machine.
burst=()
for _ in $(seq 25); do burst+=(-o /dev/null "$BASE/v1/orders"); done
codes=$(curl -s -w '%{http_code} ' "${K7[@]}" "${burst[@]}")
[[ "$codes" == 200* && "$codes" == *429* ]] \
  && ok "25 more orders: $codes" || fail "25 more orders, no 429: $codes"
c=$(code "${K7[@]}" "$BASE/v1/orders")
[ "$c" = 429 ] && grep -q '"error":"rate_limited","limit":"plan"' "$work/body" \
  && ok "then 429 $(cat "$work/body")" || fail "after the burst: $c $(cat "$work/body")"
c=$(code -H 'Authorization: Bearer wrong-key' "$BASE/v1/orders")
[ "$c" = 401 ] && grep -q '"reason":"unknown_key"' "$work/body" \
  && ok "wrong-key: 401 $(cat "$work/body")" || fail "wrong-key: $c $(cat "$work/body")"

# HEALTHCHECK, inside the image while the gateway runs: the image's command and environment, the
# admin address being the one the OS picked where the image says 0.0.0.0:9090.
if in_image "TOLLGATE_ADMIN_LISTEN=$ADMIN" -- --exec "${HEALTH[@]}" >"$work/health" 2>&1; then
  ok "HEALTHCHECK ${HEALTH[*]}: passes"
else
  fail "HEALTHCHECK ${HEALTH[*]} failed: $(cat "$work/health")"
fi
files=$(cd "$data" && echo *)
[ -e "$data/tollgate-usage.db" ] && ok "the embedded store's files in $WORKDIR: $files" \
  || fail "no tollgate-usage.db in the working directory: $files"

# SIGTERM with a request in flight, under the Kubernetes manifest's settings: /readyz fails,
# the request finishes, the process exits 0 within terminationGracePeriodSeconds less preStop.
kill "$PID"; wait "$PID" 2>/dev/null || true
data=$(volume drain-data)
start drain -v "$data:$WORKDIR" "${LOOPBACK[@]}" TOLLGATE_SHUTDOWN_DELAY=5s TOLLGATE_DRAIN_TIMEOUT=30s \
  TOLLGATE_UPGRADE_GRACE=10s -- demo
curl -s -o "$work/slow" -w '%{http_code}' "${K7[@]}" "http://$ADDR/v1/slow?ms=8000" >"$work/slow.code" &
slow=$!
sleep 0.5
t0=$(date +%s%N)
kill -TERM "$PID"
sleep 0.5
r=$(code "http://$ADMIN/readyz")
[ "$r" = 503 ] && ok "after SIGTERM /readyz: 503 $(cat "$work/body")" || fail "after SIGTERM /readyz: $r"
timeout "$((GRACE_S - PRESTOP_S))" tail --pid="$PID" -f /dev/null || kill -KILL "$PID" 2>/dev/null || true
rc=0
wait "$PID" || rc=$?
took_ms=$((($(date +%s%N) - t0) / 1000000))
wait "$slow" || true
[ "$(cat "$work/slow.code")" = 200 ] && ok "the request in flight (8 s) finished: 200" \
  || fail "the request in flight got $(cat "$work/slow.code")"
took="$((took_ms / 1000)).$((took_ms % 1000 / 100)) s"
left=$((GRACE_S - PRESTOP_S))
if [ "$rc" = 0 ] && [ "$took_ms" -lt $((left * 1000)) ]; then
  ok "SIGTERM: exit 0 after $took, within the $left s the $GRACE_S s grace leaves after preStop"
else
  fail "SIGTERM: exit $rc after $took ($left s left of the $GRACE_S s grace after preStop)"
fi

# No writable working directory (the read-only root with no volume, or no emptyDir): the gateway
# refuses to start and names what moves its files.
image_cmd "${LOOPBACK[@]}" -- demo
"${RUN[@]}" >/dev/null 2>"$work/ro.err" &
PID=$!
pids+=("$PID")
timeout 20 tail --pid="$PID" -f /dev/null || true
if kill -0 "$PID" 2>/dev/null; then
  fail "the gateway started with nowhere to write"
  kill "$PID"
elif grep -q 'TOLLGATE_METER_FILE' "$work/ro.err"; then
  ok "unwritable $WORKDIR: exits, saying $(grep -o -m1 'name a file.*' "$work/ro.err")"
else
  cat "$work/ro.err" >&2; fail "unwritable $WORKDIR: the error does not name TOLLGATE_METER_FILE"
fi

# The README's first `docker run`: the repository's rules/ mounted over /etc/tollgate.
data=$(volume serve-data)
start serve -v "$data:$WORKDIR" -v "$PWD/rules:/etc/tollgate:ro" "${LOOPBACK[@]}" -- serve
r=$(code "http://$ADMIN/readyz")
grep -q "from /etc/tollgate/demo.json" "$work/serve.out" && [ "$r" = 200 ] \
  && ok "serve on the mounted rules/: $(sed -n 's/^tollgate listening.*(\(.*\))$/\1/p' "$work/serve.out"), /readyz 200" \
  || fail "serve on the mounted rules/: /readyz $r, $(cat "$work/serve.out")"
c=$(code -H 'Authorization: Bearer wrong-key' "http://$ADDR/v1/orders")
[ "$c" = 401 ] && ok "serve: wrong-key 401" || fail "serve: wrong-key $c"
kill "$PID"; wait "$PID" 2>/dev/null || true

# Size: what the Dockerfile adds to its runtime base, layer by layer.
mb() { echo "$(($1 / 1000000)).$(($1 / 100000 % 10)) MB"; }
base_bytes=$(podman image inspect --format '{{.Size}}' "$SLIM")
image_bytes=$(inspect '{{.Size}}')
added=$((image_bytes - base_bytes))
echo "-- layers of $IMAGE over $SLIM (podman history)"
podman history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | head -n "$(($(podman history -q "$IMAGE" | wc -l) - $(podman history -q "$SLIM" | wc -l)))" \
  | sed -e 's/\/bin\/sh -c #(nop) //' -e 's/^/   /' | cut -c1-100
bin_bytes=$(stat -c %s "$IMG_ROOT/usr/local/bin/tollgate")
echo "   binary $(mb "$bin_bytes") ($(file -b "$IMG_ROOT/usr/local/bin/tollgate" | grep -o 'not stripped\|stripped')," \
  "needs $(readelf -d "$IMG_ROOT/usr/local/bin/tollgate" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' '))"
echo "   base $SLIM $(mb "$base_bytes"), image $(mb "$image_bytes")"
if [ "$added" -le $((LIMIT_MB * 1000000)) ]; then
  ok "the Dockerfile adds $(mb "$added") to its base (limit $LIMIT_MB MB)"
else
  fail "the Dockerfile adds $(mb "$added") to its base, over $LIMIT_MB MB"
fi

[ "$failed" = 0 ] || die "some checks failed (FAIL above)"
echo "all checks passed"
