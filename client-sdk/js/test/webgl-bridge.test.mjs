// The Unity WebGL bridge (client-sdk/unity-webgl/Plugins/WaygateWebGL.jslib) at its JS
// boundary: the .jslib is linked and run the way Emscripten would (test-support/
// emscripten-mock.mjs: stringified library items, a heap, _malloc, the UTF-8 helpers), with
// the SDK on the page as the global `Waygate` (dist/global.js, the documented bootstrap),
// against the scripted WebSocket server the other node tests use. C# would make exactly
// these calls through [DllImport("__Internal")].
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { CHANNEL_EVENT_MSG_ID, ChannelEventKind, CloseCode, encodeChannelEvent } from "../dist/index.js";
import "../dist/global.js"; // globalThis.Waygate, as on a page
import { loadJslib } from "../test-support/emscripten-mock.mjs";
import { answer, data, id, requestOf, scriptedWebSocket, sleep, text, unixMsBody, welcome } from "../test-support/fake-edge.mjs";

const UNITY = fileURLToPath(new URL("../../unity-webgl/", import.meta.url));
const JSLIB = join(UNITY, "Plugins/WaygateWebGL.jslib");
const source = readFileSync(JSLIB, "utf8");

// waygate_result and the state codes, as the C# side declares them.
const R = { OK: 0, NO_EVENT: 1, INVALID_ARGUMENT: 2, INVALID_STATE: 3, CLOSED: 4, BUFFER_FULL: 5, DROPPED: 6, INTERNAL: 7, PANIC: 8 };
const STATE = { idle: 0, connecting: 1, connected: 2, reconnecting: 3, closed: 4, paused: 5 };

/**
 * A fresh module (heap + bridge) and a scripted WebSocket installed as the page's
 * `WebSocket` while the client is created (the SDK takes it then). `poll()` returns the next
 * event parsed (or the raw return code when there is none), `events()` drains.
 */
function bridge(t) {
  const m = loadJslib(source);
  const WS = scriptedWebSocket();
  const had = Object.getOwnPropertyDescriptor(globalThis, "WebSocket");
  const api = m.api;
  const bufLen = 64 * 1024;
  const buf = m.malloc(bufLen);
  const lastError = () => {
    const n = api.WaygateWebGL_LastError(buf, bufLen);
    return m.readText(buf, n);
  };
  const create = (options) => {
    Object.defineProperty(globalThis, "WebSocket", { value: WS, configurable: true, writable: true });
    try {
      const p = m.cstr(typeof options === "string" ? options : JSON.stringify(options));
      const h = api.WaygateWebGL_Create(p);
      m.free(p);
      return h;
    } finally {
      if (had) Object.defineProperty(globalThis, "WebSocket", had);
      else delete globalThis.WebSocket;
    }
  };
  const poll = (h) => {
    const n = api.WaygateWebGL_Poll(h, buf, bufLen);
    if (n <= 0) return n;
    assert.ok(n < bufLen, `event of ${n} bytes fits`);
    assert.equal(m.HEAPU8[buf + n], 0, "NUL-terminated");
    return JSON.parse(m.readText(buf, n));
  };
  const events = (h) => {
    const out = [];
    for (let i = 0; i < 10_000; i++) {
      const e = poll(h);
      if (typeof e === "number") return out;
      out.push(e);
    }
    throw new Error("more than 10,000 events");
  };
  const send = (h, cls, msgId, payload) => {
    const [p, len] = m.bytes(payload);
    const r = api.WaygateWebGL_Send(h, cls, msgId, p, len);
    m.free(p);
    return r;
  };
  const request = (h, cls, msgId, body, timeoutMs = 10_000) => {
    const [p, len] = m.bytes(body);
    const r = api.WaygateWebGL_Request(h, cls, msgId, p, len, timeoutMs);
    m.free(p);
    return r;
  };
  const stats = (h) => {
    const n = api.WaygateWebGL_Stats(h, buf, bufLen);
    return JSON.parse(m.readText(buf, n));
  };
  t.after(() => {
    for (let h = 1; h < 20; h++) api.WaygateWebGL_Free(h);
  });
  return { m, api, WS, buf, bufLen, create, poll, events, send, request, stats, lastError };
}

const OPTIONS = { urls: ["ws://edge-a/", "ws://edge-b/"], token: "qrs", backoffMinMs: 1, backoffMaxMs: 8 };
const kinds = (evs) => evs.map((e) => e.kind);
const b64 = (s) => Buffer.from(s, "base64");

