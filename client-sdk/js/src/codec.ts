// The client protocol's frames (PROTOCOL.md §1–§4): varint (LEB128), the ten frame types,
// their limits. One frame per binary WebSocket message (§2.2), so there is no length prefix.
//
// Number representation: every 64-bit field (seqs, acks, PING timestamps, the resume
// part's last_server_seq and nonce, WELCOME's server_seq_base and client_seq_ack, ERROR's
// client_seq) is a `bigint`, so the full u64 range round-trips exactly. Fields the protocol bounds below
// 2^32 (msg_id, *_ms, max_frame_size, retry_after_ms) and lengths are plain `number`s.
// Channel events (§12.2): the offset is a `bigint` like a seq; the epoch, which the protocol
// keeps below 2^53, is a `number`.

/** Protocol version spoken (HELLO.version). */
export const PROTOCOL_VERSION = 1;
/** Default largest frame, type byte through the end (§1.3). */
export const DEFAULT_MAX_FRAME_SIZE = 65_536;
/** Longest auth token in HELLO (§1.3). */
export const MAX_TOKEN_LEN = 4096;
/** Longest message in REJECT / CLOSE (§1.3). */
export const MAX_MESSAGE_LEN = 1024;
/** Longest MIGRATE target (§1.3). */
export const MAX_TARGET_LEN = 512;
/** WebSocket subprotocol the client offers (§2.2). */
export const SUBPROTOCOL = "waygate.v1";
/** Length of the HELLO resume part's proof (§3.1, §7.3.1). */
export const RESUME_PROOF_LEN = 32;

const U32_LIMIT = 2 ** 32;
const U64_MAX = (1n << 64n) - 1n;

/** Frame type bytes (§3). */
export const FrameType = {
  Hello: 0x01,
  Welcome: 0x02,
  Reject: 0x03,
  Data: 0x04,
  Ack: 0x05,
  Ping: 0x06,
  Pong: 0x07,
  Migrate: 0x08,
  Close: 0x09,
  Error: 0x0a,
} as const;

/** Traffic classes (§3.4 flags bits 0–1). */
export type TrafficClass = "critical" | "normal" | "bestEffort";
const CLASS_BITS: Record<TrafficClass, number> = { critical: 0, normal: 1, bestEffort: 2 };
const CLASS_OF: TrafficClass[] = ["critical", "normal", "bestEffort"];

/** Whether a class carries a seq (acked, replayed, de-duplicated). */
export function isSequenced(cls: TrafficClass): boolean {
  return cls !== "bestEffort";
}

/** WELCOME outcomes (§3.2). */
export const WelcomeOutcome = {
  NewSession: 0,
  Restored: 1,
  RestoredWithGap: 2,
  RestoreFailedNewSession: 3,
} as const;
export type WelcomeOutcome = (typeof WelcomeOutcome)[keyof typeof WelcomeOutcome];

/** Close codes (§4). Unknown codes are accepted: see {@link codeClass}. */
export const CloseCode = {
  normal: 0,
  going_away: 1,
  logout: 2,
  protocol_error: 100,
  frame_too_large: 101,
  unsupported_version: 102,
  idle_timeout: 103,
  handshake_timeout: 104,
  unexpected_frame: 105,
  text_message: 106,
  auth_malformed: 200,
  auth_bad_signature: 201,
  auth_expired: 202,
  auth_unknown_key: 203,
  auth_unsupported_version: 204,
  auth_rejected: 205,
  resume_rejected: 300,
  kicked: 301,
  slow_consumer: 302,
  session_expired: 303,
  overloaded: 400,
  rate_limited: 401,
  busy: 402,
  unavailable: 403,
  no_route: 404,
  draining: 405,
  stale_epoch: 406,
  queue_full: 407,
  unknown_channel_kind: 408,
  member_offline: 409,
  channel_limit: 410,
  internal: 500,
} as const;

/** The label of a close code (`"code_<n>"` for codes this version does not know). */
export function codeLabel(code: number): string {
  for (const [label, c] of Object.entries(CloseCode)) {
    if (c === code) return label;
  }
  return `code_${code}`;
}

