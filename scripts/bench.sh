#!/usr/bin/env bash
# Benchmarks of issue 8 (see BENCHMARKS.md). Not part of scripts/test.sh.
#
#   scripts/bench.sh install          # idempotent: haproxy, perf (Debian)
#   scripts/bench.sh build            # release build of the waygate binary
#   scripts/bench.sh w1|w2|w2push|w3|w4|w5|w6|w7 [extra waygate bench options]
#   scripts/bench.sh all              # every workload, then the criterion suite
#   scripts/bench.sh criterion        # sans-IO hot paths (codec, route, session, backpressure, channels)
#   scripts/bench.sh perf             # perf profile of the edge under W2-like TCP echo load
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
  cargo bench -p waygate-routing --bench route -- "${CRIT[@]}"
  cargo bench -p waygate-transport --bench backpressure -- "${CRIT[@]}"
  cargo bench -p waygate-session --bench machine -- "${CRIT[@]}"
  cargo bench -p waygate-channels --bench hub -- "${CRIT[@]}"
}

# Edge + bench backend started by hand (pinned), 500 sessions x 20 msg/s over TCP from
# `waygate bench --edge`, `perf record -g` on the edge for 5 s; reports in $OUT/perf-*.txt.
perf_edge() {
  mkdir -p "$OUT"
  local d; d=$(mktemp -d)
  taskset -c 0 "$BIN" bench --role backend > "$d/b.out" 2> "$d/b.err" & local bp=$!
  for _ in $(seq 100); do grep -q ready "$d/b.out" 2>/dev/null && break; sleep 0.1; done
  local ba; ba=$(grep -o '"backend":"[^"]*"' "$d/b.out" | cut -d'"' -f4)
  printf 'epoch = 1\nupdated_at = 0\n[[services]]\nname = "player"\nmessages = [[1000, 1999]]\nkey = "player"\n  [[services.instances]]\n  id = "b1"\n  address = "%s"\n' "$ba" > "$d/routes.toml"
  printf 'edge_id = "perf-edge"\n[routing]\ntable = "%s"\n' "$d/routes.toml" > "$d/edge.toml"
  taskset -c 1 "$BIN" run --config "$d/edge.toml" --ephemeral-ports > "$d/e.out" 2> "$d/e.err" & local ep=$!
  for _ in $(seq 100); do grep -q ready "$d/e.out" 2>/dev/null && break; sleep 0.1; done
  local tcp; tcp=$(grep -o '"tcp":"[^"]*"' "$d/e.out" | cut -d'"' -f4)
  taskset -c 0 "$BIN" bench --edge "tcp://$tcp" --edge-pid "$ep" --sessions 500 --rate 20 \
    --duration 8s --warmup 2s & local lp=$!
  sleep 4
  perf record -F 999 -g -p "$ep" -o "$d/perf.data" -- sleep 5 2>/dev/null
  wait "$lp" || true
  perf report -i "$d/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null | grep '%' > "$OUT/perf-dso.txt"
  perf report -i "$d/perf.data" --no-children --sort symbol --stdio -g none 2>/dev/null | grep '%' | head -60 > "$OUT/perf-self.txt"
  perf report -i "$d/perf.data" --children --sort symbol --stdio -g none 2>/dev/null | grep '%' | head -60 > "$OUT/perf-children.txt"
  kill "$ep" "$bp"; wait 2>/dev/null || true
  rm -rf "$d"
  head -5 "$OUT/perf-dso.txt"
}

cmd="${1:-all}"; shift || true
case "$cmd" in
  install) install ;;
  build) build ;;
  w1|w2|w2push|w3|w4|w5|w6|w7|fanout) install; [ -x "$BIN" ] || build; workload "$cmd" "$@" ;;
  criterion) criterion ;;
  perf) install; [ -x "$BIN" ] || build; perf_edge ;;
  all)
    install; build
    for w in w1 w2 w2push w3 w4 w5 w6 w7 fanout; do workload "$w" "$@"; done
    criterion ;;
  *) echo "usage: $0 install|build|w1..w7|w2push|criterion|perf|all [waygate bench options]" >&2; exit 2 ;;
esac
