"""An independent waygate client, written from PROTOCOL.md, run against an *echo* server (every
frame sent comes back on the same connection).

    python waygate_peer.py --transport tcp|tls|ws|wss|quic|kcp --addr 127.0.0.1:PORT
                           [--ca dev-ca.pem] [--server-name localhost] [--max-frame 65536]
    python waygate_peer.py --selftest

Per transport it
  1. connects and sends a scripted sequence of frames of every type and class, sizes from 0
     to exactly the max frame size, and checks that the echoes decode to the same frames and
     are byte-for-byte the bytes sent (the §1.1 trailing-bytes case excepted), arriving in
     order per channel (§2.4: per QUIC stream; datagrams unordered);
  2. sends CLOSE and checks that the server sends nothing more and ends the transport;
  3. on fresh connections, sends malformed input and checks the server answers CLOSE with
     protocol_error (100), frame_too_large (101) or text_message (106), then closes.

  4. KCP only: the cookie exchange rules seen from outside (short HELLO ignored, 42-byte
     COOKIE, forged CONNECT dropped, RESET(conv, 1) for a segment of no session).

The KCP part follows PROTOCOL.md §8.
It prints one JSON line with the results and exits 1 on any mismatch (2 on bad usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import ssl
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import waygate_proto as wp

OP_TIMEOUT = 10.0  # any single wait
CLOSE_TIMEOUT = 5.0  # how long the server may take to end the transport after CLOSE

# QUIC DATAGRAM frames must fit one packet; aioquic packets are 1200 bytes by default. The spec
# says "best-effort that fits" without a number: we use a conservative bound.
QUIC_DATAGRAM_MAX = 1000


class Mismatch(Exception):
    pass


@dataclass
class Received:
    """One event from the server."""

    kind: str  # "frame" | "closed" | "error"
    channel: str = "stream"
    raw: bytes = b""
    frame: Optional[wp.Frame] = None
    detail: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Transports. Each has: connect(), send(raw_frame, cls), recv() -> Received, close_transport(),
# and raw injections for the malformed cases.


class StreamLink:
    """§2.1: TCP or TLS, each frame preceded by its varint length."""

    def __init__(self, host: str, port: int, max_frame: int, tls: Optional[ssl.SSLContext], server_name: str):
        self.host, self.port, self.max, self.tls, self.server_name = host, port, max_frame, tls, server_name
        self.decoder = wp.StreamDecoder(max_frame)
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter
        self.eof = False

    async def connect(self) -> dict:
        kw: dict[str, Any] = {}
        if self.tls is not None:
            kw = {"ssl": self.tls, "server_hostname": self.server_name}
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20, **kw)
        info: dict[str, Any] = {}
        obj = self.writer.get_extra_info("ssl_object")
        if obj is not None:
            info["tls_version"] = obj.version()
        return info

    async def send(self, raw: bytes, cls: int) -> None:
        self.writer.write(wp.encode_stream(raw, self.max))
        await self.writer.drain()

    async def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> Received:
        while True:
            try:
                raw = self.decoder.next_frame()
            except wp.FrameError as e:
                return Received("error", detail={"error": f"server sent a bad stream: {e}"})
            if raw is not None:
                return _decoded(raw, "stream")
            if self.eof:
                if self.decoder.buf:
                    return Received("error", detail={"error": "stream ended inside a frame"})
                return Received("closed", detail={"how": "eof"})
            try:
                chunk = await self.reader.read(65536)
            except (ConnectionError, ssl.SSLError) as e:
                return Received("closed", detail={"how": f"reset: {type(e).__name__}"})
            if not chunk:
                self.eof = True
            else:
                self.decoder.feed(chunk)

    async def close_transport(self) -> None:
        """After sending CLOSE: flush, then half-close our side (the server may still finish)."""
        try:
            await self.writer.drain()
            if self.tls is None:
                self.writer.write_eof()
        except (ConnectionError, OSError, ssl.SSLError):
            pass

    def abort(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass

    # malformed injections
    async def inject(self, case: str) -> None:
        if case == "oversized":
            # §1.3: refused from the length prefix alone; send the prefix and no body.
            await self.send_bytes(wp.encode_varint(self.max + 1))
        elif case == "zero_length":
            await self.send_bytes(b"\x00")
        else:
            await self.send_bytes(wp.encode_varint(len(MALFORMED[case])) + MALFORMED[case])


class WsLink:
    """§2.2: one frame per binary WebSocket message."""

    def __init__(self, host: str, port: int, max_frame: int, tls: Optional[ssl.SSLContext], server_name: str):
        self.host, self.port, self.max, self.tls, self.server_name = host, port, max_frame, tls, server_name
        self.ws: Any = None

    async def connect(self) -> dict:
        from websockets.asyncio.client import connect

        scheme = "wss" if self.tls is not None else "ws"
        uri = f"{scheme}://{self.server_name}:{self.port}/interop?peer=python"
        kw: dict[str, Any] = {}
        if self.tls is not None:
            kw["ssl"] = self.tls
        self.ws = await connect(
            uri,
            host=self.host,  # connect to this address; the URI carries the name for Host and SNI
            subprotocols=["waygate.v1"],
            compression=None,
            max_size=self.max + 1024,
            open_timeout=OP_TIMEOUT,
            close_timeout=CLOSE_TIMEOUT,
            ping_interval=None,
            **kw,
        )
        sub = self.ws.subprotocol
        if sub != "waygate.v1":
            raise Mismatch(f"server did not echo the offered subprotocol waygate.v1 (got {sub!r})")
        return {"subprotocol": sub}

    async def send(self, raw: bytes, cls: int) -> None:
        await self.ws.send(raw)

    async def recv(self) -> Received:
        from websockets.exceptions import ConnectionClosed

        try:
            msg = await self.ws.recv()
        except ConnectionClosed as e:
            rcvd = e.rcvd
            return Received(
                "closed",
                detail={
                    "how": "websocket close",
                    "ws_code": rcvd.code if rcvd else None,
                    "ws_reason": rcvd.reason if rcvd else None,
                },
            )
        if isinstance(msg, str):
            return Received("error", detail={"error": "server sent a text message"})
        return _decoded(msg, "message")

    async def close_transport(self) -> None:
        # Not ws.close(): the server answers our CLOSE by closing; recv() observes that.
        pass

    def abort(self) -> None:
        if self.ws is not None:
            self.ws.transport.abort()

    async def inject(self, case: str) -> None:
        if case == "oversized":
            await self.ws.send(bytes([wp.DATA, wp.CRITICAL, 1, 1]) + b"\xab" * (self.max + 1 - 4))
        elif case == "text_message":
            await self.ws.send("a text message")
        else:
            await self.ws.send(MALFORMED[case])


class QuicLink:
    """§2.4: control stream (kind 0x00, first bidi), normal uni stream (0x01), best-effort uni
    stream (0x02) for frames too large for a datagram, DATAGRAM frames for the rest."""

    def __init__(self, host: str, port: int, max_frame: int, cafile: str, server_name: str):
        self.host, self.port, self.max, self.cafile, self.server_name = host, port, max_frame, cafile, server_name
        self.events: asyncio.Queue = asyncio.Queue()
        self.streams: dict[int, dict] = {}
        self.pending: list[Received] = []
        self.proto: Any = None
        self._cm: Any = None
        self.control: Optional[int] = None
        self.uni: dict[int, int] = {}
        self.terminated: Optional[dict] = None

    async def connect(self) -> dict:
        from aioquic.asyncio.client import connect
        from aioquic.asyncio.protocol import QuicConnectionProtocol
        from aioquic.quic.configuration import QuicConfiguration

        link = self

        class Proto(QuicConnectionProtocol):
            def quic_event_received(self, event: Any) -> None:
                link.events.put_nowait(event)

        config = QuicConfiguration(
            is_client=True,
            alpn_protocols=["waygate/1"],
            max_datagram_frame_size=65536,
            server_name=self.server_name,
            idle_timeout=30.0,
        )
        config.load_verify_locations(self.cafile)
        self._cm = connect(self.host, self.port, configuration=config, create_protocol=Proto)
        self.proto = await asyncio.wait_for(self._cm.__aenter__(), OP_TIMEOUT)
        quic = self.proto._quic
        # The control stream: the first bidi stream, kind byte right after the handshake.
        self.control = quic.get_next_available_stream_id(is_unidirectional=False)
        quic.send_stream_data(self.control, bytes([0x00]))
        self.proto.transmit()
        return {"alpn": quic.tls.alpn_negotiated}

    def _uni(self, kind: int) -> int:
        if kind not in self.uni:
            quic = self.proto._quic
            sid = quic.get_next_available_stream_id(is_unidirectional=True)
            quic.send_stream_data(sid, bytes([kind]))
            self.uni[kind] = sid
        return self.uni[kind]

    def _datagram_room(self) -> int:
        remote = self.proto._quic._remote_max_datagram_frame_size
        return 0 if remote is None else min(remote, QUIC_DATAGRAM_MAX)

    async def send(self, raw: bytes, cls: int) -> None:
        quic = self.proto._quic
        is_data = raw[0] == wp.DATA
        if not is_data or cls == wp.CRITICAL:
            quic.send_stream_data(self.control, wp.encode_stream(raw, self.max))
        elif cls == wp.NORMAL:
            quic.send_stream_data(self._uni(0x01), wp.encode_stream(raw, self.max))
        elif len(raw) <= self._datagram_room():
            quic.send_datagram_frame(raw)
        else:
            quic.send_stream_data(self._uni(0x02), wp.encode_stream(raw, self.max))
        self.proto.transmit()
        await asyncio.sleep(0)

    def _on_event(self, ev: Any) -> None:
        from aioquic.quic import events as qe

        if isinstance(ev, qe.StreamDataReceived):
            st = self.streams.setdefault(ev.stream_id, {"kind": None, "dec": wp.StreamDecoder(self.max)})
            data = ev.data
            if ev.stream_id == self.control:
                st["kind"] = "control"
            elif st["kind"] is None and data:
                kind = data[0]
                data = data[1:]
                st["kind"] = {0x01: "normal", 0x02: "best_effort"}.get(kind, f"unknown-0x{kind:02x}")
                if kind not in (0x01, 0x02):
                    self.pending.append(Received("error", detail={"error": f"server opened a stream of kind {kind}"}))
                    return
            st["dec"].feed(data)
            while True:
                try:
                    raw = st["dec"].next_frame()
                except wp.FrameError as e:
                    self.pending.append(Received("error", detail={"error": f"bad stream from server: {e}"}))
                    return
                if raw is None:
                    break
                self.pending.append(_decoded(raw, st["kind"]))
            if ev.end_stream and st["dec"].buf:
                self.pending.append(Received("error", detail={"error": "stream ended inside a frame"}))
        elif isinstance(ev, qe.DatagramFrameReceived):
            self.pending.append(_decoded(ev.data, "datagram"))
        elif isinstance(ev, qe.ConnectionTerminated):
            self.terminated = {
                "how": "quic connection close",
                "app_code": ev.error_code,
                "transport_frame_type": ev.frame_type,
                "reason": ev.reason_phrase,
            }
            self.pending.append(Received("closed", detail=self.terminated))

    async def recv(self) -> Received:
        while not self.pending:
            ev = await self.events.get()
            self._on_event(ev)
        return self.pending.pop(0)

    async def close_transport(self) -> None:
        # Flush; FIN the control stream. The server closes the connection on our CLOSE (§2.4).
        if self.proto is not None and self.terminated is None:
            self.proto._quic.send_stream_data(self.control, b"", end_stream=True)
            self.proto.transmit()

    def abort(self) -> None:
        if self.proto is not None:
            try:
                self.proto.close(error_code=wp.NORMAL_CLOSE)
            except Exception:
                pass

    async def inject(self, case: str) -> None:
        quic = self.proto._quic
        if case == "oversized":
            quic.send_stream_data(self.control, wp.encode_varint(self.max + 1))
        elif case == "unknown_stream_kind":
            sid = quic.get_next_available_stream_id(is_unidirectional=True)
            quic.send_stream_data(sid, bytes([0x03]) + wp.encode_stream(wp.encode_frame(wp.Ping(1))))
        elif case == "bad_datagram":
            quic.send_datagram_frame(MALFORMED["unknown_type"])
        else:
            quic.send_stream_data(self.control, wp.encode_stream(MALFORMED[case]))
        self.proto.transmit()


class KcpLink:
    """KCP over UDP (PROTOCOL.md §2.3, §8): the
    cookie exchange (HELLO, COOKIE, CONNECT, ACCEPT), then reference ikcp (the C-ikcp `kcp`
    package) in message mode, one frame per KCP message, preset "fast"."""

    MAGIC = b"\x00\x00\x00\x00WGKC\x01"
    HELLO, COOKIE, CONNECT, ACCEPT, BUSY, RESET = 1, 2, 3, 4, 5, 6
    MTU = 1200
    QUIET = 0.5  # after our RESET, how long the server must stay silent

    def __init__(self, host: str, port: int, max_frame: int):
        self.host, self.port, self.max = host, port, max_frame
        self.transport: Any = None
        self.control: asyncio.Queue = asyncio.Queue()  # control packets during the handshake
        self.early: list[bytes] = []  # segments that arrived before the kcp object
        self.pending: asyncio.Queue = asyncio.Queue()
        self.kcp: Any = None
        self.conv = 0
        self.ticker: Optional[asyncio.Task] = None
        self.reset_sent = False
        self.ended = False
        self.handshake: dict[str, Any] = {}

    # -- UDP
    async def open_socket(self) -> None:
        link = self

        class Proto(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                link._on_datagram(data)

            def error_received(self, exc: Exception) -> None:
                link.pending.put_nowait(Received("closed", detail={"how": f"udp error: {exc}"}))

        loop = asyncio.get_running_loop()
        # A connected UDP socket: datagrams from any other address never arrive (§8.3.1 rule 7).
        self.transport, _ = await loop.create_datagram_endpoint(Proto, remote_addr=(self.host, self.port))

    def sendto(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(data)

    def _on_datagram(self, data: bytes) -> None:
        if len(data) < 4:
            return
        if data[:4] == b"\x00\x00\x00\x00":
            if len(data) < 10 or data[:9] != self.MAGIC:
                return  # other magic or version: ignored
            if self.kcp is None:
                self.control.put_nowait(data)
            elif data[9] == self.RESET and len(data) >= 16 and int.from_bytes(data[10:14], "little") == self.conv:
                self.ended = True
                code = int.from_bytes(data[14:16], "little")
                self._drain()
                self.pending.put_nowait(Received("closed", detail={"how": "kcp reset", "code": code}))
            return
        if int.from_bytes(data[:4], "little") != self.conv or self.conv == 0:
            return
        if self.kcp is None:
            self.early.append(data)
            self.control.put_nowait(b"segment")
            return
        try:
            self.kcp.receive(data)
        except Exception as e:  # ikcp_input refused the datagram: the server sent garbage
            self.pending.put_nowait(Received("error", detail={"error": f"ikcp_input refused a datagram: {e}"}))
            return
        self.kcp.flush()
        self._drain()

    def _drain(self) -> None:
        if self.kcp is None:
            return
        while True:
            msg = self.kcp.get_received()
            if not msg:
                return
            self.pending.put_nowait(_decoded(bytes(msg), "message"))

    # -- the cookie exchange (PROTOCOL.md §8.3.1, §8.7)
    def control_packet(self, ptype: int, body: bytes, total: int) -> bytes:
        pkt = self.MAGIC + bytes([ptype]) + body
        return pkt + bytes(total - len(pkt))

    async def request(self, packet: bytes, want: set[int], nonce: bytes, deadline: float) -> bytes:
        """Sends `packet`, resending after 200, 400, 800, 1600, 1600... ms, until a control
        packet of a type in `want` with our nonce (or, for ACCEPT, a segment) arrives."""
        delay = 0.2
        self.sendto(packet)
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise Mismatch("KCP handshake: no answer before the handshake timeout")
            try:
                data = await asyncio.wait_for(self.control.get(), min(delay, deadline - now))
            except asyncio.TimeoutError:
                self.sendto(packet)
                self.handshake["resends"] = self.handshake.get("resends", 0) + 1
                delay = min(delay * 2, 1.6)
                continue
            if data == b"segment":
                if self.ACCEPT in want:
                    return data
                continue
            ptype = data[9]
            if ptype == self.BUSY and len(data) >= 24 and data[10:18] == nonce:
                code = int.from_bytes(data[18:20], "little")
                raise Mismatch(f"KCP handshake: BUSY code {code} retry after {int.from_bytes(data[20:24], 'little')} ms")
            if ptype in want:
                if ptype == self.COOKIE and len(data) >= 42 and data[10:18] == nonce:
                    return data
                if ptype == self.ACCEPT and len(data) >= 14:
                    return data

    async def connect(self) -> dict:
        await self.open_socket()
        deadline = time.monotonic() + OP_TIMEOUT
        nonce = random.getrandbits(64).to_bytes(8, "little")
        hello = self.control_packet(self.HELLO, nonce, 64)
        cookie = await self.request(hello, {self.COOKIE}, nonce, deadline)
        self.handshake["cookie_len"] = len(cookie)
        while True:
            kept = cookie[10:42]
            self.conv = int.from_bytes(kept[8:12], "little")
            connect = self.control_packet(self.CONNECT, kept, 64)
            answer = await self.request(connect, {self.ACCEPT, self.COOKIE}, nonce, deadline)
            if answer == b"segment":
                self.handshake["established_by"] = "segment"
                break
            if answer[9] == self.COOKIE:  # a fresh cookie replaces ours (§8.3.1 rule 3)
                cookie = answer
                continue
            if int.from_bytes(answer[10:14], "little") == self.conv:
                self.handshake["established_by"] = "accept"
                self.handshake["accept_len"] = len(answer)
                break
        if self.conv == 0:
            raise Mismatch("KCP handshake: the server assigned conv 0")
        import kcp as ikcp  # the C reference ikcp

        # The binding takes conv as a C int: pass the same 32 bits as a signed value.
        conv_arg = self.conv - (1 << 32) if self.conv >= (1 << 31) else self.conv
        self.kcp = ikcp.KCP(
            conv_arg,
            max_transmission=self.MTU,
            no_delay=True,
            update_interval=10,
            resend_count=2,
            no_congestion_control=True,
            send_window_size=256,
            receive_window_size=256,
        )
        self.kcp.include_outbound_handler(lambda _k, data: self.sendto(bytes(data)))
        self.kcp.update()  # ikcp_flush does nothing before the first ikcp_update
        for seg in self.early:
            self._on_datagram(seg)
        self.early.clear()
        self.ticker = asyncio.create_task(self._tick())
        return {"conv": self.conv, **self.handshake}

    async def _tick(self) -> None:
        while not self.ended:
            self.kcp.update()
            self._drain()
            await asyncio.sleep(0.01)

    # -- frames
    async def send(self, raw: bytes, cls: int) -> None:
        self.kcp.enqueue(raw)
        self.kcp.flush()
        # Respect the send window rather than queueing without bound.
        t0 = time.monotonic()
        while self.kcp.get_outbound_packets() > 512 and time.monotonic() - t0 < OP_TIMEOUT:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)

    async def recv(self) -> Received:
        if self.reset_sent and self.pending.empty():
            try:
                return await asyncio.wait_for(self.pending.get(), self.QUIET)
            except asyncio.TimeoutError:
                return Received("closed", detail={"how": "our reset; server quiet", "quiet_s": self.QUIET})
        return await self.pending.get()

    def reset_packet(self, code: int) -> bytes:
        return self.MAGIC + bytes([self.RESET]) + self.conv.to_bytes(4, "little") + code.to_bytes(2, "little")

    async def close_transport(self) -> None:
        """PROTOCOL.md §8.6, §8.7 step 9: CLOSE was the last message; wait until it is acked
        (or ~2 s), then RESET with the close code."""
        t0 = time.monotonic()
        while self.kcp.get_outbound_packets() > 0 and time.monotonic() - t0 < 2.0 and not self.ended:
            await asyncio.sleep(0.01)
        if not self.ended:
            self.sendto(self.reset_packet(wp.NORMAL_CLOSE))
            self.reset_sent = True

    def abort(self) -> None:
        self.ended = True
        if self.ticker is not None:
            self.ticker.cancel()
        if self.transport is not None:
            if self.kcp is not None and not self.reset_sent:
                self.sendto(self.reset_packet(wp.GOING_AWAY))
            self.transport.close()

    async def inject(self, case: str) -> None:
        if case == "oversized":
            data = bytes([wp.DATA, wp.CRITICAL, 1, 1]) + b"\xab" * (self.max + 1 - 4)
        else:
            data = MALFORMED[case]
        self.kcp.enqueue(data)
        self.kcp.flush()


async def kcp_endpoint_checks(args: argparse.Namespace) -> list[dict]:
    """The endpoint's handshake rules (PROTOCOL.md §8.2, §8.3.2), seen from outside."""
    host, _, port = args.addr.rpartition(":")
    out: list[dict] = []

    async def fresh() -> KcpLink:
        link = KcpLink(host.strip("[]"), int(port), args.max_frame)
        await link.open_socket()
        return link

    async def answer(link: KcpLink, timeout: float) -> Optional[bytes]:
        try:
            return await asyncio.wait_for(link.control.get(), timeout)
        except asyncio.TimeoutError:
            return None

    # A HELLO shorter than 64 bytes is ignored; a full one gets a COOKIE no larger than it.
    link = await fresh()
    try:
        nonce = random.getrandbits(64).to_bytes(8, "little")
        link.sendto(link.control_packet(KcpLink.HELLO, nonce, 63))
        short = await answer(link, 0.5)
        out.append({"check": "short HELLO ignored", "ok": short is None, "reply_len": len(short) if short else 0})
        link.sendto(link.control_packet(KcpLink.HELLO, nonce, 64))
        cookie = await answer(link, OP_TIMEOUT)
        ok = cookie is not None and cookie[9] == KcpLink.COOKIE and len(cookie) == 42 and cookie[10:18] == nonce
        out.append({"check": "HELLO answered by a 42-byte COOKIE", "ok": ok, "reply_len": len(cookie) if cookie else 0})
        # A CONNECT with a forged MAC is dropped silently.
        if cookie is not None:
            forged = bytearray(cookie[10:42])
            forged[-1] ^= 0xFF
            link.sendto(link.control_packet(KcpLink.CONNECT, bytes(forged), 64))
            reply = await answer(link, 0.5)
            out.append({"check": "CONNECT with a bad MAC dropped", "ok": reply is None, "reply_len": len(reply) if reply else 0})
    finally:
        link.abort()

    # A valid-looking segment for no session is answered RESET(conv, going_away), 16 bytes.
    link = await fresh()
    try:
        conv = random.getrandbits(31) | 1
        seg = conv.to_bytes(4, "little") + bytes([81, 0]) + (128).to_bytes(2, "little") + bytes(16)
        link.sendto(seg)
        reply = await answer(link, 1.0)
        ok = (
            reply is not None
            and reply[9] == KcpLink.RESET
            and len(reply) == 16
            and int.from_bytes(reply[10:14], "little") == conv
            and int.from_bytes(reply[14:16], "little") == wp.GOING_AWAY
        )
        out.append({"check": "segment of no session answered RESET(conv, 1)", "ok": ok, "reply": reply.hex() if reply else None})
    finally:
        link.abort()
    return out


