#!/usr/bin/env bash
# Checks formatting and lints, then runs every test. Installs redis-server (and the other servers the tests start) with apt-get
# when missing, then runs cargo test. The tests start and stop their own servers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v node >/dev/null 2>&1 || need+=(nodejs)
# The dashboard's test drives a real headless browser.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
  echo "tests/run.sh: installing ${need[*]} with apt-get" >&2
  if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The house rules first: formatting and lints fail the run before any test does.
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The fuzz targets are a workspace of their own (.fuzz/) that only cargo-fuzz runs: check that
# they still build, in the main target directory so the shared crates are not built twice.
CARGO_TARGET_DIR=target cargo check --quiet --manifest-path .fuzz/Cargo.toml --bins
cargo test --workspace --all-targets "$@"