/** The class of a close code (§1.1: unknown codes are treated like their class). */
export function codeClass(code: number): "general" | "protocol" | "auth" | "session" | "load" | "server" {
  if (code < 100) return "general";
  if (code < 200) return "protocol";
  if (code < 300) return "auth";
  if (code < 400) return "session";
  if (code < 500) return "load";
  return "server";
}

/**
 * Whether a CLOSE with this code, received after WELCOME, leaves the session lingering for a
 * resume (§7.8). Any other code there, known or not (kicked, a ban, a backend's own KICK
 * code), means the session ended: do not reconnect on your own.
 */
export function closeKeepsSession(code: number): boolean {
  return KEEPING_CLOSES.has(code);
}

const KEEPING_CLOSES = new Set<number>([
  CloseCode.normal,
  CloseCode.going_away,
  CloseCode.protocol_error,
  CloseCode.frame_too_large,
  CloseCode.idle_timeout,
  CloseCode.unexpected_frame,
  CloseCode.text_message,
  CloseCode.slow_consumer,
  CloseCode.overloaded,
  CloseCode.rate_limited,
  CloseCode.unavailable,
  CloseCode.draining,
  CloseCode.internal,
]);

/** 16 raw bytes (session ids, resume tokens). */
export type Id = Uint8Array;

/** HELLO's resume part (§3.1). The resume token itself is never sent (§7.3.1). */
export interface ResumeRequest {
  sessionId: Id;
  /** 32 bytes: HMAC proof of holding the session's resume token (see `resumeProof`). */
  proof: Uint8Array;
  /** Highest server seq received with nothing missing below it. */
  lastServerSeq: bigint;
  /** Above the nonce of every earlier resume of this session the edge accepted (1, 2, 3, ...). */
  nonce: bigint;
}

export type Frame =
  | { type: "hello"; version: number; token: Uint8Array; resume: ResumeRequest | null }
  | {
      type: "welcome";
      sessionId: Id;
      resumeToken: Id;
      outcome: WelcomeOutcome;
      heartbeatIntervalMs: number;
      idleTimeoutMs: number;
      maxFrameSize: number;
      serverSeqBase: bigint;
      clientSeqAck: bigint;
    }
  | { type: "reject"; code: number; retryAfterMs: number; message: string }
  | {
      type: "data";
      cls: TrafficClass;
      msgId: number;
      /** 0n for best-effort (absent on the wire). */
      seq: bigint;
      ack: bigint | null;
      payload: Uint8Array;
    }
  | { type: "ack"; ack: bigint }
  | { type: "ping"; timestamp: bigint }
  | { type: "pong"; timestamp: bigint }
  | { type: "migrate"; deadlineMs: number; target: string; sessionId: Id; resumeToken: Id }
  | { type: "close"; code: number; message: string }
  | { type: "error"; code: number; msgId: number; clientSeq: bigint; retryAfterMs: number };

/** A malformed frame: the connection must be closed with `protocol_error` (or `code`). */
export class ProtocolError extends Error {
  readonly code: number;
  constructor(message: string, code: number = CloseCode.protocol_error) {
    super(message);
    this.name = "ProtocolError";
    this.code = code;
  }
}

// ---------------------------------------------------------------------------------------
// Writing

/** A growable byte buffer. */
export class Writer {
  private buf: Uint8Array;
  private len = 0;

  constructor(capacity = 64) {
    this.buf = new Uint8Array(capacity);
  }

  private reserve(n: number): void {
    if (this.len + n <= this.buf.length) return;
    let cap = this.buf.length * 2;
    while (cap < this.len + n) cap *= 2;
    const next = new Uint8Array(cap);
    next.set(this.buf.subarray(0, this.len));
    this.buf = next;
  }

  u8(v: number): this {
    this.reserve(1);
    this.buf[this.len++] = v & 0xff;
    return this;
  }

  /** Big-endian u16 (§3 frames). */
  u16(v: number): this {
    if (!Number.isInteger(v) || v < 0 || v > 0xffff) throw new RangeError(`u16 out of range: ${v}`);
    this.reserve(2);
    this.buf[this.len++] = v >>> 8;
    this.buf[this.len++] = v & 0xff;
    return this;
  }

