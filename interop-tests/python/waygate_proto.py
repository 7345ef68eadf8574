"""waygate client protocol v1, written from PROTOCOL.md alone (§1 basics, §2 framing, §3 frames,
§4 close codes). Pure Python, no I/O: varint (LEB128), every frame type, the length-delimited
stream framing of §2.1, and the spec's own examples as self-test vectors.

Nothing here was ported from the Rust code: when this module and waygate disagree, either the
spec is incomplete or one side is wrong, and that is what the interop tests are for.
"""

from __future__ import annotations

import hashlib
import hmac

from dataclasses import dataclass
from typing import Optional, Union

PROTOCOL_VERSION = 1

# §1.3 limits (defaults; the max frame size is configurable and announced in WELCOME).
DEFAULT_MAX_FRAME_SIZE = 65_536
MAX_TOKEN_LEN = 4_096
MAX_MESSAGE_LEN = 1_024
MAX_TARGET_LEN = 512
ID_LEN = 16

# §3 frame types.
HELLO = 0x01
WELCOME = 0x02
REJECT = 0x03
DATA = 0x04
ACK = 0x05
PING = 0x06
PONG = 0x07
MIGRATE = 0x08
CLOSE = 0x09
ERROR = 0x0A

# §3.4 traffic classes.
CRITICAL = 0
NORMAL = 1
BEST_EFFORT = 2

# §4 close codes (the subset the tests name).
NORMAL_CLOSE = 0
GOING_AWAY = 1
PROTOCOL_ERROR = 100
FRAME_TOO_LARGE = 101
UNSUPPORTED_VERSION = 102
TEXT_MESSAGE = 106

CLOSE_CODES = {
    0: "normal",
    1: "going_away",
    2: "logout",
    100: "protocol_error",
    101: "frame_too_large",
    102: "unsupported_version",
    103: "idle_timeout",
    104: "handshake_timeout",
    105: "unexpected_frame",
    106: "text_message",
    200: "auth_malformed",
    201: "auth_bad_signature",
    202: "auth_expired",
    203: "auth_unknown_key",
    204: "auth_unsupported_version",
    205: "auth_rejected",
    300: "resume_rejected",
    301: "kicked",
    302: "slow_consumer",
    303: "session_expired",
    400: "overloaded",
    401: "rate_limited",
    402: "busy",
    403: "unavailable",
    404: "no_route",
    405: "draining",
    406: "stale_epoch",
    407: "queue_full",
    408: "unknown_channel_kind",
    409: "member_offline",
    410: "channel_limit",
    500: "internal",
}

U64_MAX = (1 << 64) - 1