/** Opens the latest socket and answers its HELLO with WELCOME(outcome). */
async function welcomeLatest(b, outcome, opts) {
  const ws = b.WS.all.at(-1);
  await ws.open();
  const hello = ws.take();
  ws.deliver(welcome(outcome, opts));
  return { ws, hello };
}

test("webgl bridge: create, connect, send, poll (stateChange, connected with outcome, message), state codes, close", async (t) => {
  const b = bridge(t);
  const h = b.create(OPTIONS);
  assert.ok(h >= 1, b.lastError());
  const { api } = b;
  assert.equal(api.WaygateWebGL_State(h), STATE.idle);
  assert.equal(b.poll(h), -R.INVALID_STATE, "polling before Connect (as the C ABI)");
  assert.equal(b.send(h, 1, 1000, "early"), R.INVALID_STATE);
  assert.match(b.lastError(), /Connect first/);
  assert.equal(api.WaygateWebGL_Connect(h), R.OK);
  assert.equal(api.WaygateWebGL_Connect(h), R.INVALID_STATE, "connecting twice");
  assert.equal(api.WaygateWebGL_State(h), STATE.connecting);
  assert.deepEqual(b.events(h), [{ kind: "stateChange", from: "idle", to: "connecting" }]);
  assert.equal(b.poll(h), 0, "nothing ready");

  const { ws, hello } = await welcomeLatest(b, 0);
  assert.deepEqual(hello[0].token, new Uint8Array([0xaa, 0xbb]), "the base64url token of the options");
  assert.equal(api.WaygateWebGL_State(h), STATE.connected);
  assert.deepEqual(b.events(h), [
    { kind: "stateChange", from: "connecting", to: "connected" },
    { kind: "connected", url: "ws://edge-a/", sessionId: "01".repeat(16), outcome: "new_session" },
    { kind: "newSession", sessionId: "01".repeat(16), restoreFailed: false, discarded: 0 },
  ]);
  ws.take();

  // Sending: the bytes are copied from the heap; the seq is read separately.
  assert.equal(b.send(h, 0, 1000, "hello"), R.OK);
  assert.equal(api.WaygateWebGL_LastSeq(h), 1);
  assert.equal(b.send(h, 2, 3000, new Uint8Array([1, 2, 3])), R.OK);
  assert.equal(api.WaygateWebGL_LastSeq(h), 0, "best-effort has no seq");
  assert.equal(b.send(h, 1, -16, ""), R.OK, "a u32 msg id above 2^31 arrives as a negative int");
  assert.deepEqual(
    ws.take().map((f) => [f.cls, f.msgId, f.seq, [...f.payload]]),
    [
      ["critical", 1000, 1n, [...new TextEncoder().encode("hello")]],
      ["bestEffort", 3000, 0n, [1, 2, 3]],
      ["normal", 0xfffffff0, 2n, []],
    ],
  );
  assert.equal(b.send(h, 7, 1000, "x"), R.INVALID_ARGUMENT);
  assert.match(b.lastError(), /unknown traffic class 7/);

  // Receiving: payload in base64, seq as an exact integer, the class as WAYGATE_CLASS_*.
  const body = "héllo ☃ \u0000 \"quoted\"";
  ws.deliver(data(1, 2001, body, "critical"));
  ws.deliver(data(0, 2002, "fast", "bestEffort"));
  const msgs = b.events(h);
  assert.deepEqual(kinds(msgs), ["message", "message"]);
  assert.deepEqual({ ...msgs[0], payload: b64(msgs[0].payload).toString() }, { kind: "message", msgId: 2001, trafficClass: 0, seq: 1, payload: body });
  assert.equal(msgs[1].trafficClass, 2);
  assert.equal(msgs[1].seq, 0);

  // A drill: the link drops, the client resumes.
  assert.equal(api.WaygateWebGL_DropLink(h), R.OK);
  assert.equal(api.WaygateWebGL_State(h), STATE.reconnecting);
  await sleep(5);
  await welcomeLatest(b, 1, { serverSeqBase: 1n, clientSeqAck: 2n });
  const resumed = b.events(h);
  assert.deepEqual(kinds(resumed), ["stateChange", "disconnected", "stateChange", "connected", "restored"]);
  assert.deepEqual(resumed[0], { kind: "stateChange", from: "connected", to: "reconnecting" });
  assert.equal(resumed[3].outcome, "restored");
  assert.equal(api.WaygateWebGL_State(h), STATE.connected);

  // Pause and resume (OnApplicationPause).
  assert.equal(api.WaygateWebGL_Pause(h), R.OK);
  assert.equal(api.WaygateWebGL_State(h), STATE.paused);
  assert.equal(api.WaygateWebGL_ReconnectNow(h), R.OK);
  await sleep(5);
  await welcomeLatest(b, 1, { serverSeqBase: 1n, clientSeqAck: 2n });
  assert.equal(api.WaygateWebGL_State(h), STATE.connected);
  b.events(h);

  // Stats as JSON.
  const n = api.WaygateWebGL_Stats(h, b.buf, b.bufLen);
  const stats = JSON.parse(b.m.readText(b.buf, n));
  assert.equal(stats.state, "connected");
  assert.equal(stats.connects, 3);
  assert.equal(stats.unacked, 0);
  assert.equal(stats.lastServerSeq, 1);
  assert.equal(stats.droppedEvents, 0);

  // Close: the terminal events, then polls say CLOSED; calls after the end say CLOSED.
  assert.equal(api.WaygateWebGL_Close(h), R.OK);
  assert.equal(api.WaygateWebGL_Close(h), R.OK, "closing twice is fine");
  assert.equal(api.WaygateWebGL_State(h), STATE.closed);
  assert.deepEqual(b.events(h), [
    { kind: "stateChange", from: "connected", to: "closed" },
    { kind: "closed", code: CloseCode.normal, label: "normal", reason: "client closed" },
  ]);
  assert.equal(b.poll(h), -R.CLOSED);
  assert.equal(b.send(h, 1, 1000, "late"), R.CLOSED);
  assert.equal(api.WaygateWebGL_Connect(h), R.CLOSED);
  assert.equal(api.WaygateWebGL_ReconnectNow(h), R.CLOSED);
  api.WaygateWebGL_Free(h);
  assert.equal(api.WaygateWebGL_State(h), -R.INVALID_ARGUMENT, "a freed handle is unknown");
  assert.equal(b.poll(h), -R.INVALID_ARGUMENT);
  assert.equal(api.WaygateWebGL_Connect(h), R.INVALID_ARGUMENT);
  assert.match(b.lastError(), /unknown waygate handle/);
});

