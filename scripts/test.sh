#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: first installs what the tests need
# (idempotently: apt packages, a Python venv with the independent interop peers), then runs
# cargo's tests. .ci/run calls exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# --- system packages -------------------------------------------------------------------
# chromium: the JS SDK's browser test (interop-tests/tests/browser_sdk.rs) drives Debian's
# /usr/bin/chromium through playwright-core; no tool ever downloads its own browser.
# etcd-server, etcd-client: the etcd control plane and its tests (the build itself needs no
# protoc: the etcd gRPC code is committed, edge-bin/vendor/etcd-client/VENDORED.md).
# redis-server: session ownership, warm snapshots and presence tests.
# prometheus: promtool checks the edge's /metrics, and a real Prometheus server scrapes an
# edge (edge-bin/tests/prometheus.rs).
# iproute2: `ss` reads the edge's socket memory (edge-bin/tests/stalled_reader.rs).
# mono-mcs (pulls mono-runtime): the C# binding's example runs on Mono against a real edge
# (client-sdk/capi/tests/csharp_example.rs).
apt_packages=(ca-certificates chromium etcd-server etcd-client redis-server redis-tools prometheus mono-mcs iproute2)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- Python venv with the independent interop peers (aioquic, websockets, kcp) ------------
venv="$root/.venv"
req="$root/interop-tests/python/requirements.txt"
if [ -f "$req" ]; then
  stamp="$venv/.requirements.sha256"
  want=$(sha256sum "$req" | cut -d' ' -f1)
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "creating Python venv for interop peers"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
    echo "$want" > "$stamp"
  fi
  export WAYGATE_PYTHON="$venv/bin/python"
fi

# --- JS SDK dev dependencies (typescript, playwright-core) from package-lock.json ----------
js="$root/client-sdk/js"
if [ -f "$js/package-lock.json" ]; then
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "node and npm are required for the JS SDK tests (Node.js 20+)" >&2
    exit 1
  fi
  stamp="$js/node_modules/.package-lock.sha256"
  want=$(sha256sum "$js/package-lock.json" | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "installing the JS SDK's npm dev dependencies"
    (cd "$js" && npm ci --no-audit --no-fund)
    echo "$want" > "$stamp"
  fi
fi

# --- the README's first command builds on a bare machine ---------------------------------
# Only the Rust toolchain and a C compiler: no protoc, no apt package. A build script that
# looked for protoc would fail here (PROTOC names a path that does not exist). On a fresh
# clone the target directory is empty, so every build script runs; the dependencies built
# here are the ones `cargo test` reuses below.
echo "checking that the edge builds without protoc"
PROTOC=/nonexistent/protoc cargo build --locked -p waygate

# --- Rust tests --------------------------------------------------------------------------
# Debug builds keep line tables only (Cargo.toml [profile.dev]): the whole suite's target
# directory is ~6 GB. The free space is printed before and after, so a full disk shows.
df -h . | tail -1 | awk '{print "disk before the tests: " $4 " free"}'
status=0
cargo test --workspace --locked --no-fail-fast "$@" || status=$?
df -h . | tail -1 | awk '{print "disk after the tests: " $4 " free"}'
exit $status
