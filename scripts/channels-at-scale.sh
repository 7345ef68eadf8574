#!/usr/bin/env bash
# Channels at scale (channels issue): `waygate demo --edges 3` with CLIENTS members (default
# 3000) spread over GUILDS guild channels (default 200) plus `world`, each client sending an
# echo every INTERVAL (default 1s; a chat rides on every tenth), every transport, mixed
# classes (normal chat, one world chat in five an announcement logged in Redis), for
# DURATION (default 60s); edge 0 is killed with SIGKILL 40 % into the run and its members
# resume on the other edges. Prints the demo's summary: order violations (expected 0),
# announcements received and those recovered from the announcement log, history lost.
# WORLD_EVERY (default 2): one chat in WORLD_EVERY goes to `world` (its deliveries grow with
# the clients squared; raise it for big runs).
# Needs a release build (cargo build --release -p waygate) and redis-server on the PATH.
set -u
cd "$(dirname "$0")/.."
clients=${1:-3000}
guilds=${2:-200}
duration=${3:-60s}
interval=${4:-1s}
world_every=${5:-2}
bin=target/release/waygate
[ -x "$bin" ] || { echo "build first: cargo build --release -p waygate" >&2; exit 2; }
ulimit -n 20000 2>/dev/null || true
out=$("$bin" demo --edges 3 --clients "$clients" --guilds "$guilds" --duration "$duration" --interval "$interval" --world-every "$world_every" 2>/dev/null)
rc=$?
printf '%s\n' "$out" | tail -15
echo "clients $clients, guilds $guilds, duration $duration, interval $interval, world every $world_every: rc $rc"
exit $rc