test("webgl bridge: a poll buffer too small returns the length needed and keeps the event", async (t) => {
  const b = bridge(t);
  const h = b.create(OPTIONS);
  b.api.WaygateWebGL_Connect(h);
  const { ws } = await welcomeLatest(b, 0);
  b.events(h);
  const big = "x".repeat(3000);
  ws.deliver(data(1, 2001, big));
  ws.deliver(data(2, 2001, "next"));
  const small = b.m.malloc(16);
  const need = b.api.WaygateWebGL_Poll(h, small, 16);
  assert.ok(need > 4000, `needed ${need}`);
  assert.equal(b.api.WaygateWebGL_Poll(h, 0, 1 << 20), need, "no buffer: a size query");
  assert.equal(b.api.WaygateWebGL_Poll(h, small, 16), need, "still there");
  assert.equal(b.api.WaygateWebGL_Pending(h), 2);
  const exact = b.m.malloc(need);
  const n = b.api.WaygateWebGL_Poll(h, exact, need);
  assert.equal(n, need - 1, "fits exactly: bytes written without the NUL");
  const ev = JSON.parse(b.m.readText(exact, n));
  assert.equal(ev.seq, 1);
  assert.equal(b64(ev.payload).toString(), big);
  assert.equal(b64(b.poll(h).payload).toString(), "next", "then the next event");
  assert.equal(b.api.WaygateWebGL_Pending(h), 0);
  // The same convention for LastError and Stats.
  b.send(h, 9, 1, "");
  const errNeed = b.api.WaygateWebGL_LastError(small, 4);
  assert.ok(errNeed > 4);
  const errBuf = b.m.malloc(errNeed);
  assert.equal(b.m.readText(errBuf, b.api.WaygateWebGL_LastError(errBuf, errNeed)), "unknown traffic class 9");
  assert.ok(b.api.WaygateWebGL_Stats(h, small, 16) > 16);
  b.api.WaygateWebGL_Close(h);
});

