// The fake edge the node tests drive: a scripted WebSocket whose instances the test plays
// as the server, frame by frame (PROTOCOL.md §7), and frame builders. Shared by
// test/client.test.mjs, test/webgl-bridge.test.mjs and the Chromium page
// browser-test/webgl-bridge.html, so it uses nothing node-specific. It lives outside test/
// so that `node --test test/` does not run it as a test file.
import { decodeFrame, encodeFrame } from "../dist/index.js";

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
export const id = (n) => new Uint8Array(16).fill(n);
export const text = (b) => new TextDecoder().decode(b);

/** A WebSocket class whose instances the test drives as the server. */
export function scriptedWebSocket() {
  class FakeWS {
    static all = [];
    constructor(url, protocols) {
      this.url = url;
      this.protocols = protocols;
      this.readyState = 0;
      this.binaryType = "blob";
      this.sent = [];
      this.raw = [];
      this.closed = null;
      this.onopen = this.onmessage = this.onclose = this.onerror = null;
      FakeWS.all.push(this);
    }
    send(bytes) {
      if (this.readyState !== 1) throw new Error("send on a socket that is not open");
      this.raw.push(bytes);
      this.sent.push(decodeFrame(bytes));
    }
    close(code, reason) {
      this.closed = { code, reason };
      this.readyState = 3;
    }
    // --- the server's side
    /** Opens, then waits for the HELLO: a resume HELLO goes out once its proof is computed (WebCrypto, asynchronous). */
    async open() {
      this.readyState = 1;
      this.onopen?.({});
      const deadline = Date.now() + 5000; // WebCrypto runs on node's thread pool: slow on a busy machine
      while (this.sent.length === 0 && this.readyState === 1 && Date.now() < deadline) await sleep(1);
    }
    deliver(frame) {
      const b = encodeFrame(frame);
      this.onmessage?.({ data: b.buffer.slice(b.byteOffset, b.byteOffset + b.length) });
    }
    drop(code = 1006) {
      this.readyState = 3;
      this.onclose?.({ code, reason: "" });
    }
    take() {
      const s = this.sent;
      this.sent = [];
      return s;
    }
  }
  return FakeWS;
}

export function welcome(outcome, opts = {}) {
  return {
    type: "welcome",
    sessionId: opts.sessionId ?? id(1),
    resumeToken: opts.resumeToken ?? id(2),
    outcome,
    heartbeatIntervalMs: opts.heartbeatIntervalMs ?? 10_000,
    idleTimeoutMs: opts.idleTimeoutMs ?? 30_000,
    maxFrameSize: opts.maxFrameSize ?? 65_536,
    serverSeqBase: opts.serverSeqBase ?? 0n,
    clientSeqAck: opts.clientSeqAck ?? 0n,
  };
}

export const data = (seq, msgId = 7, payload = `m${seq}`, cls = "normal", ack = null) => ({
  type: "data",
  cls,
  msgId,
  seq: BigInt(seq),
  ack,
  payload: new TextEncoder().encode(payload),
});


/** The msg id of an answer (PROTOCOL.md §13). */
export const ANSWER = 0xffffff02;

/**
 * A game server's answer (§13) as the edge forwards it: a critical DATA of msg id
 * 0xFFFFFF02 with the request id (u32 BE), the status (u16 BE) and the body.
 */
export function answer(seq, requestId, status = 0, body = "") {
  const b = typeof body === "string" ? new TextEncoder().encode(body) : body;
  const payload = new Uint8Array(6 + b.length);
  const v = new DataView(payload.buffer);
  v.setUint32(0, requestId);
  v.setUint16(4, status);
  payload.set(b, 6);
  return { type: "data", cls: "critical", msgId: ANSWER, seq: BigInt(seq), ack: null, payload };
}

/** A request DATA's id and body (§13: the id is a u32 BE in front of the body). */
export function requestOf(frame) {
  const p = frame.payload;
  return { id: new DataView(p.buffer, p.byteOffset, p.byteLength).getUint32(0), body: p.subarray(4) };
}

/** A clock answer's body: Unix ms as a u64 BE. */
export function unixMsBody(ms) {
  const b = new Uint8Array(8);
  new DataView(b.buffer).setBigUint64(0, BigInt(ms));
  return b;
}
