// Codec unit tests (node --test), against the examples of PROTOCOL.md.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  CHANNEL_EVENT_MSG_ID,
  ChannelEventKind,
  CloseCode,
  ProtocolError,
  base64UrlDecode,
  codeClass,
  codeLabel,
  decodeChannelEvent,
  decodeFrame,
  decodeVarint,
  encodeChannelEvent,
  encodeFrame,
  encodeVarint,
} from "../dist/index.js";

const hex = (b) => Buffer.from(b).toString("hex");
const bytes = (h) => new Uint8Array(Buffer.from(h.replace(/\s+/g, ""), "hex"));
const id = (n) => new Uint8Array(16).fill(n);

test("varint: the examples of §1.2", () => {
  const cases = [
    [0, "00"],
    [127, "7f"],
    [128, "8001"],
    [300, "ac02"],
    [16384, "808001"],
  ];
  for (const [v, h] of cases) {
    assert.equal(hex(encodeVarint(v)), h, `encode ${v}`);
    assert.equal(hex(encodeVarint(BigInt(v))), h, `encode ${v}n`);
    assert.equal(decodeVarint(bytes(h)), BigInt(v), `decode ${h}`);
  }
});

test("varint: full 64 bits round-trip, bigint and number", () => {
  const max = (1n << 64n) - 1n;
  assert.equal(hex(encodeVarint(max)), "ffffffffffffffffff01");
  assert.equal(decodeVarint(encodeVarint(max)), max);
  for (const v of [2n ** 32n - 1n, 2n ** 32n, 2n ** 53n - 1n, 2n ** 53n, 2n ** 63n, 0x0123456789abcdefn]) {
    assert.equal(decodeVarint(encodeVarint(v)), v, String(v));
  }
  assert.equal(decodeVarint(encodeVarint(Number.MAX_SAFE_INTEGER)), BigInt(Number.MAX_SAFE_INTEGER));
  assert.throws(() => encodeVarint(max + 1n), RangeError);
  assert.throws(() => encodeVarint(-1), RangeError);
  assert.throws(() => encodeVarint(2 ** 53), RangeError, "unsafe numbers must be bigints");
});

test("varint: malformed encodings are refused, non-minimal accepted", () => {
  assert.equal(decodeVarint(bytes("8000")), 0n);
  assert.throws(() => decodeVarint(bytes("ffffffffffffffffff02")), ProtocolError, "10th byte > 1");
  assert.throws(() => decodeVarint(bytes("ffffffffffffffffff8100")), ProtocolError, "11 bytes");
  assert.throws(() => decodeVarint(bytes("80")), ProtocolError, "truncated");
  assert.throws(() => decodeVarint(bytes("")), ProtocolError, "empty");
});

test("DATA: the example of §3.4 byte for byte", () => {
  const f = { type: "data", cls: "normal", msgId: 300, seq: 1n, ack: 2n, payload: new TextEncoder().encode("hi") };
  assert.equal(hex(encodeFrame(f)), "0405ac0201026869");
  assert.deepEqual(decodeFrame(bytes("0405ac0201026869")), f);
});

test("PING: the example of §2.1 without the stream length prefix", () => {
  assert.equal(hex(encodeFrame({ type: "ping", timestamp: 42n })), "062a");
  assert.deepEqual(decodeFrame(bytes("062a")), { type: "ping", timestamp: 42n });
});

test("every frame type round-trips", () => {
  const frames = [
    { type: "hello", version: 1, token: new Uint8Array([1, 2, 3]), resume: null },
    {
      type: "hello",
      version: 1,
      token: new Uint8Array(0),
      resume: { sessionId: id(7), proof: new Uint8Array(32).fill(9), lastServerSeq: (1n << 64n) - 1n, nonce: (1n << 64n) - 1n },
    },
    {
      type: "hello",
      version: 1,
      token: new Uint8Array([4]),
      resume: { sessionId: id(7), proof: new Uint8Array(32).fill(9), lastServerSeq: 0n, nonce: 1n },
    },
    {
      type: "welcome",
      sessionId: id(1),
      resumeToken: id(2),
      outcome: 2,
      heartbeatIntervalMs: 10000,
      idleTimeoutMs: 30000,
      maxFrameSize: 65536,
      serverSeqBase: 1n << 40n,
      clientSeqAck: 5n,
    },
    { type: "reject", code: 402, retryAfterMs: 250, message: "busy ✓" },
    { type: "data", cls: "critical", msgId: 0, seq: 1n, ack: null, payload: new Uint8Array(0) },
    { type: "data", cls: "bestEffort", msgId: 4294967295, seq: 0n, ack: 3n, payload: new Uint8Array([0xff]) },
    { type: "ack", ack: 123456789012345678n },
    { type: "pong", timestamp: 0n },
    { type: "migrate", deadlineMs: 5000, target: "ws://127.0.0.1:9/", sessionId: id(3), resumeToken: id(4) },
    { type: "close", code: 301, message: "kicked" },
    { type: "error", code: 404, msgId: 77, clientSeq: 12n, retryAfterMs: 0 },
  ];
  for (const f of frames) {
    const enc = encodeFrame(f);
    assert.deepEqual(decodeFrame(enc), f, f.type);
    assert.deepEqual(decodeFrame(enc.buffer.slice(enc.byteOffset, enc.byteOffset + enc.length)), f, `${f.type} from ArrayBuffer`);
  }
});