  /** Minimal LEB128 of a u64 given as number (safe integer) or bigint. */
  varint(v: number | bigint): this {
    if (typeof v === "number") {
      if (!Number.isSafeInteger(v) || v < 0) throw new RangeError(`varint out of range: ${v}`);
      if (v < U32_LIMIT) {
        this.reserve(5);
        let x = v >>> 0;
        while (x >= 0x80) {
          this.buf[this.len++] = (x & 0x7f) | 0x80;
          x >>>= 7;
        }
        this.buf[this.len++] = x;
        return this;
      }
      v = BigInt(v);
    }
    if (v < 0n || v > U64_MAX) throw new RangeError(`varint out of range: ${v}`);
    this.reserve(10);
    let x = v;
    while (x >= 0x80n) {
      this.buf[this.len++] = Number(x & 0x7fn) | 0x80;
      x >>= 7n;
    }
    this.buf[this.len++] = Number(x);
    return this;
  }

  raw(bytes: Uint8Array): this {
    this.reserve(bytes.length);
    this.buf.set(bytes, this.len);
    this.len += bytes.length;
    return this;
  }

  /** varint length + bytes. */
  bytes(b: Uint8Array): this {
    return this.varint(b.length).raw(b);
  }

  /** varint length + UTF-8. */
  string(s: string): this {
    return this.bytes(utf8Encode(s));
  }

  id(b: Id): this {
    if (b.length !== 16) throw new RangeError(`an id is 16 bytes, got ${b.length}`);
    return this.raw(b);
  }

  finish(): Uint8Array {
    return this.buf.slice(0, this.len);
  }
}

/** The minimal LEB128 encoding of `v`. */
export function encodeVarint(v: number | bigint): Uint8Array {
  return new Writer(10).varint(v).finish();
}

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

function utf8Encode(s: string): Uint8Array {
  return encoder.encode(s);
}

function u32Field(v: number, what: string): number {
  if (!Number.isInteger(v) || v < 0 || v >= U32_LIMIT) throw new RangeError(`${what} must be below 2^32: ${v}`);
  return v;
}

/** Encodes a frame (§3). Throws RangeError on values the protocol cannot carry. */
export function encodeFrame(f: Frame): Uint8Array {
  const w = new Writer(f.type === "data" ? f.payload.length + 24 : 48);
  switch (f.type) {
    case "hello": {
      if (f.token.length > MAX_TOKEN_LEN) throw new RangeError(`token longer than ${MAX_TOKEN_LEN} bytes`);
      w.u8(FrameType.Hello).u8(f.version).u8(f.resume ? 1 : 0).bytes(f.token);
      if (f.resume) {
        const { sessionId, proof, lastServerSeq, nonce } = f.resume;
        if (proof.length !== RESUME_PROOF_LEN) throw new RangeError(`a resume proof is ${RESUME_PROOF_LEN} bytes, got ${proof.length}`);
        w.id(sessionId).raw(proof).varint(lastServerSeq).varint(nonce);
      }
      break;
    }
    case "welcome":
      w.u8(FrameType.Welcome)
        .id(f.sessionId)
        .id(f.resumeToken)
        .u8(f.outcome)
        .varint(u32Field(f.heartbeatIntervalMs, "heartbeat_interval_ms"))
        .varint(u32Field(f.idleTimeoutMs, "idle_timeout_ms"))
        .varint(u32Field(f.maxFrameSize, "max_frame_size"))
        .varint(f.serverSeqBase)
        .varint(f.clientSeqAck);
      break;
    case "reject":
      w.u8(FrameType.Reject).u16(f.code).varint(u32Field(f.retryAfterMs, "retry_after_ms")).string(f.message);
      break;
    case "data": {
      const sequenced = isSequenced(f.cls);
      const flags = CLASS_BITS[f.cls] | (f.ack !== null ? 0x04 : 0);
      w.u8(FrameType.Data).u8(flags).varint(u32Field(f.msgId, "msg_id"));
      if (sequenced) w.varint(f.seq);
      if (f.ack !== null) w.varint(f.ack);
      w.raw(f.payload);
      break;
    }
    case "ack":
      w.u8(FrameType.Ack).varint(f.ack);
      break;
    case "ping":
      w.u8(FrameType.Ping).varint(f.timestamp);
      break;
    case "pong":
      w.u8(FrameType.Pong).varint(f.timestamp);
      break;
    case "migrate":
      w.u8(FrameType.Migrate)
        .varint(u32Field(f.deadlineMs, "deadline_ms"))
        .string(f.target)
        .id(f.sessionId)
        .id(f.resumeToken);
      break;
    case "close":
      w.u8(FrameType.Close).u16(f.code).string(f.message);
      break;
    case "error":
      w.u8(FrameType.Error)
        .u16(f.code)
        .varint(u32Field(f.msgId, "msg_id"))
        .varint(f.clientSeq)
        .varint(u32Field(f.retryAfterMs, "retry_after_ms"));
      break;
  }
  return w.finish();
}

