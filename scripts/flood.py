#!/usr/bin/env python3
"""Hostile load against a separate edge process on this host (stdlib only).

Starts its own target edge (`waygate run --ephemeral-ports`, which must not be the edge under
test) and, until killed or for --seconds:

- holds --half-open TCP connections that sent 3 bytes of a frame header and then nothing;
- churns TCP connections that send garbage frames and are closed at once;
- floods the KCP and QUIC UDP ports with random datagrams as fast as one core allows.

The point is the load on the shared host (CPU, softirq, socket memory), not the target: run
it beside `waygate demo --edges 3` (scripts/demo-under-load.sh) to check that nothing is lost
while the machine is busy with an attack on a neighbour.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def start_target(waygate: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [waygate, "run", "--edge-id", "flood-target", "--ephemeral-ports"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.time() + 30
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        try:
            ready = json.loads(line)
        except ValueError:
            continue
        if ready.get("event") == "ready":
            return proc, ready["listeners"]
    proc.kill()
    sys.exit("flood: the target edge did not start")


def hostport(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


async def half_open(addr: tuple[str, int], count: int, stop: float) -> int:
    held = []
    for _ in range(count):
        try:
            _, w = await asyncio.open_connection(*addr)
            w.write(b"\x00\x00\x10")  # a frame header promising more, never sent
            held.append(w)
        except OSError:
            await asyncio.sleep(0.05)
    while time.time() < stop:
        await asyncio.sleep(0.5)
    for w in held:
        w.close()
    return len(held)


async def churn(addr: tuple[str, int], stop: float) -> int:
    n = 0
    while time.time() < stop:
        try:
            _, w = await asyncio.open_connection(*addr)
            w.write(os.urandom(64))
            await w.drain()
            w.close()
            n += 1
        except OSError:
            await asyncio.sleep(0.01)
    return n


STOP = threading.Event()


def udp_flood(addrs: list[tuple[str, int]], stop: float) -> int:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in addrs]
    for s in socks:
        s.setblocking(False)
    junk = [os.urandom(random.randint(20, 1200)) for _ in range(64)]
    n = 0
    while time.time() < stop and not STOP.is_set():
        for s, a in zip(socks, addrs):
            try:
                s.sendto(junk[n % 64], a)
                n += 1
            except (BlockingIOError, OSError):
                pass
    return n


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waygate", default="target/release/waygate")
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--half-open", type=int, default=2000)
    args = ap.parse_args()
    proc, listeners = start_target(args.waygate)
    stop = time.time() + args.seconds

    loop = asyncio.get_running_loop()
    this = asyncio.current_task()

    def terminate() -> None:
        # SIGTERM (the runner's trap): stop the flood thread and cancel the flood, which
        # falls through to `finally` and kills the target edge.
        STOP.set()
        if this is not None:
            this.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    try:
        tcp = hostport(listeners["tcp"])
        udp = [hostport(listeners[k]) for k in ("kcp", "quic") if k in listeners]
        flood = loop.run_in_executor(None, udp_flood, udp, stop)
        held, churned, sent = await asyncio.gather(
            half_open(tcp, args.half_open, stop), churn(tcp, stop), flood
        )
        print(f"flood: {held} half-open, {churned} churned connections, {sent} datagrams")
    except asyncio.CancelledError:
        print("flood: stopped by SIGTERM")
    finally:
        STOP.set()
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