test("webgl bridge: a full event queue reports what it dropped (eventsDropped, in place), terminal events are kept", async (t) => {
  const b = bridge(t);
  const h = b.create({ ...OPTIONS, maxQueuedEvents: 4 });
  b.api.WaygateWebGL_Connect(h);
  const { ws } = await welcomeLatest(b, 0);
  // Queued: stateChange x2, connected, newSession: full. The next 10 messages do not fit.
  for (let s = 1; s <= 10; s++) ws.deliver(data(s));
  assert.equal(b.api.WaygateWebGL_Pending(h), 5, "4 events + the pending drop report");
  const first = b.events(h);
  assert.deepEqual(kinds(first), ["stateChange", "stateChange", "connected", "newSession", "eventsDropped"]);
  assert.deepEqual(first.at(-1), { kind: "eventsDropped", count: 10, totalDropped: 10 }, "reported once the queue drained");
  // Now room appears mid-stream: 4 queued, 3 dropped, 2 taken, then 2 more arrive.
  for (let s = 11; s <= 17; s++) ws.deliver(data(s));
  assert.deepEqual([b.poll(h).seq, b.poll(h).seq], [11, 12]);
  ws.deliver(data(18));
  ws.deliver(data(19));
  const rest = b.events(h);
  assert.deepEqual(
    rest.map((e) => (e.kind === "message" ? e.seq : e)),
    [13, 14, { kind: "eventsDropped", count: 3, totalDropped: 13 }, 18, { kind: "eventsDropped", count: 1, totalDropped: 14 }],
    "each report sits where its events were lost (19 did not fit after 18)",
  );
  // Terminal events are never dropped, even into a full queue.
  for (let s = 20; s <= 30; s++) ws.deliver(data(s));
  ws.deliver({ type: "close", code: CloseCode.kicked, message: "another login" });
  assert.equal(b.api.WaygateWebGL_State(h), STATE.closed);
  const end = b.events(h);
  assert.deepEqual(end.slice(0, 4).map((e) => e.seq), [20, 21, 22, 23]);
  assert.deepEqual(end.slice(4), [
    { kind: "eventsDropped", count: 8, totalDropped: 22 }, // 24..30 and `disconnected`
    { kind: "kicked", code: CloseCode.kicked, message: "another login" },
    { kind: "stateChange", from: "connected", to: "closed" },
    { kind: "closed", code: CloseCode.kicked, label: "kicked", reason: "another login" },
  ]);
  assert.equal(b.poll(h), -R.CLOSED);
  const n = b.api.WaygateWebGL_Stats(h, b.buf, b.bufLen);
  assert.equal(JSON.parse(b.m.readText(b.buf, n)).droppedEvents, 22);
});

test("webgl bridge: maxOfflineAgeMs passes through; expired events and renumbered seqs reach C#", async (t) => {
  const real = performance.now.bind(performance);
  let skew = 0;
  t.mock.method(performance, "now", () => real() + skew);
  const b = bridge(t);
  const h = b.create({ ...OPTIONS, maxOfflineAgeMs: 1000 });
  b.api.WaygateWebGL_Connect(h);
  await welcomeLatest(b, 0);
  b.api.WaygateWebGL_DropLink(h);
  await sleep(5);
  assert.equal(b.send(h, 1, 1001, "stale"), R.OK);
  assert.equal(b.api.WaygateWebGL_LastSeq(h), 1);
  skew += 5000;
  assert.equal(b.send(h, 1, 1002, "fresh"), R.OK);
  assert.equal(b.api.WaygateWebGL_LastSeq(h), 2);
  b.events(h);
  const { ws } = await welcomeLatest(b, 1);
  const evs = b.events(h);
  assert.deepEqual(kinds(evs), ["stateChange", "connected", "expired", "restored"]);
  assert.equal(evs[2].msgId, 1001);
  assert.equal(evs[2].seq, 1);
  assert.ok(evs[2].ageMs >= 5000);
  assert.deepEqual(ws.take().filter((f) => f.type === "data").map((f) => [f.seq, text(f.payload)]), [[1n, "fresh"]]);
  b.api.WaygateWebGL_Close(h);
});