def _decoded(raw: bytes, channel: str) -> Received:
    try:
        return Received("frame", channel=channel, raw=raw, frame=wp.decode_frame(raw))
    except wp.FrameError as e:
        return Received("error", channel=channel, raw=raw, detail={"error": f"undecodable frame from server: {e}"})


# Malformed frames (no framing) and the close code each must draw.
MALFORMED = {
    "unknown_type": bytes([0x0B, 0x00]),
    "reserved_data_flag": bytes([wp.DATA, 0b0000_1000, 0x01, 0x01]) + b"x",
    "data_class_3": bytes([wp.DATA, 0x03, 0x01, 0x01]) + b"x",
    "truncated_close": bytes([wp.CLOSE, 0x00]),
}
EXPECTED_CODE = {
    "unknown_type": wp.PROTOCOL_ERROR,
    "reserved_data_flag": wp.PROTOCOL_ERROR,
    "data_class_3": wp.PROTOCOL_ERROR,
    "truncated_close": wp.PROTOCOL_ERROR,
    "zero_length": wp.PROTOCOL_ERROR,
    "oversized": wp.FRAME_TOO_LARGE,
    "text_message": wp.TEXT_MESSAGE,
    "unknown_stream_kind": wp.PROTOCOL_ERROR,
    "bad_datagram": wp.PROTOCOL_ERROR,
}
# §2.2: WebSocket close status for each waygate code.
WS_STATUS = {0: 1000, 1: 1001, 100: 1002, 106: 1003, 101: 1009}