def code_label(code: int) -> str:
    """§1.1: unknown codes are accepted and treated like the nearest known class."""
    if code in CLOSE_CODES:
        return CLOSE_CODES[code]
    return {1: "protocol", 2: "auth", 3: "session", 4: "load", 5: "server"}.get(code // 100, "unknown")


class FrameError(Exception):
    """A malformed frame: the receiver closes with `code` (§1.1, §1.3)."""

    code = PROTOCOL_ERROR


class FrameTooLarge(FrameError):
    code = FRAME_TOO_LARGE


class Incomplete(Exception):
    """More bytes are needed (stream framing only)."""


# ---------------------------------------------------------------------------------------------
# §1.2 varint


def encode_varint(value: int) -> bytes:
    if value < 0 or value > U64_MAX:
        raise ValueError(f"varint out of range: {value}")
    out = bytearray()
    while True:
        group = value & 0x7F
        value >>= 7
        if value:
            out.append(group | 0x80)
        else:
            out.append(group)
            return bytes(out)


def decode_varint(buf: bytes, pos: int = 0) -> tuple[int, int]:
    """Returns (value, new position). Raises Incomplete when `buf` ends inside the varint and
    FrameError when it is longer than 10 bytes or its 10th byte is greater than 1."""
    value = 0
    for i in range(10):
        if pos + i >= len(buf):
            raise Incomplete()
        byte = buf[pos + i]
        if i == 9 and byte > 1:
            raise FrameError("varint longer than 64 bits")
        value |= (byte & 0x7F) << (7 * i)
        if byte & 0x80 == 0:
            return value, pos + i + 1
    raise FrameError("varint longer than 10 bytes")


# ---------------------------------------------------------------------------------------------
# §3 frames


@dataclass(frozen=True)
class Resume:
    """HELLO's resume part (§3.1, §7.3.1): a proof of holding the resume token, never the token."""

    session_id: bytes
    proof: bytes  # 32 bytes: resume_proof(...)
    last_server_seq: int
    nonce: int

    @staticmethod
    def proving(session_id: bytes, resume_token: bytes, last_server_seq: int, nonce: int) -> "Resume":
        return Resume(session_id, resume_proof(resume_token, session_id, last_server_seq, nonce), last_server_seq, nonce)


def resume_proof(resume_token: bytes, session_id: bytes, last_server_seq: int, nonce: int) -> bytes:
    """§7.3.1: HMAC-SHA256(SHA-256(resume_token), "waygate resume v1" | session_id | u64 BE | u64 BE)."""
    key = hashlib.sha256(resume_token).digest()
    msg = b"waygate resume v1" + session_id + last_server_seq.to_bytes(8, "big") + nonce.to_bytes(8, "big")
    return hmac.new(key, msg, hashlib.sha256).digest()


@dataclass(frozen=True)
class Hello:
    version: int
    token: bytes
    resume: Optional[Resume] = None


@dataclass(frozen=True)
class Welcome:
    session_id: bytes
    resume_token: bytes
    outcome: int
    heartbeat_interval_ms: int
    idle_timeout_ms: int
    max_frame_size: int
    server_seq_base: int
    client_seq_ack: int


@dataclass(frozen=True)
class Reject:
    code: int
    retry_after_ms: int
    message: str


@dataclass(frozen=True)
class Data:
    cls: int
    msg_id: int
    seq: Optional[int]  # None for best-effort (absent on the wire)
    ack: Optional[int]
    payload: bytes


@dataclass(frozen=True)
class Ack:
    ack: int


@dataclass(frozen=True)
class Ping:
    timestamp: int


@dataclass(frozen=True)
class Pong:
    timestamp: int


@dataclass(frozen=True)
class Migrate:
    deadline_ms: int
    target: str
    session_id: bytes
    resume_token: bytes


@dataclass(frozen=True)
class Close:
    code: int
    message: str


@dataclass(frozen=True)
class Error:
    code: int
    msg_id: int
    client_seq: int
    retry_after_ms: int


Frame = Union[Hello, Welcome, Reject, Data, Ack, Ping, Pong, Migrate, Close, Error]


def _u16(v: int) -> bytes:
    if not 0 <= v <= 0xFFFF:
        raise ValueError(f"u16 out of range: {v}")
    return v.to_bytes(2, "big")


def _u8(v: int) -> bytes:
    if not 0 <= v <= 0xFF:
        raise ValueError(f"u8 out of range: {v}")
    return bytes([v])


def _bytes(b: bytes, limit: Optional[int] = None) -> bytes:
    if limit is not None and len(b) > limit:
        raise ValueError(f"field of {len(b)} bytes exceeds its limit {limit}")
    return encode_varint(len(b)) + bytes(b)


def _string(s: str, limit: Optional[int] = None) -> bytes:
    return _bytes(s.encode("utf-8"), limit)


def _id(b: bytes) -> bytes:
    if len(b) != ID_LEN:
        raise ValueError("an id is 16 bytes")
    return bytes(b)


def encode_frame(f: Frame) -> bytes:
    """The frame's bytes, type byte first, no length prefix (minimal varints only)."""
    if isinstance(f, Hello):
        out = bytearray([HELLO]) + _u8(f.version) + _u8(1 if f.resume else 0)
        out += _bytes(f.token, MAX_TOKEN_LEN)
        if f.resume:
            if len(f.resume.proof) != 32:
                raise ValueError("a resume proof is 32 bytes")
            out += _id(f.resume.session_id) + bytes(f.resume.proof)
            out += encode_varint(f.resume.last_server_seq) + encode_varint(f.resume.nonce)
        return bytes(out)
    if isinstance(f, Welcome):
        return (
            bytes([WELCOME])
            + _id(f.session_id)
            + _id(f.resume_token)
            + _u8(f.outcome)
            + encode_varint(f.heartbeat_interval_ms)
            + encode_varint(f.idle_timeout_ms)
            + encode_varint(f.max_frame_size)
            + encode_varint(f.server_seq_base)
            + encode_varint(f.client_seq_ack)
        )
    if isinstance(f, Reject):
        return bytes([REJECT]) + _u16(f.code) + encode_varint(f.retry_after_ms) + _string(f.message, MAX_MESSAGE_LEN)
    if isinstance(f, Data):
        if f.cls not in (CRITICAL, NORMAL, BEST_EFFORT):
            raise ValueError(f"bad class {f.cls}")
        if not 0 <= f.msg_id < 2**32:
            raise ValueError("msg_id must be < 2^32")
        sequenced = f.cls != BEST_EFFORT
        if sequenced != (f.seq is not None):
            raise ValueError("seq is present exactly for critical and normal DATA")
        flags = f.cls | (0b100 if f.ack is not None else 0)
        out = bytearray([DATA, flags]) + encode_varint(f.msg_id)
        if sequenced:
            out += encode_varint(f.seq)
        if f.ack is not None:
            out += encode_varint(f.ack)
        return bytes(out + f.payload)
    if isinstance(f, Ack):
        return bytes([ACK]) + encode_varint(f.ack)
    if isinstance(f, Ping):
        return bytes([PING]) + encode_varint(f.timestamp)
    if isinstance(f, Pong):
        return bytes([PONG]) + encode_varint(f.timestamp)
    if isinstance(f, Migrate):
        return (
            bytes([MIGRATE])
            + encode_varint(f.deadline_ms)
            + _string(f.target, MAX_TARGET_LEN)
            + _id(f.session_id)
            + _id(f.resume_token)
        )
    if isinstance(f, Close):
        return bytes([CLOSE]) + _u16(f.code) + _string(f.message, MAX_MESSAGE_LEN)
    if isinstance(f, Error):
        return (
            bytes([ERROR])
            + _u16(f.code)
            + encode_varint(f.msg_id)
            + encode_varint(f.client_seq)
            + encode_varint(f.retry_after_ms)
        )
    raise TypeError(f"not a frame: {f!r}")


class _Reader:
    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def take(self, n: int, field: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise FrameError(f"frame truncated in {field}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, field: str) -> int:
        return self.take(1, field)[0]

    def u16(self, field: str) -> int:
        return int.from_bytes(self.take(2, field), "big")

    def varint(self, field: str) -> int:
        try:
            value, self.pos = decode_varint(self.buf, self.pos)
        except Incomplete:
            raise FrameError(f"frame truncated in {field}") from None
        return value

    def bytes(self, field: str, limit: int) -> bytes:
        n = self.varint(field)
        if n > limit:
            raise FrameError(f"{field} longer than {limit} bytes")
        return self.take(n, field)

    def string(self, field: str, limit: int) -> str:
        try:
            return self.bytes(field, limit).decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError(f"{field} is not UTF-8") from None

    def rest(self) -> bytes:
        out = self.buf[self.pos :]
        self.pos = len(self.buf)
        return out


def decode_frame(buf: bytes) -> Frame:
    """Decodes one whole frame. Bytes after the known fields are ignored (§1.1), except in DATA
    whose payload is the rest. Raises FrameError on anything malformed."""
    if not buf:
        raise FrameError("empty frame")
    r = _Reader(bytes(buf))
    t = r.u8("type")
    if t == HELLO:
        version = r.u8("version")
        flags = r.u8("flags")
        if flags & ~1:
            raise FrameError("reserved HELLO flag set")
        token = r.bytes("token", MAX_TOKEN_LEN)
        resume = None
        if flags & 1:
            resume = Resume(r.take(ID_LEN, "session_id"), r.take(32, "proof"), r.varint("last_server_seq"), r.varint("nonce"))
        return Hello(version, token, resume)
    if t == WELCOME:
        return Welcome(
            r.take(ID_LEN, "session_id"),
            r.take(ID_LEN, "resume_token"),
            r.u8("outcome"),
            r.varint("heartbeat_interval_ms"),
            r.varint("idle_timeout_ms"),
            r.varint("max_frame_size"),
            r.varint("server_seq_base"),
            r.varint("client_seq_ack"),
        )
    if t == REJECT:
        return Reject(r.u16("code"), r.varint("retry_after_ms"), r.string("message", MAX_MESSAGE_LEN))
    if t == DATA:
        flags = r.u8("flags")
        if flags & 0b1111_1000:
            raise FrameError("reserved DATA flag set")
        cls = flags & 0b11
        if cls == 3:
            raise FrameError("DATA class 3 is reserved")
        msg_id = r.varint("msg_id")
        if msg_id >= 2**32:
            raise FrameError("msg_id must be < 2^32")
        seq = r.varint("seq") if cls != BEST_EFFORT else None
        ack = r.varint("ack") if flags & 0b100 else None
        return Data(cls, msg_id, seq, ack, r.rest())
    if t == ACK:
        return Ack(r.varint("ack"))
    if t == PING:
        return Ping(r.varint("timestamp"))
    if t == PONG:
        return Pong(r.varint("timestamp"))
    if t == MIGRATE:
        return Migrate(
            r.varint("deadline_ms"),
            r.string("target", MAX_TARGET_LEN),
            r.take(ID_LEN, "session_id"),
            r.take(ID_LEN, "resume_token"),
        )
    if t == CLOSE:
        return Close(r.u16("code"), r.string("message", MAX_MESSAGE_LEN))
    if t == ERROR:
        return Error(r.u16("code"), r.varint("msg_id"), r.varint("client_seq"), r.varint("retry_after_ms"))
    raise FrameError(f"unknown frame type 0x{t:02x}")


def traffic_class(f: Frame) -> int:
    """A DATA frame's class; every control frame travels as critical (§2.4)."""
    return f.cls if isinstance(f, Data) else CRITICAL


# ---------------------------------------------------------------------------------------------
# §2.1 length-delimited framing (TCP, TLS, QUIC streams)


def encode_stream(frame_bytes: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    if not frame_bytes:
        raise ValueError("a frame is never empty")
    if len(frame_bytes) > max_frame_size:
        raise ValueError(f"frame of {len(frame_bytes)} bytes exceeds the max frame size {max_frame_size}")
    return encode_varint(len(frame_bytes)) + frame_bytes


class StreamDecoder:
    """Cuts a byte stream into frames. `next_frame()` returns the raw bytes of the next whole
    frame, None when more bytes are needed, and raises FrameError / FrameTooLarge (decided
    from the length prefix alone)."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE):
        self.max = max_frame_size
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data

    def next_frame(self) -> Optional[bytes]:
        try:
            length, pos = decode_varint(self.buf, 0)
        except Incomplete:
            return None
        if length == 0:
            raise FrameError("zero-length frame")
        if length > self.max:
            raise FrameTooLarge(f"declared frame of {length} bytes exceeds {self.max}")
        if len(self.buf) - pos < length:
            return None
        out = bytes(self.buf[pos : pos + length])
        del self.buf[: pos + length]
        return out


# ---------------------------------------------------------------------------------------------
# The spec's own examples and rules, as vectors.


# §12.2: channel events ride in DATA with this msg_id.
CHANNEL_EVENT_MSG_ID = 0xFFFFFF01
PUBLICATION, JOINED, LEFT, HISTORY_LOST = 0, 1, 2, 3
MAX_CHANNEL_NAME_LEN = 256


@dataclass(frozen=True)
class ChannelEvent:
    kind: int
    channel: str
    epoch: int
    offset: int
    body: bytes


def encode_channel_event(e: ChannelEvent) -> bytes:
    return _u8(e.kind) + _string(e.channel, MAX_CHANNEL_NAME_LEN) + encode_varint(e.epoch) + encode_varint(e.offset) + e.body


def decode_channel_event(payload: bytes) -> ChannelEvent:
    r = _Reader(payload)
    kind = r.u8("channel event kind")
    channel = r.string("channel", MAX_CHANNEL_NAME_LEN)
    epoch = r.varint("epoch")
    offset = r.varint("offset")
    return ChannelEvent(kind, channel, epoch, offset, r.rest())


def self_test() -> list[str]:
    """Checks this module against every example PROTOCOL.md gives. Returns failures."""
    failures: list[str] = []

    def check(name: str, cond: bool) -> None:
        if not cond:
            failures.append(name)

    for value, hexs in [(0, "00"), (127, "7f"), (128, "8001"), (300, "ac02"), (16384, "808001")]:
        check(f"varint {value}", encode_varint(value) == bytes.fromhex(hexs))
        check(f"varint decode {value}", decode_varint(bytes.fromhex(hexs)) == (value, len(hexs) // 2))
    check("varint u64 max is 10 bytes", len(encode_varint(U64_MAX)) == 10)
    check("varint u64 max round trip", decode_varint(encode_varint(U64_MAX))[0] == U64_MAX)
    check("non-minimal varint accepted", decode_varint(bytes.fromhex("8000")) == (0, 2))
    for bad in ["ffffffffffffffffff02", "8080808080808080808000"]:
        try:
            decode_varint(bytes.fromhex(bad))
            failures.append(f"overlong varint {bad} accepted")
        except FrameError:
            pass
    # §2.1 example: PING 42 on TCP.
    check("PING 42 on TCP is 02 06 2a", encode_stream(encode_frame(Ping(42))) == bytes.fromhex("02062a"))
    # §3.4 example: class normal, msg_id 300, seq 1, ack 2, payload "hi".
    ex = Data(NORMAL, 300, 1, 2, b"hi")
    check("DATA example bytes", encode_frame(ex) == bytes.fromhex("0405ac0201026869"))
    check("DATA example decodes", decode_frame(bytes.fromhex("0405ac0201026869")) == ex)
    # §1.1: trailing bytes ignored except in DATA; reserved bits and unknown types malformed.
    check("trailing bytes ignored", decode_frame(bytes.fromhex("062a0102")) == Ping(42))
    for name, hexs in [
        ("unknown type", "0b"),
        ("type 0", "00"),
        ("reserved DATA bit", "040801016869"),
        ("DATA class 3", "0403010168"),
        ("reserved HELLO bit", "01010200"),
        ("truncated CLOSE", "0900"),
        ("non-UTF-8 CLOSE message", "09006401ff"),
        ("msg_id >= 2^32", "0402808080801001"),
    ]:
        try:
            decode_frame(bytes.fromhex(hexs))
            failures.append(f"{name} accepted")
        except FrameError as e:
            check(f"{name} is protocol_error", e.code == PROTOCOL_ERROR)
    # §7.3.1 example: resume proof for token 00..0f, session aa x16, last_server_seq 5, nonce 1.
    proof = resume_proof(bytes(range(16)), b"\xaa" * 16, 5, 1)
    check("resume proof example", proof == bytes.fromhex(
        "386d72d0e86dcf50295e6f74a1e8accf1f603b302a5b5f7e84e2e3cb641f721a"))
    hello = Hello(1, b"", Resume(b"\xaa" * 16, proof, 5, 1))
    check("resume HELLO round trip", decode_frame(encode_frame(hello)) == hello)
    # §12.2 example: publication "hi" at offset 7 of guild:42, epoch 300.
    ev_hex = "00086775696c643a3432ac020768" + "69"
    ev = ChannelEvent(PUBLICATION, "guild:42", 300, 7, b"hi")
    check("channel event example bytes", encode_channel_event(ev) == bytes.fromhex(ev_hex))
    check("channel event example decodes", decode_channel_event(bytes.fromhex(ev_hex)) == ev)
    carried = Data(NORMAL, CHANNEL_EVENT_MSG_ID, 5, None, bytes.fromhex(ev_hex))
    back = decode_frame(encode_frame(carried))
    check("channel event rides in DATA", isinstance(back, Data) and back.msg_id == CHANNEL_EVENT_MSG_ID
          and decode_channel_event(back.payload) == ev)
    try:
        decode_channel_event(bytes.fromhex("0008677569"))
        failures.append("truncated channel event accepted")
    except FrameError:
        pass
    d = StreamDecoder(100)
    d.feed(bytes.fromhex("65"))  # declares 101 bytes
    try:
        d.next_frame()
        failures.append("oversized length prefix accepted")
    except FrameTooLarge:
        pass
    d = StreamDecoder(100)
    d.feed(b"\x00")
    try:
        d.next_frame()
        failures.append("zero length accepted")
    except FrameTooLarge:
        failures.append("zero length is not frame_too_large")
    except FrameError:
        pass
    return failures
