#!/usr/bin/env bash
# W9 (BENCHMARKS.md): many sessions on one edge process — its RSS and its idle CPU.
#
#   bash scripts/w9.sh [KCP_SESSIONS] [QUIC_SESSIONS] [KCP_PER_PROCESS] [WINDOW_S]
#   default: 90000 10000 15000 20
#
# One edge and one bench backend (`waygate bench --role backend`), then several
# `waygate bench --edge ... --mode idle` load generators against that edge: a KCP client
# holds one UDP socket per session, so each process takes KCP_PER_PROCESS sessions under a
# 20,000-file limit, each from its own loopback address (127.0.0.2, .3, ...: one address has
# ~28,000 ephemeral ports); QUIC sessions share client sockets and fit in one process. Once the
# edge holds every session (its `waygate_sessions_live` gauge), the script reads the edge's
# CPU time over WINDOW_S seconds and its RSS from /proc. Sessions send one ECHO each, then
# only heartbeats (the edge's default 10 s PING interval). Needs a release build
# (cargo build --release -p waygate). Loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/target/release/waygate
[ -x "$bin" ] || { echo "build first: cargo build --release -p waygate" >&2; exit 2; }
KCP=${1:-90000}
QUIC=${2:-10000}
PER=${3:-15000}
WINDOW=${4:-20}
ulimit -n 20000
dir=$(mktemp -d /tmp/waygate-w9.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${W9_KEEP:-}" ] && echo "kept $dir" || rm -rf "$dir"
}
trap cleanup EXIT