CASES = {
    "tcp": ["unknown_type", "reserved_data_flag", "zero_length", "oversized"],
    "tls": ["unknown_type", "data_class_3", "oversized"],
    "ws": ["unknown_type", "reserved_data_flag", "truncated_close", "oversized", "text_message"],
    "wss": ["unknown_type", "oversized", "text_message"],
    "quic": ["unknown_type", "reserved_data_flag", "oversized", "unknown_stream_kind", "bad_datagram"],
    "kcp": ["unknown_type", "reserved_data_flag", "data_class_3", "oversized"],
}


# ---------------------------------------------------------------------------------------------
# The script


def scripted_frames(max_frame: int) -> list[tuple[wp.Frame, bytes, bytes]]:
    """(frame, bytes to send, bytes expected back). Every frame type and class; payloads from
    empty to exactly `max_frame` bytes of frame."""
    rng = random.Random(0x5EED)
    sid = bytes(range(16))
    tok = bytes(range(100, 116))

    def payload(n: int) -> bytes:
        return rng.randbytes(n)

    def data_of_len(cls: int, msg_id: int, seq: Optional[int], ack: Optional[int], frame_len: int) -> wp.Data:
        head = len(wp.encode_frame(wp.Data(cls, msg_id, seq, ack, b"")))
        return wp.Data(cls, msg_id, seq, ack, payload(frame_len - head))

    frames: list[wp.Frame] = [
        wp.Hello(1, b"auth-token-\x00\xff" + payload(64)),
        wp.Hello(1, b"", wp.Resume.proving(sid, tok, 123_456, 9)),
        wp.Welcome(sid, tok, 2, 15_000, 45_000, max_frame, 2**40, 7),
        wp.Reject(405, 1_500, "draining \u2713 \u00e9t\u00e9"),
        wp.Reject(499, 0, ""),  # §1.1: an unknown code is carried, not refused
        wp.Data(wp.NORMAL, 300, 1, 2, b"hi"),  # the §3.4 example
        wp.Data(wp.CRITICAL, 0, 1, None, b""),
        wp.Data(wp.CRITICAL, 2**32 - 1, 2, 2**63, payload(1)),
        wp.Data(wp.BEST_EFFORT, 17, None, None, payload(32)),
        wp.Data(wp.BEST_EFFORT, 18, None, 5, payload(700)),
        wp.Ack(0),
        wp.Ack(wp.U64_MAX),
        wp.Ping(42),
        wp.Pong(42),
        wp.Ping(int(time.time() * 1000)),
        wp.Migrate(5_000, "quic://edge-2.example:4433", sid, tok),
        wp.Migrate(0, "", sid, tok),
        wp.Error(402, 300, 9, 250),
        wp.Error(404, 7, 0, 0),
        wp.Data(wp.NORMAL, 301, 2, None, payload(4_096)),
        wp.Data(wp.BEST_EFFORT, 19, None, None, payload(20_000)),
        wp.Data(wp.NORMAL, 302, 3, 3, payload(1_200)),
        wp.Pong(7),
        data_of_len(wp.CRITICAL, 400, 3, None, max_frame),  # exactly the max frame size
        data_of_len(wp.NORMAL, 401, 4, 9, max_frame - 1),
        data_of_len(wp.BEST_EFFORT, 402, None, None, max_frame),
        wp.Data(wp.CRITICAL, 403, 4, None, b"after the big ones"),
    ]
    out = []
    for f in frames:
        raw = wp.encode_frame(f)
        assert len(raw) <= max_frame, (f, len(raw))
        assert wp.decode_frame(raw) == f, f
        out.append((f, raw, raw))
    # §1.1: a receiver ignores bytes after the fields it knows; the echo carries none.
    ping = wp.Ping(99)
    out.append((ping, wp.encode_frame(ping) + b"\x01\x02future", wp.encode_frame(ping)))
    err = wp.Error(403, 1, 2, 3)
    out.append((err, wp.encode_frame(err) + b"\x00", wp.encode_frame(err)))
    # §1.2: non-minimal varints are accepted (and never sent back).
    ping0 = wp.Ping(0)
    out.append((ping0, bytes([wp.PING, 0x80, 0x00]), wp.encode_frame(ping0)))
    d = wp.Data(wp.NORMAL, 300, 5, None, b"non-minimal msg_id")
    out.append((d, bytes([wp.DATA, wp.NORMAL, 0xAC, 0x82, 0x80, 0x00, 0x05]) + d.payload, wp.encode_frame(d)))
    for frame, raw, _ in out[-2:]:
        assert wp.decode_frame(raw) == frame
    return out