// ---------------------------------------------------------------------------------------
// Reading

/** A cursor over one frame's bytes; every read checks bounds and throws ProtocolError. */
export class Reader {
  private pos = 0;
  constructor(private readonly buf: Uint8Array) {}

  get remaining(): number {
    return this.buf.length - this.pos;
  }

  private need(n: number, what: string): void {
    if (this.remaining < n) throw new ProtocolError(`truncated ${what}`);
  }

  u8(what = "u8"): number {
    this.need(1, what);
    return this.buf[this.pos++];
  }

  u16(what = "u16"): number {
    this.need(2, what);
    const v = (this.buf[this.pos] << 8) | this.buf[this.pos + 1];
    this.pos += 2;
    return v;
  }

  /** A u64 LEB128 (§1.2): at most 10 bytes, the 10th at most 1. Non-minimal is accepted. */
  varint(what = "varint"): bigint {
    // Fast path: up to 4 groups (28 bits) in plain number arithmetic.
    let small = 0;
    for (let i = 0; i < 4; i++) {
      this.need(1, what);
      const b = this.buf[this.pos++];
      small |= (b & 0x7f) << (7 * i);
      if ((b & 0x80) === 0) return BigInt(small >>> 0);
    }
    let v = BigInt(small >>> 0);
    for (let i = 4; i < 10; i++) {
      this.need(1, what);
      const b = this.buf[this.pos++];
      if (i === 9 && b > 1) throw new ProtocolError(`${what}: varint overflows 64 bits`);
      v |= BigInt(b & 0x7f) << BigInt(7 * i);
      if ((b & 0x80) === 0) return v;
    }
    throw new ProtocolError(`${what}: varint longer than 10 bytes`);
  }

  /** A varint that must be below 2^32 (§1.3), as a number. */
  varint32(what: string): number {
    const v = this.varint(what);
    if (v >= BigInt(U32_LIMIT)) throw new ProtocolError(`${what} must be below 2^32`);
    return Number(v);
  }

  /** A length prefix, as a number, that must fit the rest of the frame. */
  private length(what: string): number {
    const v = this.varint(`${what} length`);
    if (v > BigInt(this.remaining)) throw new ProtocolError(`${what} longer than the frame`);
    return Number(v);
  }

  raw(n: number, what: string): Uint8Array {
    this.need(n, what);
    const out = this.buf.slice(this.pos, this.pos + n);
    this.pos += n;
    return out;
  }

  bytes(what: string, max: number): Uint8Array {
    const n = this.length(what);
    if (n > max) throw new ProtocolError(`${what} longer than ${max} bytes`);
    return this.raw(n, what);
  }

  string(what: string, max: number): string {
    const b = this.bytes(what, max);
    try {
      return decoder.decode(b);
    } catch {
      throw new ProtocolError(`${what} is not valid UTF-8`);
    }
  }

  id(what: string): Id {
    return this.raw(16, what);
  }

  rest(): Uint8Array {
    const out = this.buf.slice(this.pos);
    this.pos = this.buf.length;
    return out;
  }
}

/** Decodes a varint from the start of `bytes` (tests, tools). */
export function decodeVarint(bytes: Uint8Array): bigint {
  return new Reader(bytes).varint();
}

function toBytes(input: ArrayBuffer | Uint8Array): Uint8Array {
  return input instanceof Uint8Array ? input : new Uint8Array(input);
}