test("HELLO layout: version, flags, token, resume part (session_id, proof, last_server_seq, nonce)", () => {
  const enc = encodeFrame({
    type: "hello",
    version: 1,
    token: new Uint8Array([0xaa, 0xbb]),
    resume: { sessionId: id(0x11), proof: new Uint8Array(32).fill(0x22), lastServerSeq: 300n, nonce: 2n },
  });
  assert.equal(hex(enc), "010101" + "02aabb" + "11".repeat(16) + "22".repeat(32) + "ac02" + "02");
  // Truncated resume parts are protocol errors: inside the proof, and without the nonce.
  for (const cut of [3 + 3 + 16 + 31, enc.length - 1]) {
    assert.throws(() => decodeFrame(enc.subarray(0, cut)), (e) => e instanceof ProtocolError && e.code === CloseCode.protocol_error, `cut at ${cut}`);
  }
});

test("WELCOME, REJECT, CLOSE, ERROR: u16 big-endian and trailing bytes ignored (§1.1)", () => {
  const close = decodeFrame(bytes("09012d03627965ffff"));
  assert.deepEqual(close, { type: "close", code: 301, message: "bye" });
  const reject = decodeFrame(bytes("030192e8070000"));
  assert.deepEqual(reject, { type: "reject", code: 402, retryAfterMs: 1000, message: "" });
  const err = decodeFrame(bytes("0a0193e8070500"));
  assert.deepEqual(err, { type: "error", code: 403, msgId: 1000, clientSeq: 5n, retryAfterMs: 0 });
  const welcome = encodeFrame({
    type: "welcome",
    sessionId: id(1),
    resumeToken: id(2),
    outcome: 0,
    heartbeatIntervalMs: 1,
    idleTimeoutMs: 2,
    maxFrameSize: 3,
    serverSeqBase: 4n,
    clientSeqAck: 5n,
  });
  const extended = new Uint8Array([...welcome, 1, 2, 3]);
  assert.equal(decodeFrame(extended).clientSeqAck, 5n);
});

test("malformed frames are protocol errors with the right code", () => {
  const bad = [
    ["", "empty"],
    ["ff", "unknown type"],
    ["0b00", "unknown type 0x0b"],
    ["0408e80700", "DATA reserved flag bit 3"],
    ["0403e80700", "DATA class 3"],
    ["0401e807", "DATA normal without seq"],
    ["0405e80701", "DATA ack flag without ack"],
    ["04008080808010" + "01", "msg_id = 2^32"],
    ["0102" + "00", "HELLO reserved flag"],
    ["09012d03ff", "CLOSE truncated string"],
    ["09012d02c328", "CLOSE invalid UTF-8"],
    ["0301", "REJECT truncated code"],
    ["02" + "00".repeat(32) + "04", "WELCOME unknown outcome"],
    ["02" + "00".repeat(32) + "00" + "8080808010" + "00000000", "WELCOME heartbeat >= 2^32"],
    ["08" + "00" + "0a41", "MIGRATE truncated"],
    ["05", "ACK without value"],
  ];
  for (const [h, why] of bad) {
    assert.throws(() => decodeFrame(bytes(h)), (e) => e instanceof ProtocolError && e.code === CloseCode.protocol_error, why);
  }
  const long = new Uint8Array(1025 + 4);
  long.set([0x09, 0x00, 0x00, 0x81, 0x08]);
  assert.throws(() => decodeFrame(long), ProtocolError, "CLOSE message above 1024 bytes");
  const big = new Uint8Array(65537);
  big[0] = 0x04;
  big[1] = 0x02;
  assert.throws(
    () => decodeFrame(big),
    (e) => e instanceof ProtocolError && e.code === CloseCode.frame_too_large,
    "frame above the max frame size",
  );
  const ok = new Uint8Array(65536);
  ok[0] = 0x04;
  ok[1] = 0x02;
  assert.equal(decodeFrame(ok).payload.length, 65536 - 3);
});