test("webgl bridge: setToken and reconnectNow", async (t) => {
  const b = bridge(t);
  const h = b.create(OPTIONS);
  const [p, len] = b.m.bytes(new Uint8Array([7, 7, 7]));
  assert.equal(b.api.WaygateWebGL_SetToken(h, p, len), R.INVALID_STATE, "before Connect (as the C ABI)");
  assert.equal(b.api.WaygateWebGL_ReconnectNow(h), R.INVALID_STATE);
  assert.equal(b.api.WaygateWebGL_DropLink(h), R.INVALID_STATE);
  b.api.WaygateWebGL_Connect(h);
  await welcomeLatest(b, 0);
  assert.equal(b.api.WaygateWebGL_SetToken(h, p, len), R.OK);
  b.m.HEAPU8.fill(0, p, p + len); // the bridge copied the bytes
  assert.equal(b.api.WaygateWebGL_ReconnectNow(h), R.OK);
  assert.equal(b.WS.all.length, 2, "a new socket at once");
  const { hello } = await welcomeLatest(b, 1);
  assert.deepEqual(hello[0].token, new Uint8Array([7, 7, 7]));
  assert.ok(hello[0].resume, "resumes");
  assert.equal(b.api.WaygateWebGL_State(h), STATE.connected);
  b.api.WaygateWebGL_Close(h);
});

test("webgl bridge: bad options and a page without the SDK give handle 0 and a reason", (t) => {
  const b = bridge(t);
  for (const [options, why] of [
    ["{not json", /not JSON/],
    ["[1]", /JSON object/],
    [{ token: "qrs" }, /urls is required/],
    [{ ...OPTIONS, urls: "ws://a/, ws://b/" }, null],
    [{ ...OPTIONS, urls: ["http://a/"] }, /not a ws:\/\/ or wss:\/\/ URL/],
    [{ ...OPTIONS, backofMinMs: 5 }, /unknown option "backofMinMs"/],
    [{ ...OPTIONS, livenessMs: -1 }, /livenessMs must be a number >= 0/],
    [{ ...OPTIONS, maxQueuedEvents: 1 }, /maxQueuedEvents/],
    [{ ...OPTIONS, lifecycleHooks: "no" }, /true or false/],
    [{ ...OPTIONS, token: "not base64url!" }, /./],
  ]) {
    const h = b.create(options);
    if (why === null) {
      assert.ok(h >= 1, `${JSON.stringify(options)}: ${b.lastError()}`);
    } else {
      assert.equal(h, 0, JSON.stringify(options));
      assert.match(b.lastError(), why);
    }
  }
  const saved = globalThis.Waygate;
  delete globalThis.Waygate;
  try {
    assert.equal(b.create(OPTIONS), 0);
    assert.match(b.lastError(), /not on the page.*dist\/global\.js/);
  } finally {
    globalThis.Waygate = saved;
  }
});

test("webgl bridge: handles are independent; Free closes an open session", async (t) => {
  const b = bridge(t);
  const h1 = b.create(OPTIONS);
  const h2 = b.create({ ...OPTIONS, urls: ["ws://edge-c/"] });
  assert.notEqual(h1, h2);
  b.api.WaygateWebGL_Connect(h1);
  b.api.WaygateWebGL_Connect(h2);
  const [ws1, ws2] = b.WS.all;
  assert.deepEqual([ws1.url, ws2.url], ["ws://edge-a/", "ws://edge-c/"]);
  await ws1.open();
  ws1.deliver(welcome(0, { sessionId: id(1) }));
  assert.equal(b.api.WaygateWebGL_State(h1), STATE.connected);
  assert.equal(b.api.WaygateWebGL_State(h2), STATE.connecting);
  ws1.take();
  b.api.WaygateWebGL_Free(h1);
  assert.deepEqual(ws1.take().at(-1), { type: "close", code: 0, message: "client closed" });
  assert.equal(b.api.WaygateWebGL_State(h1), -R.INVALID_ARGUMENT);
  assert.equal(b.api.WaygateWebGL_State(h2), STATE.connecting);
  b.api.WaygateWebGL_Close(h2);
});