/**
 * Decodes one frame. Trailing bytes after the known fields are ignored (§1.1) except in
 * DATA, whose payload is the rest. Throws {@link ProtocolError} for anything malformed:
 * unknown type, reserved flag bits, class 3, unknown WELCOME outcome, over-long fields,
 * invalid UTF-8, varints out of range.
 */
export function decodeFrame(input: ArrayBuffer | Uint8Array, maxFrameSize = DEFAULT_MAX_FRAME_SIZE): Frame {
  const buf = toBytes(input);
  if (buf.length === 0) throw new ProtocolError("empty frame");
  if (buf.length > maxFrameSize) {
    throw new ProtocolError(`frame of ${buf.length} bytes above the max frame size ${maxFrameSize}`, CloseCode.frame_too_large);
  }
  const r = new Reader(buf);
  const type = r.u8("type");
  switch (type) {
    case FrameType.Hello: {
      const version = r.u8("version");
      const flags = r.u8("flags");
      if (flags & 0xfe) throw new ProtocolError("HELLO: reserved flag bits set");
      const token = r.bytes("token", MAX_TOKEN_LEN);
      let resume: ResumeRequest | null = null;
      if (flags & 1) {
        resume = {
          sessionId: r.id("session_id"),
          proof: r.raw(RESUME_PROOF_LEN, "proof"),
          lastServerSeq: r.varint("last_server_seq"),
          nonce: r.varint("nonce"),
        };
      }
      return { type: "hello", version, token, resume };
    }
    case FrameType.Welcome: {
      const sessionId = r.id("session_id");
      const resumeToken = r.id("resume_token");
      const outcome = r.u8("outcome");
      if (outcome > 3) throw new ProtocolError(`WELCOME: unknown outcome ${outcome}`);
      return {
        type: "welcome",
        sessionId,
        resumeToken,
        outcome: outcome as WelcomeOutcome,
        heartbeatIntervalMs: r.varint32("heartbeat_interval_ms"),
        idleTimeoutMs: r.varint32("idle_timeout_ms"),
        maxFrameSize: r.varint32("max_frame_size"),
        serverSeqBase: r.varint("server_seq_base"),
        clientSeqAck: r.varint("client_seq_ack"),
      };
    }
    case FrameType.Reject:
      return {
        type: "reject",
        code: r.u16("code"),
        retryAfterMs: r.varint32("retry_after_ms"),
        message: r.string("message", MAX_MESSAGE_LEN),
      };
    case FrameType.Data: {
      const flags = r.u8("flags");
      if (flags & 0xf8) throw new ProtocolError("DATA: reserved flag bits set");
      const classBits = flags & 0x03;
      if (classBits === 3) throw new ProtocolError("DATA: reserved traffic class 3");
      const cls = CLASS_OF[classBits];
      const msgId = r.varint32("msg_id");
      const seq = isSequenced(cls) ? r.varint("seq") : 0n;
      const ack = flags & 0x04 ? r.varint("ack") : null;
      return { type: "data", cls, msgId, seq, ack, payload: r.rest() };
    }
    case FrameType.Ack:
      return { type: "ack", ack: r.varint("ack") };
    case FrameType.Ping:
      return { type: "ping", timestamp: r.varint("timestamp") };
    case FrameType.Pong:
      return { type: "pong", timestamp: r.varint("timestamp") };
    case FrameType.Migrate:
      return {
        type: "migrate",
        deadlineMs: r.varint32("deadline_ms"),
        target: r.string("target", MAX_TARGET_LEN),
        sessionId: r.id("session_id"),
        resumeToken: r.id("resume_token"),
      };
    case FrameType.Close:
      return { type: "close", code: r.u16("code"), message: r.string("message", MAX_MESSAGE_LEN) };
    case FrameType.Error:
      return {
        type: "error",
        code: r.u16("code"),
        msgId: r.varint32("msg_id"),
        clientSeq: r.varint("client_seq"),
        retryAfterMs: r.varint32("retry_after_ms"),
      };
    default:
      throw new ProtocolError(`unknown frame type 0x${type.toString(16).padStart(2, "0")}`);
  }
}

// ---------------------------------------------------------------------------------------
// Channel events (PROTOCOL.md §12.2)

/**
 * `msg_id` of the downstream DATA frames that carry channel events (§3.4, §12.2). Ids from
 * `0xFFFFFF00` up belong to the edge: backends cannot push them.
 */