test("encoder refuses what the wire cannot carry", () => {
  assert.throws(() => encodeFrame({ type: "data", cls: "normal", msgId: 2 ** 32, seq: 1n, ack: null, payload: new Uint8Array() }), RangeError);
  assert.throws(() => encodeFrame({ type: "close", code: 70000, message: "" }), RangeError);
  assert.throws(() => encodeFrame({ type: "hello", version: 1, token: new Uint8Array(4097), resume: null }), RangeError);
  assert.throws(
    () => encodeFrame({ type: "hello", version: 1, token: new Uint8Array(), resume: { sessionId: id(1).subarray(0, 15), proof: new Uint8Array(32), lastServerSeq: 0n, nonce: 1n } }),
    RangeError,
  );
  for (const n of [0, 16, 31, 33]) {
    assert.throws(
      () => encodeFrame({ type: "hello", version: 1, token: new Uint8Array(), resume: { sessionId: id(1), proof: new Uint8Array(n), lastServerSeq: 0n, nonce: 1n } }),
      /resume proof is 32 bytes/,
      `proof of ${n} bytes`,
    );
  }
  assert.throws(
    () => encodeFrame({ type: "hello", version: 1, token: new Uint8Array(), resume: { sessionId: id(1), proof: new Uint8Array(32), lastServerSeq: 0n, nonce: 1n << 64n } }),
    RangeError,
    "nonce above u64",
  );
});

test("auth token base64url of §7.2.3 decodes to the 69 documented bytes", () => {
  const t = base64UrlDecode("AQAAAAcAAAAAZVPxAAAAAABlU_8QAnAxBWxvZ2luAAWAAAJldWRsSgW7K_qpMngfMer1_GShOZHU8iiyEVdX_ULK0u3w");
  assert.equal(t.length, 69);
  assert.equal(
    hex(t),
    "0100000007000000006553f100000000006553ff10027031056c6f67696e00058000026575" +
      "646c4a05bb2bfaa932781f31eaf5fc64a13991d4f228b2115757fd42cad2edf0",
  );
});

test("close codes: labels and classes of unknown codes (§1.1)", () => {
  assert.equal(codeLabel(301), "kicked");
  assert.equal(codeLabel(499), "code_499");
  assert.equal(codeClass(499), "load");
  assert.equal(codeClass(250), "auth");
  assert.equal(codeClass(5), "general");
});

// ---------------------------------------------------------------------------------------
// Channel events (PROTOCOL.md §12.2)

const EXAMPLE_12_2 = "00 08 67 75 69 6c 64 3a 34 32 ac 02 07 68 69";

test("channel event: the example of §12.2 both ways", () => {
  const e = { kind: ChannelEventKind.Publication, channel: "guild:42", epoch: 300, offset: 7n, body: new TextEncoder().encode("hi") };
  assert.equal(hex(encodeChannelEvent(e)), EXAMPLE_12_2.replace(/ /g, ""));
  assert.deepEqual(decodeChannelEvent(bytes(EXAMPLE_12_2)), e);
  const b = bytes(EXAMPLE_12_2);
  assert.deepEqual(decodeChannelEvent(b.buffer.slice(b.byteOffset, b.byteOffset + b.length)), e, "from an ArrayBuffer");
  assert.equal(CHANNEL_EVENT_MSG_ID, 0xffffff01);
  assert.equal(CHANNEL_EVENT_MSG_ID, 4294967041);
  // Carried in DATA like any message (§3.4): msg_id 0xFFFFFF01 is a valid u32.
  const f = { type: "data", cls: "normal", msgId: CHANNEL_EVENT_MSG_ID, seq: 3n, ack: null, payload: bytes(EXAMPLE_12_2) };
  assert.deepEqual(decodeChannelEvent(decodeFrame(encodeFrame(f)).payload), e);
});

test("channel event: every kind and the extreme values round-trip", () => {
  const events = [
    { kind: ChannelEventKind.Joined, channel: "world", epoch: 0, offset: 0n, body: new Uint8Array(0) },
    { kind: ChannelEventKind.Left, channel: "room:lobby", epoch: 2 ** 53 - 1, offset: (1n << 64n) - 1n, body: new Uint8Array(0) },
    { kind: ChannelEventKind.HistoryLost, channel: "x".repeat(256), epoch: 2 ** 32, offset: 1n << 40n, body: new Uint8Array(0) },
    { kind: ChannelEventKind.Publication, channel: "guild:é✓", epoch: 1, offset: 0n, body: new Uint8Array([0, 0xff, 0x7c]) },
  ];
  for (const e of events) assert.deepEqual(decodeChannelEvent(encodeChannelEvent(e)), e, `kind ${e.kind}`);
  assert.deepEqual(ChannelEventKind, { Publication: 0, Joined: 1, Left: 2, HistoryLost: 3 });
});

