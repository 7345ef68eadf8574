#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: first installs what the tests need
# (idempotently: apt packages, a Python venv with the independent interop peers), then runs
# cargo's tests. .ci/run calls exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# --- system packages -------------------------------------------------------------------
apt_packages=(ca-certificates redis-server redis-tools)
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

# --- Rust tests --------------------------------------------------------------------------
cargo test --workspace --locked --no-fail-fast "$@"