test("webgl bridge: Request and SyncClock return ids; answer / requestFailed come through the poll queue; ClockOffset and stats", async (t) => {
  const b = bridge(t);
  const { api } = b;
  const h = b.create({ ...OPTIONS, maxUnacked: 3, livenessMs: 0 });
  assert.equal(b.request(h, 1, 1011, "early"), -R.INVALID_STATE, "before Connect (as Send)");
  assert.equal(api.WaygateWebGL_SyncClock(h, 1010, 1000), -R.INVALID_STATE);
  assert.ok(Number.isNaN(api.WaygateWebGL_ClockOffset(h)), "no sample yet");
  api.WaygateWebGL_Connect(h);
  const { ws } = await welcomeLatest(b, 0);
  ws.take();
  b.events(h);

  // Requests: the id at once; the body copied from the heap behind it.
  const id1 = b.request(h, 1, 1011, "hi");
  const id2 = b.request(h, 0, 1012, "");
  assert.ok(id1 > 0 && id2 > 0 && id1 !== id2, `${id1} ${id2}: ${b.lastError()}`);
  const sent = ws.take().filter((f) => f.type === "data");
  assert.deepEqual(sent.map((f) => [f.cls, f.msgId, f.seq, requestOf(f).id, text(requestOf(f).body)]), [
    ["normal", 1011, 1n, id1, "hi"],
    ["critical", 1012, 2n, id2, ""],
  ]);
  assert.equal(b.request(h, 2, 1011, "x"), -R.INVALID_ARGUMENT);
  assert.match(b.lastError(), /best-effort/);
  assert.equal(b.request(h, 9, 1011, "x"), -R.INVALID_ARGUMENT);
  assert.match(b.lastError(), /unknown traffic class 9/);
  assert.equal(api.WaygateWebGL_Request(h, 1, 1011, 0, 5, 1000), -R.INVALID_ARGUMENT, "NULL body with a length");
  assert.equal(b.stats(h).requestsPending, 2);

  // Outcomes: an answer (status, body in base64) and a refusal; neither is a message nor an error.
  ws.deliver(answer(1, id1, 0, "ok"));
  ws.deliver({ type: "error", code: CloseCode.busy, msgId: 1012, clientSeq: 2n, retryAfterMs: 300 });
  const evs = b.events(h);
  assert.deepEqual(
    evs.map((e) => (e.kind === "answer" ? { ...e, payload: b64(e.payload).toString() } : e)),
    [
      { kind: "answer", requestId: id1, status: 0, payload: "ok" },
      { kind: "requestFailed", requestId: id2, reason: "refused", code: 402, label: "busy", retryAfterMs: 300, message: "refused: busy" },
    ],
  );

  // A timeout (unsigned ms), then a late answer: dropped.
  const id3 = b.request(h, 1, 1011, "slow", 20);
  assert.ok(id3 > 0);
  let failed = [];
  for (let i = 0; i < 500 && failed.length === 0; i++) {
    await sleep(2);
    failed = b.events(h);
  }
  assert.deepEqual(failed, [{ kind: "requestFailed", requestId: id3, reason: "timeout", code: null, label: null, retryAfterMs: 0, message: "no answer within 20 ms" }]);
  ws.deliver(answer(2, id3, 0, "late"));
  assert.deepEqual(b.events(h), [], "a late answer is dropped");

  // The send buffer (maxUnacked 3: seqs 1..3 unacked): BUFFER_FULL, as Send.
  assert.equal(b.request(h, 1, 1011, "full"), -R.BUFFER_FULL);
  ws.deliver({ type: "ack", ack: 3n });
  ws.take();

  // A clock sample, with the clocks under the test's control.
  let mono = 10_000;
  let wall = 1_700_000_000_000;
  t.mock.method(performance, "now", () => mono);
  t.mock.method(Date, "now", () => wall);
  const id4 = api.WaygateWebGL_SyncClock(h, -16 /* msg id 0xFFFFFFF0 from C#'s uint */, 5000);
  assert.ok(id4 > 0, b.lastError());
  const [clk] = ws.take().filter((f) => f.type === "data");
  assert.deepEqual([clk.cls, clk.msgId, requestOf(clk).id, requestOf(clk).body.length], ["critical", 0xfffffff0, id4, 0]);
  mono += 40;
  wall += 40;
  ws.deliver(answer(3, id4, 0, unixMsBody(1_700_000_000_000 + 20 + 2500)));
  const [ans] = b.events(h);
  assert.deepEqual({ ...ans, payload: [...b64(ans.payload)].length }, { kind: "answer", requestId: id4, status: 0, payload: 8 });
  assert.equal(api.WaygateWebGL_ClockOffset(h), 2500);
  const st = b.stats(h);
  assert.deepEqual([st.clockOffsetMs, st.clockRttMs, st.clockSamples, st.requestsPending], [2500, 40, 1, 0]);

  // Close: waiting requests fail `closed` before the terminal events; then CLOSED.
  const id5 = b.request(h, 1, 1011, "pending");
  api.WaygateWebGL_Close(h);
  assert.deepEqual(b.events(h).map((e) => [e.kind, e.requestId ?? null, e.reason ?? null]), [
    ["requestFailed", id5, "closed"],
    ["stateChange", null, null],
    ["closed", null, "client closed"],
  ]);
  assert.equal(b.request(h, 1, 1011, "late"), -R.CLOSED);
  assert.equal(api.WaygateWebGL_SyncClock(h, 1010, 1000), -R.CLOSED);
  assert.equal(api.WaygateWebGL_ClockOffset(h), 2500, "the estimate outlives the session");
  api.WaygateWebGL_Free(h);
  assert.equal(b.request(h, 1, 1011, "x"), -R.INVALID_ARGUMENT, "unknown handle");
  assert.equal(api.WaygateWebGL_SyncClock(h, 1010, 1000), -R.INVALID_ARGUMENT);
  assert.ok(Number.isNaN(api.WaygateWebGL_ClockOffset(h)));
});