test("channel event: truncation and malformed payloads are protocol errors", () => {
  const full = bytes(EXAMPLE_12_2);
  // Up to the offset every prefix is truncated; from there on the body is just shorter.
  for (let n = 0; n < 13; n++) {
    assert.throws(() => decodeChannelEvent(full.subarray(0, n)), ProtocolError, `prefix of ${n} bytes`);
  }
  for (let n = 13; n <= full.length; n++) {
    assert.equal(decodeChannelEvent(full.subarray(0, n)).body.length, n - 13);
  }
  const bad = [
    ["04 05 77 6f 72 6c 64 01 01", "unknown kind 4 (ignored by a client)"],
    ["ff 00 01 01", "unknown kind 255"],
    ["01 81 02" + " 61".repeat(257) + " 01 01", "name of 257 bytes"],
    ["01 02 c3 28 01 01", "name not UTF-8"],
    ["01 05 77 6f 72 6c 64 80 80 80 80 80 80 80 10 01", "epoch = 2^53"],
    ["01 05 77 6f 72 6c 64 01 ff ff ff ff ff ff ff ff ff 02", "offset above 64 bits"],
    ["01 05 77 6f 72 6c 64 01 ff ff ff ff ff ff ff ff ff 81 00", "offset of 11 bytes (its 10th byte > 1)"],
    ["01 ff ff ff ff ff ff ff ff ff 01", "name length of 2^64 - 1"],
  ];
  for (const [h, why] of bad) {
    assert.throws(() => decodeChannelEvent(bytes(h)), (e) => e instanceof ProtocolError && e.code === CloseCode.protocol_error, why);
  }
  // The largest valid epoch still decodes.
  assert.equal(decodeChannelEvent(bytes("01 05 77 6f 72 6c 64 ff ff ff ff ff ff ff 0f 01")).epoch, 2 ** 53 - 1);
});

test("channel event: arbitrary bytes never throw anything but ProtocolError", () => {
  let x = 0x9e3779b9;
  const rand = () => {
    // xorshift32: deterministic, so a failure reproduces.
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    return (x >>> 0) / 2 ** 32;
  };
  const valid = bytes(EXAMPLE_12_2);
  let decoded = 0;
  for (let i = 0; i < 20_000; i++) {
    let b;
    if (i % 2 === 0) {
      b = new Uint8Array(Math.floor(rand() * 40));
      for (let j = 0; j < b.length; j++) b[j] = rand() < 0.3 ? Math.floor(rand() * 4) : Math.floor(rand() * 256);
    } else {
      // Mutations of a valid payload: flipped bytes, cut or extended.
      b = new Uint8Array(valid.slice(0, Math.floor(rand() * (valid.length + 4))));
      for (let k = 0; k < 1 + Math.floor(rand() * 3); k++) if (b.length) b[Math.floor(rand() * b.length)] = Math.floor(rand() * 256);
    }
    try {
      const e = decodeChannelEvent(b);
      assert.ok(e.kind >= 0 && e.kind <= 3 && Number.isSafeInteger(e.epoch) && typeof e.offset === "bigint" && e.body instanceof Uint8Array);
      decoded++;
    } catch (e) {
      assert.ok(e instanceof ProtocolError, `input ${hex(b)} threw ${e}`);
    }
  }
  assert.ok(decoded > 100, `some inputs decode (${decoded})`);
});

test("channel event: the encoder refuses what the wire cannot carry", () => {
  const ok = { kind: 0, channel: "world", epoch: 1, offset: 1n, body: new Uint8Array(0) };
  assert.throws(() => encodeChannelEvent({ ...ok, channel: "x".repeat(257) }), RangeError);
  assert.throws(() => encodeChannelEvent({ ...ok, epoch: 2 ** 53 }), RangeError);
  assert.throws(() => encodeChannelEvent({ ...ok, epoch: -1 }), RangeError);
  assert.throws(() => encodeChannelEvent({ ...ok, offset: 1n << 64n }), RangeError);
  assert.throws(() => encodeChannelEvent({ ...ok, kind: 256 }), RangeError);
});
