#!/usr/bin/env bash
# Runs `waygate demo --edges 3 --duration 30s` RUNS times (default 10) while
# scripts/flood.py attacks a separate edge process on the same host, and prints each
# verdict. Scale-out issue: nothing may be lost or late while a neighbour is attacked.
# Needs a release build (cargo build --release -p waygate) and redis-server on the PATH.
set -u
cd "$(dirname "$0")/.."
runs=${1:-10}
bin=target/release/waygate
[ -x "$bin" ] || { echo "build first: cargo build --release -p waygate" >&2; exit 2; }
python3 scripts/flood.py --waygate "$bin" --seconds 36000 &
flood=$!
trap 'kill $flood 2>/dev/null; wait $flood 2>/dev/null' EXIT
sleep 3
failed=0
for i in $(seq 1 "$runs"); do
  out=$("$bin" demo --edges 3 --duration 30s 2>/dev/null)
  rc=$?
  echo "run $i (rc $rc): $(printf '%s\n' "$out" | grep -E '^(PASS|FAIL)')"
  printf '%s\n' "$out" | tail -25 > "/tmp/demo-under-load-$i.txt"
  [ $rc -eq 0 ] || failed=$((failed + 1))
done
echo "$failed of $runs runs failed (each run's summary in /tmp/demo-under-load-N.txt)"
[ $failed -eq 0 ]