export const CHANNEL_EVENT_MSG_ID = 0xffffff01;
/** The first of the edge's own downstream msg ids (§3.4). */
export const RESERVED_MSG_IDS_START = 0xffffff00;
/** Longest channel name, in bytes (§12.1). */
export const MAX_CHANNEL_NAME_LEN = 256;
/** Epochs are below 2^53 (§12.1): exact in a `number`. */
const EPOCH_LIMIT = 2 ** 53;

/** Channel event kinds (§12.2 `kind`). */
export const ChannelEventKind = {
  Publication: 0,
  Joined: 1,
  Left: 2,
  HistoryLost: 3,
} as const;
export type ChannelEventKind = (typeof ChannelEventKind)[keyof typeof ChannelEventKind];

/**
 * One channel event: the payload of a DATA frame with {@link CHANNEL_EVENT_MSG_ID}.
 * `epoch` is a `number` (the protocol keeps it below 2^53); `offset` is a `bigint`, like seqs.
 */
export interface ChannelEvent {
  kind: ChannelEventKind;
  /** The channel's name (`kind:name`, e.g. `guild:42`, or just `world`). */
  channel: string;
  /** The channel's epoch (changes when the channel is created again). */
  epoch: number;
  /**
   * PUBLICATION: its offset (0n for best-effort); JOINED / HISTORY_LOST: the position live
   * publications follow; LEFT: the last offset the member was sent.
   */
  offset: bigint;
  /** PUBLICATION: the publisher's bytes; markers: empty. */
  body: Uint8Array;
}

/** Encodes a channel event payload (§12.2; tests, tools). Throws RangeError on values the wire cannot carry. */
export function encodeChannelEvent(e: ChannelEvent): Uint8Array {
  if (!Number.isInteger(e.kind) || e.kind < 0 || e.kind > 0xff) throw new RangeError(`channel event kind must be a u8: ${e.kind}`);
  const name = utf8Encode(e.channel);
  if (name.length > MAX_CHANNEL_NAME_LEN) throw new RangeError(`channel name longer than ${MAX_CHANNEL_NAME_LEN} bytes`);
  if (!Number.isSafeInteger(e.epoch) || e.epoch < 0) throw new RangeError(`epoch must be below 2^53: ${e.epoch}`);
  return new Writer(name.length + e.body.length + 24).u8(e.kind).bytes(name).varint(e.epoch).varint(e.offset).raw(e.body).finish();
}

/**
 * Decodes the payload of a DATA frame with {@link CHANNEL_EVENT_MSG_ID} (§12.2). Throws
 * {@link ProtocolError} for anything malformed (truncated, a name above 256 bytes or not
 * UTF-8, varints out of range, an epoch of 2^53 or more) and for a kind this version does
 * not know (0–3), which a client ignores (§12.2). Never throws anything else.
 */
export function decodeChannelEvent(input: ArrayBuffer | Uint8Array): ChannelEvent {
  const r = new Reader(toBytes(input));
  const kind = r.u8("channel event kind");
  if (kind > ChannelEventKind.HistoryLost) throw new ProtocolError(`unknown channel event kind ${kind}`);
  const channel = r.string("channel", MAX_CHANNEL_NAME_LEN);
  const epoch = r.varint("epoch");
  if (epoch >= BigInt(EPOCH_LIMIT)) throw new ProtocolError("channel epoch must be below 2^53");
  const offset = r.varint("offset");
  return { kind: kind as ChannelEventKind, channel, epoch: Number(epoch), offset, body: r.rest() };
}

// ---------------------------------------------------------------------------------------
// Helpers

/** Decodes unpadded (or padded) base64url, as `waygate token` and login services print it. */
export function base64UrlDecode(s: string): Uint8Array {
  const b64 = s.trim().replace(/-/g, "+").replace(/_/g, "/");
  const padded = b64 + "===".slice((b64.length + 3) % 4);
  const bin = atob(padded);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** Lower-case hex of bytes (session ids in logs). */
export function toHex(b: Uint8Array): string {
  let s = "";
  for (const x of b) s += x.toString(16).padStart(2, "0");
  return s;
}