def expected_channels(transport: str, frame: wp.Frame, raw_len: int, datagram_room: int) -> set[str]:
    if transport != "quic":
        return {"stream"} if transport in ("tcp", "tls") else {"message"}
    cls = wp.traffic_class(frame)
    if not isinstance(frame, wp.Data) or cls == wp.CRITICAL:
        return {"control"}
    if cls == wp.NORMAL:
        return {"normal"}
    # "best-effort that fits" is the server's judgement of the datagram room.
    return {"datagram", "best_effort"} if raw_len <= 1200 else {"best_effort"}


async def with_timeout(coro: Any, what: str, timeout: float = OP_TIMEOUT) -> Any:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise Mismatch(f"timed out after {timeout}s: {what}") from None


def make_link(args: argparse.Namespace) -> Any:
    host, _, port_s = args.addr.rpartition(":")
    host = host.strip("[]")
    port = int(port_s)
    ctx = None
    if args.transport in ("tls", "wss"):
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=args.ca)
    if args.transport in ("tcp", "tls"):
        return StreamLink(host, port, args.max_frame, ctx, args.server_name)
    if args.transport in ("ws", "wss"):
        return WsLink(host, port, args.max_frame, ctx, args.server_name)
    if args.transport == "quic":
        return QuicLink(host, port, args.max_frame, args.ca, args.server_name)
    if args.transport == "kcp":
        return KcpLink(host, port, args.max_frame)
    raise SystemExit(f"unknown transport {args.transport}")


