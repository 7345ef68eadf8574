#!/usr/bin/env bash
# Benchmarks of issue 8 (see BENCHMARKS.md). Not part of scripts/test.sh.
#
#   scripts/bench.sh install          # idempotent: haproxy, perf (Debian)
#   scripts/bench.sh build            # release build of the waygate binary
#   scripts/bench.sh w1|w2|w2push|w3|w4|w5|w6|w7 [extra waygate bench options]
#   scripts/bench.sh all              # every workload, then the criterion suite
#   scripts/bench.sh criterion        # sans-IO hot paths (codec, route, session, backpressure)
#
# Every workload runs the targets interleaved (A B A B ...) and reports medians and ratios
# measured in the same run; JSON reports land in $OUT (default target/bench/).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
OUT="${OUT:-$CARGO_TARGET_DIR/bench}"
BIN="$CARGO_TARGET_DIR/release/waygate"
CRIT=(--warm-up-time 1 --measurement-time 3)

install() {
  local need=()
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
  command -v perf >/dev/null 2>&1 || need+=(linux-perf)
  command -v taskset >/dev/null 2>&1 || need+=(util-linux)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}"
  fi
}

build() { cargo build --release -p waygate; }

workload() {
  local w="$1"; shift
  mkdir -p "$OUT"
  echo "== $w  ($(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  # The driver pins itself (and so the load generator) to CPU 0 and the processes under
  # test to CPU 1.
  taskset -c 0 "$BIN" bench --workload "$w" --out "$OUT/$w.json" "$@"
}

criterion() {
  cargo bench -p waygate-transport --bench codec -- "${CRIT[@]}"
  cargo bench -p waygate-routing -- "${CRIT[@]}"
  cargo bench -p waygate-transport --bench backpressure -- "${CRIT[@]}"
  cargo bench -p waygate-session --bench machine -- "${CRIT[@]}"
}

cmd="${1:-all}"; shift || true
case "$cmd" in
  install) install ;;
  build) build ;;
  w1|w2|w2push|w3|w4|w5|w6|w7) install; [ -x "$BIN" ] || build; workload "$cmd" "$@" ;;
  criterion) criterion ;;
  all)
    install; build
    for w in w1 w2 w2push w3 w4 w5 w6 w7; do workload "$w" "$@"; done
    criterion ;;
  *) echo "usage: $0 install|build|w1..w7|w2push|criterion|all [waygate bench options]" >&2; exit 2 ;;
esac