test("webgl bridge: request outcomes are never dropped from a full event queue", async (t) => {
  const b = bridge(t);
  const h = b.create({ ...OPTIONS, maxQueuedEvents: 3 });
  b.api.WaygateWebGL_Connect(h);
  const { ws } = await welcomeLatest(b, 0); // stateChange x2, connected: full (newSession dropped)
  const ids = [b.request(h, 1, 1011, "a"), b.request(h, 1, 1011, "b")];
  ws.deliver(data(1, 2000, "m1")); // dropped
  ws.deliver(answer(2, ids[0], 0, "A"));
  ws.deliver({ type: "error", code: CloseCode.no_route, msgId: 1011, clientSeq: 2n, retryAfterMs: 0 });
  const evs = b.events(h);
  assert.deepEqual(kinds(evs), ["stateChange", "stateChange", "connected", "eventsDropped", "answer", "requestFailed"]);
  assert.equal(evs[3].count, 2, "newSession and the message");
  assert.deepEqual([evs[4].requestId, evs[5].requestId, evs[5].reason, evs[5].label], [ids[0], ids[1], "refused", "no_route"]);
  b.api.WaygateWebGL_Close(h);
});

test("webgl bridge: the .jslib is plain ES5 for Unity's Emscripten (no arrows, template strings, let/const, BigInt literals)", () => {
  const code = source
    .split("\n")
    .filter((l) => !l.trim().startsWith("//"))
    .join("\n")
    .replace(/"(?:[^"\\]|\\.)*"/g, '""');
  for (const [what, re] of [
    ["arrow function", /=>/],
    ["template string", /`/],
    ["let/const", /\b(let|const)\s/],
    ["BigInt literal", /\b\d+n\b/],
    ["optional chaining", /\?\./],
    ["spread", /\.\.\./],
  ]) {
    assert.doesNotMatch(code, re, what);
  }
});

/** Whether `cmd` runs (`--version`). */
const have = (cmd) => spawnSync(cmd, ["--version"], { timeout: 10_000 }).status === 0;

test("webgl bridge: the C# side (Runtime/WaygateWebGLClient.cs) reads what the .jslib writes and writes options it takes (mcs + mono)", { skip: !(have("mcs") && have("mono")) && "mcs or mono not installed" }, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "waygate-webgl-cs-"));
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const exe = join(dir, "check.exe");
  const built = spawnSync("mcs", ["-warnaserror+", `-out:${exe}`, join(UNITY, "Runtime/WaygateWebGLClient.cs"), join(UNITY, "Tests~/BridgeJsonCheck.cs")], { encoding: "utf8", timeout: 60_000 });
  assert.equal(built.status, 0, `mcs: ${built.stdout}${built.stderr}`);
  const run = (input) => {
    const r = spawnSync("mono", [exe], { input, encoding: "utf8", timeout: 60_000 });
    assert.equal(r.status, 0, `mono: ${r.stdout}${r.stderr}`);
    return r.stdout.split("\n").filter((l) => l.length > 0);
  };

  // C# -> JS: WaygateWebGLOptions.ToJson() is accepted by WaygateWebGL_Create.
  const [optionsJson] = run("");
  assert.deepEqual(JSON.parse(optionsJson), {
    urls: ["ws://edge-a/", 'ws://edge-"b"/'],
    token: "qrv7_w",
    backoffMinMs: 1,
    backoffMaxMs: 8,
    maxOfflineAgeMs: 2500,
    lifecycleHooks: false,
  });
  const real = performance.now.bind(performance);
  let skew = 0;
  t.mock.method(performance, "now", () => real() + skew);
  const b = bridge(t);
  const h = b.create(optionsJson);
  assert.ok(h >= 1, b.lastError());
  b.api.WaygateWebGL_Connect(h);
  const { ws, hello } = await welcomeLatest(b, 0);
  assert.deepEqual([...hello[0].token], [0xaa, 0xbb, 0xfb, 0xff]);
  const body = 'héllo ☃ "q" \\ \u0000 end';
  ws.deliver(data(1, 2001, body, "critical"));
  const maxU64 = 2n ** 64n - 1n;
  ws.deliver({
    type: "data",
    cls: "critical",
    msgId: CHANNEL_EVENT_MSG_ID,
    seq: 2n,
    ack: null,
    payload: encodeChannelEvent({ kind: ChannelEventKind.Publication, channel: "world", epoch: 3, offset: maxU64, body: new TextEncoder().encode("hi") }),
  });
  b.api.WaygateWebGL_DropLink(h);
  await sleep(5);
  b.send(h, 1, 1001, "stale");
  skew += 3000;
  const { ws: ws2 } = await welcomeLatest(b, 2, { serverSeqBase: 2n });
  ws2.take();
  const idA = b.request(h, 0, 1011, "a");
  const idB = b.request(h, 1, 1012, "b");
  assert.ok(idA > 0 && idB > 0, b.lastError());
  ws2.deliver(answer(3, idA, 5, "données"));
  ws2.deliver({ type: "error", code: CloseCode.busy, msgId: 1012, clientSeq: 2n, retryAfterMs: 750 });
  b.api.WaygateWebGL_Close(h);
  const lines = [];
  for (let i = 0; i < 100; i++) {
    const n = b.api.WaygateWebGL_Poll(h, b.buf, b.bufLen);
    if (n <= 0) break;
    lines.push(b.m.readText(b.buf, n));
  }
  const js = lines.map((l) => JSON.parse(l));
  assert.deepEqual(kinds(js), [
    "stateChange", "stateChange", "connected", "newSession", "message", "channel",
    "stateChange", "disconnected", "stateChange", "connected", "expired", "restoredWithGap",
    "answer", "requestFailed", "stateChange", "closed",
  ]);
  assert.ok(lines[5].includes(`"offset":${maxU64}`), "u64 written exactly");

  // JS -> C#: every event parses; the typed properties say what the JS side sent.
  const cs = run(lines.join("\n") + "\n")
    .slice(1) // the options line again
    .map((l) => JSON.parse(l));
  assert.equal(cs.length, lines.length);
  const pick = (i, ...keys) => Object.fromEntries(keys.map((k) => [k, cs[i][k]]));
  assert.deepEqual(pick(0, "kind", "from", "to"), { kind: "StateChange", from: "Idle", to: "Connecting" });
  assert.deepEqual(pick(2, "kind", "outcome", "sessionId"), { kind: "Connected", outcome: "NewSession", sessionId: "01".repeat(16) });
  assert.deepEqual(pick(4, "kind", "msgId", "seq", "trafficClass", "payloadText"), { kind: "Message", msgId: "2001", seq: "1", trafficClass: "Critical", payloadText: body });
  assert.deepEqual(pick(5, "kind", "channel", "channelKind", "offset", "payloadText"), { kind: "Channel", channel: "world", channelKind: "publication", offset: String(maxU64), payloadText: "hi" });
  assert.deepEqual(pick(6, "from", "to"), { from: "Connected", to: "Reconnecting" });
  assert.deepEqual(pick(9, "kind", "outcome"), { kind: "Connected", outcome: "RestoredWithGap" });
  assert.equal(cs[10].kind, "Expired");
  assert.equal(cs[10].msgId, "1001");
  assert.equal(cs[10].seq, "1");
  assert.ok(Number(cs[10].ageMs) >= 3000);
  assert.equal(cs[11].kind, "RestoredWithGap");
  assert.deepEqual(pick(12, "kind", "requestId", "status", "payloadText", "failure"), { kind: "Answer", requestId: String(idA), status: "5", payloadText: "données", failure: "None" });
  assert.deepEqual(pick(13, "kind", "requestId", "failure", "reason", "code", "label", "retryAfterMs"), {
    kind: "RequestFailed",
    requestId: String(idB),
    failure: "Refused",
    reason: "refused",
    code: "402",
    label: "busy",
    retryAfterMs: "750",
  });
  assert.deepEqual(pick(15, "kind", "code", "reason", "terminal"), { kind: "Closed", code: "0", reason: "client closed", terminal: "true" });
  assert.ok(cs.every((e) => e.kind !== "Unknown"), "every kind known to C#");
});