async def echo_phase(args: argparse.Namespace, result: dict) -> None:
    link = make_link(args)
    result["connect"] = await with_timeout(link.connect(), "connect")
    script = scripted_frames(args.max_frame)
    room = link._datagram_room() if isinstance(link, QuicLink) else 0
    result["echo"] = {"sent": 0, "received": 0, "bytes_sent": 0, "channels": {}}
    echo = result["echo"]

    async def sender() -> None:
        for frame, raw, _ in script:
            await link.send(raw, wp.traffic_class(frame))
            echo["sent"] += 1
            echo["bytes_sent"] += len(raw)

    send_task = asyncio.create_task(sender())
    unmatched = list(range(len(script)))
    last_index: dict[str, int] = {}
    try:
        while unmatched:
            got = await with_timeout(link.recv(), f"echo {echo['received'] + 1} of {len(script)}")
            if got.kind != "frame":
                raise Mismatch(f"expected an echo, got {got.kind}: {got.detail}")
            match = next((i for i in unmatched if script[i][2] == got.raw), None)
            if match is None:
                raise Mismatch(f"echo matches no frame sent (or one twice): {got.frame!r:.300}")
            frame, _, want = script[match]
            if got.frame != frame:
                raise Mismatch(f"decoded echo differs: {got.frame!r:.200} != {frame!r:.200}")
            chans = expected_channels(args.transport, frame, len(want), room)
            if got.channel not in chans:
                raise Mismatch(f"{type(frame).__name__} came back on {got.channel}, expected {sorted(chans)}")
            # order is kept within a channel (a QUIC stream; a TCP/WS connection), not datagrams
            if got.channel != "datagram":
                if last_index.get(got.channel, -1) > match:
                    raise Mismatch(f"frame {match} came back after frame {last_index[got.channel]} on {got.channel}")
                last_index[got.channel] = match
            unmatched.remove(match)
            echo["received"] += 1
            echo["channels"][got.channel] = echo["channels"].get(got.channel, 0) + 1
        await with_timeout(send_task, "sending the script")
    finally:
        if not send_task.done():
            send_task.cancel()

    # CLOSE: the server stops sending and ends the transport.
    await link.send(wp.encode_frame(wp.Close(wp.NORMAL_CLOSE, "bye from python")), wp.CRITICAL)
    await link.close_transport()
    end = await with_timeout(link.recv(), "the server ending the transport after our CLOSE", CLOSE_TIMEOUT)
    if end.kind != "closed":
        link.abort()
        raise Mismatch(f"after CLOSE the server sent {end.kind}: {end.frame or end.detail}")
    result["close"] = end.detail
    if args.transport == "quic" and end.detail.get("app_code") not in (wp.NORMAL_CLOSE,):
        raise Mismatch(f"QUIC connection closed with code {end.detail.get('app_code')} after CLOSE(normal)")
    link.abort()