# A port free for TCP (backend, admin) or UDP (kcp, quic) now; bound by the edge a moment later.
free_port() {
  python3 -c "import socket, sys; s = socket.socket(type=socket.SOCK_$1); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}
backend_port=$(free_port STREAM)
admin_port=$(free_port STREAM)
kcp_port=$(free_port DGRAM)
quic_port=$(free_port DGRAM)
[ $(( (KCP + PER - 1) / PER )) -le 250 ] || { echo "at most 250 KCP generators (127.0.0.2-251)" >&2; exit 2; }

"$bin" bench --role backend --listen "127.0.0.1:$backend_port" --push-rate 0 --payload 64 \
  > "$dir/backend.log" 2>&1 &
pids+=($!)
cat > "$dir/routes.toml" <<EOF
epoch = 1
updated_at = 0
[[services]]
name = "player"
messages = [[1000, 1999]]
key = "player"
  [[services.instances]]
  id = "b1"
  address = "127.0.0.1:$backend_port"
EOF
cat > "$dir/edge.toml" <<EOF
edge_id = "w9-edge"
[routing]
table = "$dir/routes.toml"
[tls]
dev_ca_out = "$dir/ca.pem"
[admin]
addr = "127.0.0.1:$admin_port"
[listeners.tcp]
enabled = false
addr = "127.0.0.1:0"
[listeners.tls]
enabled = false
addr = "127.0.0.1:0"
[listeners.ws]
enabled = false
addr = "127.0.0.1:0"
[listeners.wss]
enabled = false
addr = "127.0.0.1:0"
[listeners.kcp]
addr = "127.0.0.1:$kcp_port"
[listeners.quic]
addr = "127.0.0.1:$quic_port"
[kcp]
max_sessions = $((KCP + 1000))
[backpressure]
accept_per_sec = 1000000
accept_burst = 100000
accept_per_source_per_sec = 1000000
accept_per_source_burst = 100000
max_handshakes = 100000
max_sessions = 1000000
EOF
sleep 0.5
"$bin" run --config "$dir/edge.toml" > "$dir/edge.out" 2> "$dir/edge.log" &
edge=$!
pids+=($edge)
up=
for _ in $(seq 1 100); do
  if [ -s "$dir/ca.pem" ] && curl -sf "http://127.0.0.1:$admin_port/metrics" > /dev/null; then
    up=1
    break
  fi
  sleep 0.1
done
[ -n "$up" ] || { echo "the edge did not come up in 10 s:" >&2; tail -5 "$dir/edge.log" >&2; exit 1; }
live() {
  curl -sf "http://127.0.0.1:$admin_port/metrics" | awk '/^waygate_sessions_live /{print $2}'
}
rss_kib() { awk '/^VmRSS/{print $2}' "/proc/$edge/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$edge/stat"; }
# UDP datagrams received on this host (a KCP heartbeat is three: PING, PONG, its ACK), and
# those dropped because a socket's receive buffer was full (a receiver behind): one read.
udp_counts() { awk '/^Udp:/ && $2 ~ /^[0-9]+$/ {print $2, $6}' /proc/net/snmp; }
rss0=$(rss_kib)
echo "edge pid $edge, RSS before any session: $rss0 KiB"

# Load generators, one after the other (each once the edge holds the sessions of those
# before it: connecting all at once starves them on 2 cores); they hold their sessions for
# an hour (killed at the end).
want=0
start=$(date +%s)
wait_live() {
  local since
  since=$(date +%s)
  while :; do
    got=$(live || echo 0)
    if [ "${got:-0}" -ge "$want" ]; then return 0; fi
    if [ $(( $(date +%s) - since )) -gt 180 ]; then
      echo "only ${got:-0} of $want sessions after 180 s" >&2
      for f in "$dir"/load-*.log; do tail -n 3 "$f" >&2; done
      exit 1
    fi
    sleep 1
  done
}
n=0
left=$KCP
while [ "$left" -gt 0 ]; do
  take=$(( left < PER ? left : PER ))
  "$bin" bench --edge "kcp://127.0.0.1:$kcp_port" --edge-pid "$edge" --transports kcp \
    --kcp-source-ip "127.0.0.$((n + 2))" --sessions "$take" --mode idle --warmup 0s \
    --duration 3600s --concurrency 64 > "$dir/load-kcp-$n.log" 2>&1 &
  pids+=($!)
  want=$((want + take))
  wait_live
  echo "  $want sessions live ($(( $(date +%s) - start )) s)"
  left=$((left - take))
  n=$((n + 1))
done
if [ "$QUIC" -gt 0 ]; then
  "$bin" bench --edge "quic://127.0.0.1:$quic_port" --edge-pid "$edge" --ca "$dir/ca.pem" \
    --transports quic --sessions "$QUIC" --mode idle --warmup 0s --duration 3600s \
    --concurrency 64 > "$dir/load-quic.log" 2>&1 &
  pids+=($!)
  want=$((want + QUIC))
  wait_live
fi
echo "$want sessions live after $(( $(date +%s) - start )) s; settling one heartbeat interval"
sleep 12
hz=$(getconf CLK_TCK)
t0=$(cpu_ticks)
read -r u0 d0 < <(udp_counts)
sleep "$WINDOW"
t1=$(cpu_ticks)
read -r u1 d1 < <(udp_counts)
rss1=$(rss_kib)
got=$(live || echo 0)
[ "${got:-0}" -gt 0 ] || { echo "the edge holds no session at the end" >&2; exit 1; }
awk -v t0="$t0" -v t1="$t1" -v hz="$hz" -v w="$WINDOW" -v r0="$rss0" -v r1="$rss1" \
    -v n="$got" -v k="$KCP" -v q="$QUIC" -v u0="$u0" -v u1="$u1" -v d0="$d0" -v d1="$d1" 'BEGIN {
  cpu = (t1 - t0) / hz / w * 100
  printf "W9: %d sessions live (%d KCP + %d QUIC asked)\n", n, k, q
  printf "  edge RSS %.0f MiB (%.0f MiB before any session; %.2f KiB per session)  target <= 1024 MiB\n", r1 / 1024, r0 / 1024, (r1 - r0) / n
  printf "  edge idle CPU %.1f%% of one core over %d s                              target <= 10%%\n", cpu, w
  printf "  UDP datagrams received on the host: %.0f/s (KCP heartbeats every 10 s: ~%.0f/s expected)\n", (u1 - u0) / w, k * 3 / 10
  printf "  UDP datagrams dropped on the host, receive buffer full: %.0f/s\n", (d1 - d0) / w
}'