async def malformed_case(args: argparse.Namespace, case: str) -> dict:
    link = make_link(args)
    await with_timeout(link.connect(), "connect")
    want = EXPECTED_CODE[case]
    out: dict[str, Any] = {"case": case, "expected": want}
    try:
        # A valid exchange first: proves the connection works (and on QUIC that the control
        # stream is established before the bad input).
        ping = wp.encode_frame(wp.Ping(1234))
        await link.send(ping, wp.CRITICAL)
        got = await with_timeout(link.recv(), "PING echo")
        if got.kind != "frame" or got.raw != ping:
            raise Mismatch(f"{case}: PING not echoed: {got}")
        await link.inject(case)
        close: Optional[wp.Close] = None
        while True:
            got = await with_timeout(link.recv(), f"{case}: the server's answer")
            if got.kind == "frame":
                if isinstance(got.frame, wp.Close) and close is None:
                    close = got.frame
                    continue
                raise Mismatch(f"{case}: unexpected frame {got.frame!r:.200}")
            if got.kind == "error":
                raise Mismatch(f"{case}: {got.detail}")
            out["transport_end"] = got.detail
            break
        out["got"] = close.code if close else None
        out["message"] = close.message if close else None
        if close is None:
            raise Mismatch(f"{case}: transport ended without a CLOSE frame ({out['transport_end']})")
        if close.code != want:
            raise Mismatch(f"{case}: CLOSE code {close.code} ({wp.code_label(close.code)}), want {want}")
        end = out["transport_end"]
        if args.transport in ("ws", "wss") and end.get("ws_code") != WS_STATUS[want]:
            raise Mismatch(f"{case}: WebSocket close status {end.get('ws_code')}, want {WS_STATUS[want]}")
        if args.transport == "kcp" and end.get("how") == "kcp reset" and end.get("code") != want:
            raise Mismatch(f"{case}: KCP RESET code {end.get('code')}, want {want}")
        if args.transport == "quic" and end.get("app_code") != want:
            raise Mismatch(f"{case}: QUIC application close code {end.get('app_code')}, want {want}")
        out["ok"] = True
    finally:
        link.abort()
    return out


async def run(args: argparse.Namespace) -> dict:
    result: dict[str, Any] = {"transport": args.transport, "ok": False, "errors": []}
    failures = wp.self_test()
    if failures:
        result["errors"].append(f"self-test: {failures}")
        return result
    try:
        await echo_phase(args, result)
    except Mismatch as e:
        result["errors"].append(f"echo: {e}")
    except Exception as e:  # a crash is a failure with its trace
        result["errors"].append(f"echo: {type(e).__name__}: {e}: {traceback.format_exc(limit=4)}")
    result["malformed"] = []
    for case in CASES[args.transport]:
        try:
            result["malformed"].append(await malformed_case(args, case))
        except Mismatch as e:
            result["malformed"].append({"case": case, "ok": False})
            result["errors"].append(f"malformed: {e}")
        except Exception as e:
            result["malformed"].append({"case": case, "ok": False})
            result["errors"].append(f"malformed {case}: {type(e).__name__}: {e}: {traceback.format_exc(limit=4)}")
    if args.transport == "kcp":
        try:
            result["endpoint"] = await kcp_endpoint_checks(args)
            for check in result["endpoint"]:
                if not check["ok"]:
                    result["errors"].append(f"kcp endpoint: {check}")
        except Exception as e:
            result["errors"].append(f"kcp endpoint: {type(e).__name__}: {e}: {traceback.format_exc(limit=4)}")
    result["ok"] = not result["errors"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=sorted(CASES))
    p.add_argument("--addr", help="host:port of the echo listener")
    p.add_argument("--ca", help="PEM file of the CA to trust (tls, wss, quic)")
    p.add_argument("--server-name", default="localhost", help="TLS server name (and WebSocket Host)")
    p.add_argument("--max-frame", type=int, default=wp.DEFAULT_MAX_FRAME_SIZE)
    p.add_argument("--selftest", action="store_true", help="only check the codec against PROTOCOL.md's examples")
    args = p.parse_args()
    if args.selftest:
        failures = wp.self_test()
        print(json.dumps({"selftest": True, "ok": not failures, "errors": failures}))
        return 1 if failures else 0
    if not args.transport or not args.addr:
        p.error("--transport and --addr are required")
    if args.transport in ("tls", "wss", "quic") and not args.ca:
        p.error(f"--ca is required for {args.transport}")
    started = time.monotonic()
    result = asyncio.run(run(args))
    result["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(result, default=repr))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
