// The session machine of WaygateClient against a scripted WebSocket (node --test): each
// test plays the server's part frame by frame, per PROTOCOL.md §7.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  ANSWER_MSG_ID,
  CHANNEL_EVENT_MSG_ID,
  ChannelEventKind,
  ChannelTracker,
  ClockSync,
  CloseCode,
  closeKeepsSession,
  RequestError,
  WaygateClient,
  decodeAnswer,
  encodeChannelEvent,
  encodeRequest,
  resumeProof,
} from "../dist/index.js";
import { answer, data, id, requestOf, scriptedWebSocket, sleep, text, unixMsBody, welcome } from "../test-support/fake-edge.mjs";

/** A client plus a record of its events. */
function setup(options = {}) {
  const WS = scriptedWebSocket();
  const client = new WaygateClient({
    urls: ["ws://edge-a/", "ws://edge-b/"],
    token: new Uint8Array([0xaa, 0xbb]),
    WebSocket: WS,
    random: () => 0,
    backoffMinMs: 1,
    backoffMaxMs: 8,
    ...options,
  });
  const events = [];
  for (const name of ["connected", "newSession", "restored", "restoredWithGap", "connectFailed", "disconnected", "kicked", "migrating", "message", "channel", "error", "closed", "stateChange", "expired", "answer", "requestFailed"]) {
    client.on(name, (e) => events.push({ name, ...e }));
  }
  const named = (n) => events.filter((e) => e.name === n);
  return { client, WS, events, named };
}

/** Checks a HELLO's resume part (§7.3.1): fields, and the proof of holding `token`. */
async function assertResume(resume, { sessionId, token, lastServerSeq, nonce }) {
  assert.ok(resume, "a resume part");
  assert.deepEqual(Object.keys(resume).sort(), ["lastServerSeq", "nonce", "proof", "sessionId"]);
  assert.deepEqual(resume.sessionId, sessionId);
  assert.equal(resume.lastServerSeq, lastServerSeq);
  assert.equal(resume.nonce, nonce);
  assert.deepEqual(resume.proof, await resumeProof(token, sessionId, lastServerSeq, nonce), "proof of the resume token");
}

/** Whether `needle` occurs in `bytes`. */
const contains = (bytes, needle) => Buffer.from(bytes).indexOf(Buffer.from(needle)) !== -1;

/** Drops `ws` as a network failure would, and opens the socket the client resumes on. */
async function dropAndReopen(ctx, ws) {
  ws.drop();
  await sleep(5);
  const next = ctx.WS.all.at(-1);
  assert.notEqual(next, ws, "reconnected");
  await next.open();
  return next;
}

/** Connects and answers HELLO with WELCOME(outcome). */
async function connect(ctx, outcome = 0, opts = {}) {
  ctx.client.connect();
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  const hello = ws.take();
  ws.deliver(welcome(outcome, opts));
  return { ws, hello };
}

test("HELLO, WELCOME new session, queued messages get seqs from 1, ACK confirms at once", async () => {
  const ctx = setup();
  assert.equal(ctx.client.send(1000, "early-1"), 1n);
  assert.equal(ctx.client.send(1000, "early-2", "critical"), 2n);
  assert.equal(ctx.client.send(1000, "dropped", "bestEffort"), null, "best-effort is not queued");
  const { ws, hello } = await connect(ctx);
  assert.deepEqual(ws.protocols, ["waygate.v1"]);
  assert.equal(ws.binaryType, "arraybuffer");
  assert.equal(hello.length, 1);
  assert.deepEqual(hello[0], { type: "hello", version: 1, token: new Uint8Array([0xaa, 0xbb]), resume: null });
  const after = ws.take();
  assert.deepEqual(after[0], { type: "ack", ack: 0n }, "§7.3.3: a frame right after WELCOME");
  assert.deepEqual(
    after.slice(1).map((f) => [f.seq, f.cls, text(f.payload)]),
    [
      [1n, "normal", "early-1"],
      [2n, "critical", "early-2"],
    ],
  );
  assert.deepEqual(ctx.named("connected").map((e) => e.outcome), ["new_session"]);
  assert.equal(ctx.named("newSession").length, 1);
  assert.equal(ctx.client.state, "connected");
  assert.equal(ctx.client.send(1000, "now", "bestEffort"), 0n);
  assert.equal(ws.take()[0].seq, 0n);
  ctx.client.close();
});

test("resume after a drop: resume part, unacked above client_seq_ack resent with original seqs", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  for (let i = 1; i <= 4; i++) ctx.client.send(1000, `up-${i}`);
  ws.deliver({ type: "ack", ack: 1n });
  ws.deliver(data(1));
  ws.deliver(data(2));
  assert.equal(ctx.client.stats().unacked, 3);
  ws.drop();
  assert.equal(ctx.named("disconnected")[0].wasActive, true);
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  assert.notEqual(ws2, ws, "reconnected");
  ctx.client.send(1000, "up-5"); // queued while reconnecting
  await ws2.open();
  const [hello] = ws2.take();
  await assertResume(hello.resume, { sessionId: id(1), token: id(2), lastServerSeq: 2n, nonce: 1n });
  assert.ok(!contains(ws2.raw[0], id(2)), "the resume token itself is never sent");
  assert.deepEqual(hello.token, new Uint8Array([0xaa, 0xbb]), "SHOULD send both token and resume part");
  ws2.deliver(welcome(1, { resumeToken: id(3), serverSeqBase: 2n, clientSeqAck: 3n }));
  const sent = ws2.take();
  assert.deepEqual(sent[0], { type: "ack", ack: 2n });
  assert.deepEqual(
    sent.slice(1).map((f) => [f.seq, text(f.payload)]),
    [
      [4n, "up-4"],
      [5n, "up-5"],
    ],
  );
  assert.equal(ctx.named("restored")[0].resent, 2);
  ws2.deliver(data(2)); // replayed duplicate: dropped
  ws2.deliver(data(3));
  assert.deepEqual(ctx.named("message").map((m) => m.seq), [1n, 2n, 3n]);
  // The next resume proves the new token, with the next nonce.
  ws2.drop();
  await sleep(5);
  const ws3 = ctx.WS.all.at(-1);
  await ws3.open();
  await assertResume(ws3.take()[0].resume, { sessionId: id(1), token: id(3), lastServerSeq: 3n, nonce: 2n });
  assert.ok(!contains(ws3.raw[0], id(3)), "the resume token itself is never sent");
  ctx.client.close();
});

test("dedup, out-of-order window and the ack policy (delay, every N, duplicates owe an ack)", async () => {
  const ctx = setup({ ackDelayMs: 15, ackEvery: 4 });
  const { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(2)); // arrives before 1 (another class on QUIC would do that)
  ws.deliver(data(1));
  ws.deliver(data(2));
  assert.deepEqual(ctx.named("message").map((m) => m.seq), [2n, 1n]);
  assert.equal(ctx.client.stats().lastServerSeq, 2n);
  assert.deepEqual(ws.take(), [], "ack delayed");
  await sleep(40);
  assert.deepEqual(ws.take(), [{ type: "ack", ack: 2n }]);
  ws.deliver(data(2)); // a duplicate alone still owes an ack
  await sleep(40);
  assert.deepEqual(ws.take(), [{ type: "ack", ack: 2n }]);
  for (let s = 3; s <= 6; s++) ws.deliver(data(s));
  assert.deepEqual(ws.take(), [{ type: "ack", ack: 6n }], "4 unacked: at once");
  ws.deliver(data(7));
  ctx.client.send(1000, "x");
  const [d] = ws.take();
  assert.equal(d.ack, 7n, "piggybacked on DATA");
  await sleep(40);
  assert.deepEqual(ws.take(), [], "nothing owed after the piggyback");
  ctx.client.close();
});

test("restored with gap: resync event, cumulative jumps to server_seq_base", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.deliver(data(1));
  ws.drop();
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  await ws2.open();
  ws2.deliver(welcome(2, { serverSeqBase: 10n }));
  assert.equal(ctx.named("restoredWithGap")[0].serverSeqBase, 10n);
  ws2.deliver(data(5));
  ws2.deliver(data(11));
  assert.deepEqual(ctx.named("message").map((m) => m.seq), [1n, 11n]);
  ctx.client.close();
});

test("restore failed: new session, both seq spaces restart, old unacked discarded", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.deliver(data(1));
  ctx.client.send(1000, "lost-1");
  ctx.client.send(1000, "lost-2");
  ws.drop();
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  await ws2.open();
  ws2.take();
  ws2.deliver(welcome(3, { sessionId: id(9) }));
  assert.deepEqual(ws2.take(), [{ type: "ack", ack: 0n }]);
  assert.deepEqual(ctx.named("newSession").at(-1), { name: "newSession", sessionId: "09".repeat(16), restoreFailed: true, discarded: 2 });
  assert.equal(ctx.client.send(1000, "fresh"), 1n);
  ws2.deliver(data(1));
  assert.equal(ctx.named("message").length, 2, "server seq 1 of the new session is new");
  ctx.client.close();
});

test("REJECT retry-after is honoured; the next attempt goes to the next URL", async () => {
  const ctx = setup();
  ctx.client.connect();
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver({ type: "reject", code: CloseCode.overloaded, retryAfterMs: 120, message: "full" });
  ws.deliver({ type: "close", code: CloseCode.overloaded, message: "" }); // ignored: already handled
  assert.equal(ctx.named("error")[0].kind, "rejected");
  const d = ctx.named("disconnected");
  assert.equal(d.length, 1);
  assert.equal(d[0].retryInMs, 120);
  await sleep(80);
  assert.equal(ctx.WS.all.length, 1, "no reconnect before retry-after");
  await sleep(80);
  assert.equal(ctx.WS.all.length, 2);
  assert.equal(ctx.WS.all[1].url, "ws://edge-b/");
  ctx.client.close();
});

// Regression (2026-12-05, the same audit): the wait after a REJECT was max(jitter,
// retry-after), so every client refused with a 1,000 ms hint came back at that very
// instant. It is now the hint plus the jitter (§5).
test("a REJECT's retry-after gets the jitter on top", async () => {
  const ctx = setup({ random: () => 0.5, backoffMinMs: 100, backoffMaxMs: 100 });
  ctx.client.connect();
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver({ type: "reject", code: CloseCode.draining, retryAfterMs: 1000, message: "" });
  // The jitter: at most the backoff cap, and at most half the hint.
  assert.deepEqual(ctx.named("disconnected").map((e) => e.retryInMs), [1050]);
  ctx.client.close();
});

// Regression (2026-12-05, the same audit): every link that had a WELCOME reconnected at
// once when it died, so an edge closing each link right after WELCOME (a message it refuses,
// resent on every resume) had the client spin. Links that die within 1 s of their WELCOME
// now back off like failed attempts; one that lived longer reconnects at once again.
test("links that die right after their WELCOME back off; a link that lived resets it", async () => {
  const ctx = setup({ random: () => 0.999, backoffMinMs: 10, backoffMaxMs: 80 });
  let { ws } = await connect(ctx);
  for (let i = 0; i < 5; i++) {
    ws.drop();
    await sleep(100); // past the largest backoff (80 ms)
    ws = ctx.WS.all.at(-1);
    await ws.open();
    ws.take();
    ws.deliver(welcome(1, { serverSeqBase: 0n }));
  }
  assert.deepEqual(ctx.named("disconnected").map((e) => e.retryInMs), [10, 20, 40, 80, 80]);
  await sleep(1050); // this link lives past 1 s
  ws.drop();
  assert.equal(ctx.named("disconnected").at(-1).retryInMs, 0, "at once after a link that lived");
  await sleep(20);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.take();
  ws.deliver(welcome(1, { serverSeqBase: 0n }));
  ws.drop(); // a quick loss again: the backoff starts over
  assert.equal(ctx.named("disconnected").at(-1).retryInMs, 10);
  ctx.client.close();
});

test("exponential backoff with full jitter: caps double up to the maximum", async () => {
  const ctx = setup({ random: () => 0.999999, backoffMinMs: 2, backoffMaxMs: 16 });
  ctx.client.connect();
  for (let i = 0; i < 5; i++) {
    const ws = ctx.WS.all.at(-1);
    ws.drop(); // fails before opening
    await sleep(30);
  }
  assert.deepEqual(ctx.named("disconnected").map((e) => e.retryInMs), [4, 8, 16, 16, 16]);
  assert.ok(ctx.named("disconnected").every((e) => !e.wasActive && e.willReconnect));
  assert.deepEqual(ctx.WS.all.slice(0, 3).map((w) => w.url), ["ws://edge-a/", "ws://edge-b/", "ws://edge-a/"]);
  ctx.client.close();
});

const failures = (ctx) => ctx.named("connectFailed").map(({ url, attempt }) => [url, attempt]);

test("connectFailed: one per failed attempt, before the next; attempt counts up and a WELCOME resets it", async () => {
  const ctx = setup();
  const seen = [];
  ctx.client.on("connectFailed", () => seen.push({ sockets: ctx.WS.all.length, disconnected: ctx.named("disconnected").length }));
  ctx.client.connect();
  const ws1 = ctx.WS.all.at(-1);
  ws1.onerror?.({}); // a refused TCP connect, an HTTP 503 / 403: error, then close 1006, never open
  ws1.drop(1006);
  assert.deepEqual(ctx.named("connectFailed"), [
    { name: "connectFailed", url: "ws://edge-a/", reason: "websocket closed before open (status 1006)", attempt: 1 },
  ]);
  assert.deepEqual(seen, [{ sockets: 1, disconnected: 0 }], "emitted before the client moves on");
  assert.deepEqual(ctx.events.slice(-2).map((e) => e.name), ["connectFailed", "disconnected"]);
  assert.equal(ctx.named("disconnected")[0].wasActive, false);
  await sleep(20);
  const ws2 = ctx.WS.all.at(-1);
  assert.equal(ws2.url, "ws://edge-b/");
  await ws2.open(); // HELLO sent, then the link goes before WELCOME
  ws2.drop(1006);
  assert.equal(ctx.named("connectFailed")[1].reason, "websocket closed before WELCOME (status 1006)");
  assert.deepEqual(failures(ctx), [
    ["ws://edge-a/", 1],
    ["ws://edge-b/", 2],
  ]);
  // The next attempt is welcomed: no connectFailed, and the count starts over.
  await sleep(20);
  const ws3 = ctx.WS.all.at(-1);
  await ws3.open();
  ws3.deliver(welcome(0));
  assert.equal(ctx.client.state, "connected");
  ws3.drop(); // a session that was up and dropped: disconnected only
  assert.equal(ctx.named("disconnected").at(-1).wasActive, true);
  assert.equal(ctx.named("connectFailed").length, 2);
  await sleep(20);
  const ws4 = ctx.WS.all.at(-1);
  assert.notEqual(ws4, ws3);
  ws4.drop(1006);
  assert.deepEqual(failures(ctx).at(-1), [ws4.url, 1], "counted from 1 again after the WELCOME");
  // A REJECT is an error of kind rejected, not a connectFailed (but a backoff step).
  await sleep(20);
  const ws5 = ctx.WS.all.at(-1);
  await ws5.open();
  ws5.deliver({ type: "reject", code: CloseCode.overloaded, retryAfterMs: 0, message: "full" });
  assert.equal(ctx.named("error").at(-1).kind, "rejected");
  assert.equal(ctx.named("connectFailed").length, 3);
  await sleep(20);
  const ws6 = ctx.WS.all.at(-1);
  assert.notEqual(ws6, ws5);
  ws6.drop(1006);
  assert.deepEqual(failures(ctx).at(-1), [ws6.url, 3]);
  ctx.client.close();
});

test("connectFailed: no WELCOME within the handshake timeout is one failed attempt", async () => {
  for (const opened of [true, false]) {
    // A long backoff after the failure, so that only one attempt times out here.
    const ctx = setup({ handshakeTimeoutMs: 50, backoffMinMs: 1000, backoffMaxMs: 2000, random: () => 0.999 });
    ctx.client.connect();
    const ws = ctx.WS.all.at(-1);
    if (opened) await ws.open(); // HELLO sent, never answered
    await sleep(250);
    assert.deepEqual(ctx.named("connectFailed"), [
      { name: "connectFailed", url: "ws://edge-a/", reason: "no WELCOME within the handshake timeout", attempt: 1 },
    ]);
    assert.equal(ctx.WS.all.length, 1, "backing off");
    assert.deepEqual(ctx.named("disconnected").map((e) => [e.code, e.wasActive, e.retryInMs >= 1000]), [[CloseCode.handshake_timeout, false, true]]);
    // Before WELCOME only PING goes out (§7.1): no CLOSE, the socket alone is closed.
    if (opened) assert.deepEqual(ws.take().map((f) => f.type), ["hello"]);
    assert.equal(ws.closed.code, 4000 + CloseCode.handshake_timeout);
    ctx.client.close();
  }
});

test("connectFailed: a URL the WebSocket constructor refuses; a listener may close the client", async () => {
  const Base = scriptedWebSocket();
  class Picky extends Base {
    constructor(url, protocols) {
      if (url.startsWith("ws://blocked")) throw new SyntaxError("port 25 is blocked");
      super(url, protocols);
    }
  }
  const ctx = setup({ urls: ["ws://blocked:25/", "ws://edge-b/"], WebSocket: Picky });
  ctx.client.connect();
  await sleep(20);
  assert.deepEqual(ctx.named("connectFailed"), [
    { name: "connectFailed", url: "ws://blocked:25/", reason: "cannot open ws://blocked:25/: SyntaxError: port 25 is blocked", attempt: 1 },
  ]);
  const ws = Picky.all.at(-1);
  assert.equal(ws.url, "ws://edge-b/");
  // Giving up from the listener: no reconnect follows.
  ctx.client.on("connectFailed", () => ctx.client.close("giving up"));
  ws.drop(1006);
  assert.deepEqual(failures(ctx), [
    ["ws://blocked:25/", 1],
    ["ws://edge-b/", 2],
  ]);
  assert.equal(ctx.client.state, "closed");
  assert.equal(ctx.named("disconnected").length, 1, "no disconnected after the listener closed the client");
  assert.deepEqual(ctx.named("closed").map((e) => e.reason), ["giving up"]);
  await sleep(30);
  assert.equal(Picky.all.length, 1, "no further attempt");
});

test("kicked: terminal, no reconnect, send refused", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.deliver({ type: "close", code: CloseCode.kicked, message: "another login" });
  assert.deepEqual(ctx.named("kicked"), [{ name: "kicked", code: 301, message: "another login" }]);
  assert.equal(ctx.named("closed")[0].label, "kicked");
  assert.equal(ctx.named("disconnected")[0].willReconnect, false);
  await sleep(30);
  assert.equal(ctx.WS.all.length, 1);
  assert.equal(ctx.client.state, "closed");
  assert.throws(() => ctx.client.send(1000, "x"), /closed/);
});

// Regression (2026-12-05): a backend's KICK with its own code (PROTOCOL.md §7.8) was read as
// a lost link: the client resumed, was refused, and logged in again.
test("a CLOSE after WELCOME with a code that does not keep the session is terminal", async () => {
  for (const code of [4003, CloseCode.auth_rejected]) {
    const ctx = setup();
    const { ws } = await connect(ctx);
    ws.deliver({ type: "close", code, message: "banned" });
    assert.equal(ctx.named("closed").length, 1, `${code} ends the client`);
    assert.equal(ctx.named("disconnected")[0].willReconnect, false);
    assert.equal(ctx.named("kicked").length, 0);
    await sleep(20);
    assert.equal(ctx.WS.all.length, 1, `${code}: no reconnect`);
    assert.equal(ctx.client.state, "closed");
  }
  // The edge's lingering closes keep it: the client resumes.
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.deliver({ type: "close", code: CloseCode.slow_consumer, message: "too slow" });
  assert.equal(ctx.named("closed").length, 0);
  await sleep(20);
  assert.equal(ctx.WS.all.length, 2, "slow_consumer: reconnected");
  assert.ok(closeKeepsSession(CloseCode.slow_consumer) && !closeKeepsSession(CloseCode.kicked));
  ctx.client.close();
});

test("kicked as a WebSocket status 4301 without CLOSE frame is terminal too", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.drop(4301);
  assert.equal(ctx.named("kicked").length, 1);
  await sleep(20);
  assert.equal(ctx.WS.all.length, 1);
});

test("MIGRATE: CLOSE going_away, reconnect to the target with the new resume token", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(1));
  ws.deliver({ type: "migrate", deadlineMs: 5000, target: "ws://edge-c:7080/", sessionId: id(1), resumeToken: id(7) });
  assert.deepEqual(ctx.named("migrating"), [{ name: "migrating", target: "ws://edge-c:7080/", deadlineMs: 5000 }]);
  assert.deepEqual(ws.take().at(-1), { type: "close", code: CloseCode.going_away, message: "migrating" });
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  assert.equal(ws2.url, "ws://edge-c:7080/");
  await ws2.open();
  const [hello] = ws2.take();
  await assertResume(hello.resume, { sessionId: id(1), token: id(7), lastServerSeq: 1n, nonce: 1n });
  ws2.deliver(welcome(1, { resumeToken: id(6), serverSeqBase: 1n }));
  assert.equal(ctx.named("restored").length, 1);
  // A non-ws target (e.g. quic://) means "any edge from our own list".
  ws2.deliver({ type: "migrate", deadlineMs: 5000, target: "quic://edge-d:7444", sessionId: id(1), resumeToken: id(8) });
  await sleep(5);
  const ws3 = ctx.WS.all.at(-1);
  assert.match(ws3.url, /^ws:\/\/edge-[ab]\/$/);
  // MIGRATE keeps the session id: the nonce count goes on.
  await ws3.open();
  await assertResume(ws3.take()[0].resume, { sessionId: id(1), token: id(8), lastServerSeq: 1n, nonce: 2n });
  ctx.client.close();
});

test("expired auth token: resume with the resume part alone; resume_rejected then ends", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  let w = await dropAndReopen(ctx, ws);
  assert.equal(w.take()[0].resume.nonce, 1n);
  w.deliver({ type: "reject", code: CloseCode.auth_expired, retryAfterMs: 0, message: "" });
  await sleep(10);
  w = ctx.WS.all.at(-1);
  await w.open();
  const [hello] = w.take();
  assert.equal(hello.token.length, 0);
  await assertResume(hello.resume, { sessionId: id(1), token: id(2), lastServerSeq: 0n, nonce: 2n });
  w.deliver({ type: "reject", code: CloseCode.resume_rejected, retryAfterMs: 0, message: "" });
  assert.equal(ctx.client.state, "closed");
  assert.equal(ctx.named("closed")[0].code, CloseCode.resume_rejected);
});

// Review (2026-12-05): a token refused for a rotated key (203) ended a session that a
// resume alone would keep; and a token set while a HELLO was in flight was dropped with
// the refused one.
test("a refused token (not a ban) resumes alone; a token set meanwhile is kept", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  let w = await dropAndReopen(ctx, ws);
  w.take();
  w.deliver({ type: "reject", code: CloseCode.auth_unknown_key, retryAfterMs: 0, message: "" });
  assert.equal(ctx.named("closed").length, 0, "203 with a session is not terminal");
  await sleep(10);
  w = ctx.WS.all.at(-1);
  await w.open();
  assert.equal(w.take()[0].token.length, 0, "resume alone");
  // A fresh token set while this HELLO waits for its answer: the refusal keeps it.
  ctx.client.setToken(new Uint8Array([9, 9, 9]));
  w.deliver({ type: "reject", code: CloseCode.auth_expired, retryAfterMs: 0, message: "" });
  await sleep(10);
  w = ctx.WS.all.at(-1);
  await w.open();
  assert.deepEqual([...w.take()[0].token], [9, 9, 9], "the fresh token goes out");
  ctx.client.close();
});

test("resume nonces count 1, 2, ... per session and restart with a new session id", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx, 0, { sessionId: id(1), resumeToken: id(2) });
  let w = await dropAndReopen(ctx, ws);
  await assertResume(w.take()[0].resume, { sessionId: id(1), token: id(2), lastServerSeq: 0n, nonce: 1n });
  // Refused by the edge (e.g. resume_rejected): a new session with another id.
  w.deliver(welcome(3, { sessionId: id(9), resumeToken: id(4) }));
  w.deliver(data(1));
  w.drop();
  await sleep(5);
  w = ctx.WS.all.at(-1);
  await w.open();
  await assertResume(w.take()[0].resume, { sessionId: id(9), token: id(4), lastServerSeq: 1n, nonce: 1n });
  w.deliver(welcome(1, { sessionId: id(9), resumeToken: id(5), serverSeqBase: 1n }));
  w.drop();
  await sleep(5);
  w = ctx.WS.all.at(-1);
  await w.open();
  await assertResume(w.take()[0].resume, { sessionId: id(9), token: id(5), lastServerSeq: 1n, nonce: 2n });
  ctx.client.close();
});

test("a socket lost while the resume proof is computed gets no HELLO; nothing precedes a HELLO", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.drop();
  await sleep(5);
  const w2 = ctx.WS.all.at(-1);
  w2.readyState = 1;
  w2.onopen({});
  w2.deliver({ type: "ping", timestamp: 7n }); // not answered before the HELLO
  w2.drop();
  await sleep(10);
  assert.deepEqual(w2.sent, [], "no frame on the lost socket");
  const w3 = ctx.WS.all.at(-1);
  assert.notEqual(w3, w2);
  await w3.open();
  const sent = w3.take();
  assert.equal(sent.length, 1);
  // A nonce is never used twice, even one whose HELLO never left.
  await assertResume(sent[0].resume, { sessionId: id(1), token: id(2), lastServerSeq: 0n, nonce: 2n });
  ctx.client.close();
});

test("without crypto.subtle (not a secure context): one warning, HELLO without resume part, a fresh login", async (t) => {
  const warnings = [];
  t.mock.method(console, "warn", (...args) => warnings.push(args.join(" ")));
  const ctx = setup();
  const { ws } = await connect(ctx);
  ctx.client.send(1000, "unacked");
  const saved = Object.getOwnPropertyDescriptor(globalThis, "crypto");
  Object.defineProperty(globalThis, "crypto", { value: {}, configurable: true, writable: true });
  try {
    for (let round = 0; round < 2; round++) {
      ctx.WS.all.at(-1).drop();
      await sleep(5);
      const w = ctx.WS.all.at(-1);
      await w.open();
      const [hello] = w.take();
      assert.deepEqual(hello, { type: "hello", version: 1, token: new Uint8Array([0xaa, 0xbb]), resume: null });
      w.deliver(welcome(0, { sessionId: id(20 + round) }));
    }
  } finally {
    Object.defineProperty(globalThis, "crypto", saved);
  }
  assert.equal(warnings.length, 1, "warned once");
  assert.match(warnings[0], /crypto\.subtle/);
  assert.deepEqual(ctx.named("newSession").map((e) => [e.sessionId, e.discarded]), [
    ["01".repeat(16), 0],
    ["14".repeat(16), 1],
    ["15".repeat(16), 0],
  ]);
  assert.equal(ws.closed.code, 1000);
  ctx.client.close();
});

test("auth failures without a session are terminal", async () => {
  const ctx = setup();
  ctx.client.connect();
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver({ type: "reject", code: CloseCode.auth_bad_signature, retryAfterMs: 0, message: "bad" });
  await sleep(20);
  assert.equal(ctx.client.state, "closed");
  assert.equal(ctx.WS.all.length, 1);
});

test("protocol violations close with the right code and reconnect", async () => {
  const ctx = setup();
  let { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(0)); // seq 0 on sequenced DATA
  let sent = ws.take();
  assert.deepEqual(sent.at(-1).code, CloseCode.protocol_error);
  assert.equal(ws.closed.code, 4100);
  await sleep(5);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.take();
  ws.deliver(welcome(1));
  ws.take();
  ws.deliver(data(4097)); // beyond the 4096 window
  assert.equal(ws.take().at(-1).code, CloseCode.protocol_error);
  await sleep(5);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(data(1)); // DATA before WELCOME: no CLOSE before WELCOME (§7.1), the socket closes
  assert.deepEqual(ws.take().map((f) => f.type), ["hello"]);
  assert.equal(ws.closed.code, 4000 + CloseCode.unexpected_frame);
  await sleep(5);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(welcome(1));
  ws.take();
  ws.onmessage({ data: "text" });
  assert.equal(ws.take().at(-1).code, CloseCode.text_message);
  await sleep(5);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(welcome(1));
  ws.take();
  ws.deliver({ type: "ack", ack: 99n }); // above anything sent
  assert.equal(ws.take().at(-1).code, CloseCode.protocol_error);
  assert.ok(ctx.named("error").filter((e) => e.kind === "protocol").length >= 5);
  assert.notEqual(ctx.client.state, "closed");
  ctx.client.close();
});

test("PING answered with PONG; idle heartbeat PING; PONG gives an RTT sample", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 60 });
  ws.take();
  ws.deliver({ type: "ping", timestamp: 12345678901234n });
  assert.deepEqual(ws.take(), [{ type: "pong", timestamp: 12345678901234n }]);
  await sleep(150);
  const pings = ws.take().filter((f) => f.type === "ping");
  assert.ok(pings.length >= 1, "a PING after the heartbeat interval");
  ws.deliver({ type: "pong", timestamp: pings[0].timestamp });
  const rtt = ctx.client.stats().rtt;
  assert.equal(rtt.samples, 1);
  assert.ok(rtt.latestMs >= 0 && rtt.latestMs < 1000);
  ctx.client.close();
});

// Regression (2026-12-05, an audit against PROTOCOL.md §7.5): any frame sent reset the
// heartbeat, so a client streaming best-effort DATA never PINGed and a dead link was
// noticed only by the idle timeout.
test("a client sending only best-effort DATA still PINGs every heartbeat interval", async () => {
  // A long liveness timeout: an unanswered PING must not end the link on a slow machine.
  const ctx = setup({ livenessMs: 60_000 });
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 60 });
  ws.take();
  for (let i = 0; i < 15; i++) {
    ctx.client.send(1000, "input", "bestEffort");
    await sleep(10);
  }
  const sent = ws.take();
  assert.ok(sent.filter((f) => f.type === "data").length >= 10);
  assert.ok(sent.some((f) => f.type === "ping"), "a PING among best-effort DATA");
  ctx.client.close();
});

test("nothing received within idle_timeout: the client gives up on the link and resumes", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 1000, idleTimeoutMs: 80 });
  await sleep(400);
  assert.ok(ctx.WS.all.length >= 2, "reconnected");
  assert.equal(ctx.named("disconnected")[0].code, CloseCode.idle_timeout);
  assert.equal(ws.closed.code, 4103);
  ctx.client.close();
});

test("ERROR frames are reported, the connection stays", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ctx.client.send(1000, "x");
  ws.deliver({ type: "error", code: CloseCode.busy, msgId: 1000, clientSeq: 1n, retryAfterMs: 200 });
  assert.deepEqual(ctx.named("error")[0], { name: "error", kind: "undelivered", code: 402, label: "busy", msgId: 1000, clientSeq: 1n, retryAfterMs: 200 });
  assert.equal(ctx.client.state, "connected");
  // PROTOCOL.md §3.9: the edge may send the same ERROR again after a resume: reported once.
  ws.deliver({ type: "error", code: CloseCode.busy, msgId: 1000, clientSeq: 1n, retryAfterMs: 200 });
  assert.equal(ctx.named("error").length, 1, "a repeated ERROR is dropped");
  // Best-effort refusals all carry client_seq 0 and are sent once: each one is reported
  // (regression: the second was dropped as a repeat).
  ws.deliver({ type: "error", code: CloseCode.no_route, msgId: 7, clientSeq: 0n, retryAfterMs: 0 });
  ws.deliver({ type: "error", code: CloseCode.no_route, msgId: 7, clientSeq: 0n, retryAfterMs: 0 });
  assert.equal(ctx.named("error").length, 3, "every best-effort refusal reported");
  ctx.client.close();
});

test("send limits: unacked buffer and max frame size", async () => {
  const ctx = setup({ maxUnacked: 2 });
  const { ws } = await connect(ctx, 0, { maxFrameSize: 100 });
  ctx.client.send(1, "a");
  ctx.client.send(1, "b");
  assert.throws(() => ctx.client.send(1, "c"), /buffer full/);
  ws.deliver({ type: "ack", ack: 2n });
  ctx.client.send(1, new Uint8Array(90));
  assert.throws(() => ctx.client.send(1, new Uint8Array(100), "bestEffort"), /max frame size/);
  ctx.client.close();
  const closes = ws.take().filter((f) => f.type === "close");
  assert.deepEqual(closes, [{ type: "close", code: 0, message: "client closed" }]);
});

test("a WELCOME above the SDK's own 65,536 does not raise what it sends; what it receives may be that large (§10.2)", async () => {
  // Regression (2026-12-05): the JS SDK took the WELCOME's max frame size alone for its sends.
  const ctx = setup();
  const { ws } = await connect(ctx, 0, { maxFrameSize: 1_047_552 });
  assert.throws(() => ctx.client.send(1, new Uint8Array(65_536)), /max frame size 65536/);
  ctx.client.send(1, new Uint8Array(65_000));
  ws.deliver(data(1, 5, "x".repeat(100_000)));
  assert.equal(ctx.named("message").at(-1).payload.length, 100_000);
  ctx.client.close();
});

test("DATA of another reserved msg id is acknowledged and not a message (§3.4)", async () => {
  // Regression (2026-12-05): ids from 0xFFFFFF00 up other than channel events and answers
  // reached the application as messages.
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(1, 0xffffff07));
  ws.deliver(data(2, 7));
  assert.deepEqual(ctx.named("message").map((m) => [m.msgId, m.seq]), [[7, 2n]]);
  ctx.client.close();
});

test("liveness: a sequenced message unanswered for livenessMs means a dead link; the client resumes", async () => {
  const ctx = setup({ livenessMs: 120 });
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 10_000, idleTimeoutMs: 30_000 });
  ctx.client.send(1000, "hello");
  // The server never answers: no ACK, nothing at all.
  await sleep(400);
  assert.ok(ctx.WS.all.length >= 2, "reconnected");
  assert.equal(ctx.named("disconnected")[0].code, CloseCode.idle_timeout);
  assert.equal(ws.closed.code, 4103);
  assert.equal(ctx.WS.all[1].url, "ws://edge-b/", "the silent URL is tried last");
  ctx.client.close();
});

test("liveness: each link called dead doubles the timeout for the next (a reconnect storm does not feed itself)", async () => {
  const ctx = setup({ livenessMs: 60 });
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 10_000, idleTimeoutMs: 30_000 });
  assert.equal(ctx.client.livenessTimeoutMs, 60);
  ctx.client.send(1000, "hello");
  // Silence: called dead, the next link's timeout is 120 ms.
  await sleep(300);
  assert.ok(ctx.WS.all.length >= 2, "reconnected");
  assert.equal(ws.closed.code, 4103);
  assert.equal(ctx.client.livenessTimeoutMs, 120);
  ctx.client.close();
});

test("liveness: an ACK in time keeps the link", async () => {
  const ctx = setup({ livenessMs: 150 });
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 10_000, idleTimeoutMs: 30_000 });
  ctx.client.send(1000, "hello");
  await sleep(30);
  ws.deliver({ type: "ack", ack: 1n });
  await sleep(300);
  assert.equal(ctx.WS.all.length, 1, "still the first connection");
  assert.equal(ctx.named("disconnected").length, 0);
  ctx.client.close();
});

// ---------------------------------------------------------------------------------------
// Channels (PROTOCOL.md §12.3): the tracker alone, then through the client.

const { Publication, Joined, Left, HistoryLost } = ChannelEventKind;
const chEvent = (kind, epoch, offset, channel = "guild:1", body = "") => ({
  kind,
  channel,
  epoch,
  offset: BigInt(offset),
  body: new TextEncoder().encode(body),
});
const pos = (epoch, offset) => ({ epoch, offset: BigInt(offset) });

test("channel tracker: positions follow events, repeats and older offsets dropped, best-effort passes", () => {
  const t = new ChannelTracker();
  assert.deepEqual(t.accept(chEvent(Joined, 9, 4)), { kind: "joined", channel: "guild:1", epoch: 9, offset: 4n, body: new Uint8Array(0) });
  assert.deepEqual(t.positions(), new Map([["guild:1", pos(9, 4)]]));
  const p5 = t.accept(chEvent(Publication, 9, 5, "guild:1", "hi"));
  assert.equal(p5.kind, "publication");
  assert.equal(text(p5.body), "hi");
  assert.deepEqual(t.position("guild:1"), pos(9, 5));
  assert.equal(t.accept(chEvent(Publication, 9, 5)), null, "repeat");
  assert.equal(t.accept(chEvent(Publication, 9, 3)), null, "older");
  assert.equal(t.accept(chEvent(Publication, 9, 0, "guild:1", "be")).kind, "publication", "best-effort");
  assert.equal(t.accept(chEvent(Publication, 9, 0, "guild:1", "be")).kind, "publication", "best-effort again: never a duplicate");
  assert.deepEqual(t.position("guild:1"), pos(9, 5), "best-effort leaves the position");
  assert.equal(t.duplicates, 2);
  // Another channel is independent.
  assert.equal(t.accept(chEvent(Publication, 9, 1, "world")).kind, "publication", "first publication of an unknown channel");
  assert.deepEqual([...t.positions().keys()], ["guild:1", "world"]);
  // A new epoch after HISTORY_LOST: its offsets start over, below the old ones.
  assert.equal(t.accept(chEvent(HistoryLost, 11, 2)).kind, "historyLost");
  assert.deepEqual(t.position("guild:1"), pos(11, 2));
  assert.equal(t.accept(chEvent(Publication, 11, 3)).kind, "publication", "new epoch");
  assert.equal(t.accept(chEvent(Publication, 11, 3)), null, "repeat in the new epoch");
  assert.equal(t.duplicates, 3);
  // A publication of another epoch is not a duplicate (e.g. recovered on another edge).
  assert.equal(t.accept(chEvent(Publication, 12, 1)).kind, "publication");
  assert.deepEqual(t.position("guild:1"), pos(12, 1));
  // LEFT removes the channel.
  assert.deepEqual(t.accept(chEvent(Left, 12, 1)), { kind: "left", channel: "guild:1", epoch: 12, offset: 1n, body: new Uint8Array(0) });
  assert.equal(t.position("guild:1"), null);
  assert.deepEqual([...t.positions().keys()], ["world"]);
  t.accept(chEvent(Left, 9, 1, "world"));
  assert.equal(t.positions().size, 0);
  // positions() is a copy.
  t.accept(chEvent(Joined, 1, 1));
  t.positions().get("guild:1").offset = 99n;
  assert.deepEqual(t.position("guild:1"), pos(1, 1));
});

test("channel tracker: payloads are decoded; undecodable ones are counted and ignored", () => {
  const t = new ChannelTracker();
  const u = t.acceptPayload(new Uint8Array(Buffer.from("00086775696c643a3432ac02076869", "hex")));
  assert.deepEqual(u, { kind: "publication", channel: "guild:42", epoch: 300, offset: 7n, body: new TextEncoder().encode("hi") });
  assert.equal(t.acceptPayload(new Uint8Array([0x00, 0x08, 0x67])), null, "truncated");
  assert.equal(t.acceptPayload(new Uint8Array([0x04, 0x01, 0x61, 0x01, 0x01])), null, "unknown kind 4: ignored");
  assert.equal(t.acceptPayload(new Uint8Array(0)), null, "empty");
  assert.equal(t.undecodable, 3);
  assert.equal(t.duplicates, 0);
  assert.deepEqual(t.positions(), new Map([["guild:42", pos(300, 7)]]));
});

/** DATA carrying a channel event (or raw payload bytes). */
const chData = (seq, ev, cls = "critical") => ({
  type: "data",
  cls,
  msgId: CHANNEL_EVENT_MSG_ID,
  seq: BigInt(seq),
  ack: null,
  payload: ev instanceof Uint8Array ? ev : encodeChannelEvent(ev),
});

test("DATA with msg_id 0xFFFFFF01 becomes a channel event, not a message; duplicates dropped, seqs still acked", async () => {
  const ctx = setup({ ackDelayMs: 5 });
  const { ws } = await connect(ctx);
  ws.take();
  assert.deepEqual(ctx.client.channelPositions(), new Map());
  ws.deliver(chData(1, chEvent(Joined, 300, 6, "world")));
  ws.deliver(chData(2, chEvent(Publication, 300, 7, "world", "alice|hi"), "normal"));
  ws.deliver(data(3)); // an ordinary message in between
  ws.deliver(chData(4, chEvent(Publication, 300, 7, "world", "alice|hi"), "normal")); // recovered again: a duplicate
  ws.deliver(chData(0, chEvent(Publication, 300, 0, "world", "bob|fast"), "bestEffort"));
  ws.deliver(chData(5, new Uint8Array([0x00, 0x05, 0x77]))); // undecodable: dropped quietly
  assert.deepEqual(
    ctx.named("channel").map((e) => [e.kind, e.channel, e.epoch, e.offset, text(e.body)]),
    [
      ["joined", "world", 300, 6n, ""],
      ["publication", "world", 300, 7n, "alice|hi"],
      ["publication", "world", 300, 0n, "bob|fast"],
    ],
  );
  assert.deepEqual(ctx.named("message").map((m) => [m.msgId, m.seq]), [[7, 3n]], "only the ordinary message");
  assert.deepEqual(ctx.client.channelPositions(), new Map([["world", pos(300, 7)]]));
  const st = ctx.client.stats();
  assert.equal(st.channelDuplicates, 1);
  assert.equal(st.channelUndecodable, 1);
  assert.equal(st.lastServerSeq, 5n, "channel events are sequenced DATA like any other");
  assert.deepEqual(ctx.named("error"), [], "an undecodable channel event is no protocol error");
  assert.equal(ctx.client.state, "connected");
  await sleep(30);
  assert.deepEqual(ws.take(), [{ type: "ack", ack: 5n }]);
  // A replayed seq never reaches the tracker twice; LEFT ends the membership.
  ws.deliver(chData(2, chEvent(Publication, 300, 7, "world", "alice|hi"), "normal"));
  ws.deliver(chData(6, chEvent(Left, 300, 7, "world")));
  assert.deepEqual(ctx.named("channel").at(-1).kind, "left");
  assert.equal(ctx.client.stats().channelDuplicates, 1);
  assert.deepEqual(ctx.client.channelPositions(), new Map());
  ctx.client.close();
});

test("channel positions survive a new session (they are what the game recovers from, §12.4)", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.deliver(chData(1, chEvent(Joined, 42, 10, "guild:7")));
  ws.drop();
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  await ws2.open();
  ws2.deliver(welcome(3, { sessionId: id(9) }));
  assert.deepEqual(ctx.client.channelPositions(), new Map([["guild:7", pos(42, 10)]]));
  // The backend joins with `since` = that position: HISTORY_LOST on a new epoch.
  ws2.deliver(chData(1, chEvent(HistoryLost, 77, 3, "guild:7")));
  ws2.deliver(chData(2, chEvent(Publication, 77, 4, "guild:7", "x")));
  assert.deepEqual(ctx.named("channel").map((e) => [e.kind, e.epoch, e.offset]), [
    ["joined", 42, 10n],
    ["historyLost", 77, 3n],
    ["publication", 77, 4n],
  ]);
  assert.deepEqual(ctx.client.channelPositions(), new Map([["guild:7", pos(77, 4)]]));
  ctx.client.close();
});

// ---------------------------------------------------------------------------------------
// reconnectNow, giveUpAfterMs, sticky fallback, browser lifecycle hooks (SDK issue items 6 and 7)

test("reconnectNow: a live session's socket is closed and a new one opened at once; the session resumes", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(1));
  ctx.client.reconnectNow();
  assert.deepEqual(ws.take().at(-1), { type: "close", code: CloseCode.going_away, message: "reconnecting" });
  assert.equal(ws.closed.code, 1000);
  assert.equal(ctx.WS.all.length, 2, "a new socket at once, no timer");
  assert.equal(ctx.client.state, "reconnecting");
  assert.deepEqual(
    ctx.named("disconnected").map((e) => [e.code, e.wasActive, e.willReconnect, e.retryInMs]),
    [[CloseCode.going_away, true, true, 0]],
  );
  const ws2 = ctx.WS.all.at(-1);
  assert.equal(ws2.url, ws.url, "the URL that worked");
  await ws2.open();
  const [hello] = ws2.take();
  await assertResume(hello.resume, { sessionId: id(1), token: id(2), lastServerSeq: 1n, nonce: 1n });
  ws2.deliver(welcome(1, { serverSeqBase: 1n }));
  assert.equal(ctx.named("restored").length, 1);
  assert.equal(ctx.named("connectFailed").length, 0);
  ctx.client.close();
  ctx.client.reconnectNow(); // no-op after close
  assert.equal(ctx.WS.all.length, 2);
  assert.equal(ctx.client.state, "closed");
});

test("pause: the link closes with going_away, no socket (nor give-up) until reconnectNow resumes the session", async () => {
  const ctx = setup({ giveUpAfterMs: 100 });
  const { ws } = await connect(ctx);
  ws.take();
  ws.deliver(data(1));
  ctx.client.pause();
  assert.deepEqual(ws.take().at(-1), { type: "close", code: CloseCode.going_away, message: "paused" });
  assert.equal(ctx.client.state, "paused");
  assert.deepEqual(ctx.named("disconnected").map((e) => [e.reason, e.willReconnect]), [["paused", false]]);
  ctx.client.pause(); // no-op
  ctx.client.send(1000, "while-paused");
  await sleep(250); // past giveUpAfterMs
  assert.equal(ctx.WS.all.length, 1, "no socket while paused");
  assert.equal(ctx.client.state, "paused", "not given up");
  ctx.client.reconnectNow();
  assert.equal(ctx.WS.all.length, 2);
  const ws2 = ctx.WS.all.at(-1);
  await ws2.open();
  const [hello] = ws2.take();
  assert.ok(hello.resume, "a resume");
  ws2.deliver(welcome(1, { serverSeqBase: 1n, clientSeqAck: 0n }));
  assert.equal(ctx.client.state, "connected");
  assert.deepEqual(
    ws2.take().filter((f) => f.type === "data").map((f) => text(f.payload)),
    ["while-paused"],
  );
  ctx.client.close();
});

// Regression (2026-12-05, an audit against PROTOCOL.md §7.1): reconnectNow, pause and the
// handshake timeout sent CLOSE on a socket still waiting for WELCOME. The edge, whose
// WELCOME of a resume was on its way, took that CLOSE as the first frame after WELCOME and
// spent the resume token the client still held: its next resume got REJECT 300, a new
// session, and its unacknowledged messages were lost.
test("before WELCOME, reconnectNow and pause close the socket without a CLOSE frame", async () => {
  for (const act of ["reconnectNow", "pause"]) {
    const ctx = setup();
    const { ws } = await connect(ctx);
    ws.take();
    ws.deliver(data(1));
    const ws2 = await dropAndReopen(ctx, ws); // the link drops; the client resumes
    assert.deepEqual(ws2.take().map((f) => f.type), ["hello"], "a resume HELLO, unanswered");
    ctx.client[act]();
    assert.deepEqual(ws2.take(), [], `${act}: nothing sent before WELCOME`);
    assert.ok(ws2.closed, `${act}: the socket is closed`);
    ctx.client.close();
  }
});

// Regression (2026-12-05, the same audit): a token over 4,096 bytes threw inside the
// asynchronous HELLO (an unhandled rejection in Node; in a browser, "no WELCOME" retries for
// ever). It is refused where it is given.
test("an auth token no HELLO can carry is refused by the constructor and setToken", () => {
  const big = new Uint8Array(4097);
  assert.throws(() => setup({ token: big }), RangeError);
  const ctx = setup({ token: new Uint8Array(4096) });
  assert.throws(() => ctx.client.setToken(big), RangeError);
  ctx.client.setToken(new Uint8Array(16));
  ctx.client.close();
});

test("the channel codes 407-410 have their names (§4)", () => {
  assert.deepEqual(
    [407, 408, 409, 410].map((c) => Object.entries(CloseCode).find(([, v]) => v === c)?.[0]),
    ["queue_full", "unknown_channel_kind", "member_offline", "channel_limit"],
  );
});

test("reconnectNow while backing off forgets the backoff; no-op before connect()", async () => {
  const ctx = setup({ backoffMinMs: 5000, backoffMaxMs: 10_000, random: () => 0.999 });
  ctx.client.reconnectNow();
  assert.equal(ctx.WS.all.length, 0, "idle: nothing");
  assert.equal(ctx.client.state, "idle");
  ctx.client.connect();
  ctx.WS.all.at(-1).drop(1006);
  assert.equal(ctx.client.state, "connecting", "no session was ever up");
  assert.ok(ctx.named("disconnected")[0].retryInMs >= 5000);
  ctx.client.reconnectNow();
  assert.equal(ctx.WS.all.length, 2, "at once");
  assert.equal(ctx.named("disconnected").length, 1, "no second disconnected: there was no link");
  const ws2 = ctx.WS.all.at(-1);
  ws2.drop(1006);
  assert.deepEqual(failures(ctx).map(([, a]) => a), [1, 1], "the failure count was forgotten");
  ctx.client.close();
});

test("giveUpAfterAttempts: the third failed attempt in a row ends the client with closed 403 unavailable", async () => {
  const ctx = setup({ giveUpAfterAttempts: 3, backoffMinMs: 1, backoffMaxMs: 2 });
  assert.throws(() => setup({ giveUpAfterAttempts: 0 }), RangeError);
  ctx.client.connect();
  for (let i = 0; i < 10 && ctx.client.state !== "closed"; i++) {
    const w = ctx.WS.all.at(-1);
    if (w.readyState === 0) w.drop(1006);
    await sleep(10);
  }
  assert.equal(ctx.client.state, "closed");
  assert.deepEqual(failures(ctx).map(([, a]) => a), [1, 2, 3]);
  assert.equal(ctx.named("closed")[0].code, 403);
  assert.equal(ctx.WS.all.length, 3);
});

test("giveUpAfterMs: no WELCOME for that long ends the client with closed 403 unavailable", async () => {
  const ctx = setup({ giveUpAfterMs: 150 });
  const { ws } = await connect(ctx);
  await sleep(200);
  assert.equal(ctx.client.state, "connected", "a session is up: no give-up");
  ws.drop();
  const t0 = Date.now();
  // Every attempt fails.
  while (ctx.client.state !== "closed" && Date.now() - t0 < 2000) {
    const w = ctx.WS.all.at(-1);
    if (w.readyState === 0) w.drop(1006);
    await sleep(2);
  }
  const elapsed = Date.now() - t0;
  assert.equal(ctx.client.state, "closed");
  assert.ok(elapsed >= 140 && elapsed < 1000, `gave up after ${elapsed} ms`);
  assert.ok(ctx.named("connectFailed").length >= 2, "repeated failures");
  assert.deepEqual(ctx.named("closed").map((e) => [e.code, e.label]), [[403, "unavailable"]]);
  assert.equal(ctx.events.at(-1).name, "closed", "the terminal event is the last");
  const sockets = ctx.WS.all.length;
  await sleep(50);
  assert.equal(ctx.WS.all.length, sockets, "no attempt after giving up");
  assert.throws(() => ctx.client.send(1000, "x"), /closed/);
});

test("giveUpAfterMs counts from connect() when no session ever comes up", async () => {
  const ctx = setup({ giveUpAfterMs: 60, handshakeTimeoutMs: 10_000 });
  ctx.client.connect();
  await ctx.WS.all.at(-1).open(); // HELLO sent, never answered
  await sleep(120);
  assert.deepEqual(ctx.named("closed").map((e) => e.code), [CloseCode.unavailable]);
  assert.equal(ctx.WS.all[0].closed.code, 1000);
});

test("sticky fallback: after failing on URL 0 and a WELCOME on URL 1, a drop reconnects to URL 1 first", async () => {
  const ctx = setup();
  ctx.client.connect();
  const ws0 = ctx.WS.all.at(-1);
  assert.equal(ws0.url, "ws://edge-a/");
  ws0.drop(1006);
  await sleep(20);
  const ws1 = ctx.WS.all.at(-1);
  assert.equal(ws1.url, "ws://edge-b/");
  await ws1.open();
  ws1.deliver(welcome(0));
  assert.equal(ctx.named("connected")[0].url, "ws://edge-b/");
  ws1.drop();
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  assert.notEqual(ws2, ws1);
  assert.equal(ws2.url, "ws://edge-b/", "the URL that worked first");
  ws2.drop(1006); // then the list goes on
  await sleep(20);
  assert.equal(ctx.WS.all.at(-1).url, "ws://edge-a/");
  ctx.client.close();
});

test("sticky fallback: a MIGRATE target that is in the list becomes the URL tried first", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  assert.equal(ws.url, "ws://edge-a/");
  ws.deliver({ type: "migrate", deadlineMs: 5000, target: "ws://edge-b/", sessionId: id(1), resumeToken: id(7) });
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  assert.equal(ws2.url, "ws://edge-b/", "the MIGRATE target goes first");
  await ws2.open();
  ws2.deliver(welcome(1));
  ws2.drop();
  await sleep(5);
  assert.equal(ctx.WS.all.at(-1).url, "ws://edge-b/");
  ctx.client.close();
});

/** Fake browser globals: addEventListener / removeEventListener / dispatch, and a document. */
function fakeBrowser(t) {
  const listeners = new Map();
  const add = (type, fn) => {
    if (!listeners.has(type)) listeners.set(type, new Set());
    listeners.get(type).add(fn);
  };
  const remove = (type, fn) => listeners.get(type)?.delete(fn);
  const doc = { visibilityState: "visible", addEventListener: add, removeEventListener: remove };
  const had = { add: Object.getOwnPropertyDescriptor(globalThis, "addEventListener"), remove: Object.getOwnPropertyDescriptor(globalThis, "removeEventListener"), doc: Object.getOwnPropertyDescriptor(globalThis, "document") };
  Object.defineProperty(globalThis, "addEventListener", { value: add, configurable: true, writable: true });
  Object.defineProperty(globalThis, "removeEventListener", { value: remove, configurable: true, writable: true });
  Object.defineProperty(globalThis, "document", { value: doc, configurable: true, writable: true });
  t.after(() => {
    for (const [name, d] of [["addEventListener", had.add], ["removeEventListener", had.remove], ["document", had.doc]]) {
      if (d) Object.defineProperty(globalThis, name, d);
      else delete globalThis[name];
    }
  });
  const count = () => [...listeners.values()].reduce((n, s) => n + s.size, 0);
  const dispatch = (type) => {
    for (const fn of [...(listeners.get(type) ?? [])]) fn({ type });
  };
  return { doc, count, dispatch };
}

test("lifecycle: `online` reconnects at once when not connected, nothing when connected; listeners removed on close", async (t) => {
  const b = fakeBrowser(t);
  const ctx = setup({ backoffMinMs: 5000, backoffMaxMs: 10_000, random: () => 0.999 });
  assert.equal(b.count(), 0, "nothing before connect()");
  ctx.client.connect();
  assert.equal(b.count(), 2, "online + visibilitychange");
  ctx.WS.all.at(-1).drop(1006); // offline: backing off for seconds
  assert.equal(ctx.client.state, "connecting");
  b.dispatch("online");
  assert.equal(ctx.WS.all.length, 2, "reconnected at once");
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(welcome(0));
  b.dispatch("online");
  assert.equal(ctx.WS.all.length, 2, "connected: nothing");
  assert.equal(ws.closed, null);
  ctx.client.close();
  assert.equal(b.count(), 0, "removed on close()");
  b.dispatch("online");
  assert.equal(ctx.WS.all.length, 2);
});

test("lifecycle: visible again with a link silent for longer than the heartbeat reconnects; a fresh link stays", async (t) => {
  const b = fakeBrowser(t);
  const ctx = setup();
  const { ws } = await connect(ctx, 0, { heartbeatIntervalMs: 60 });
  b.dispatch("visibilitychange");
  assert.equal(ctx.WS.all.length, 1, "just heard from: nothing");
  await sleep(120); // the PING after 60 ms goes unanswered
  b.doc.visibilityState = "hidden";
  b.dispatch("visibilitychange");
  assert.equal(ctx.WS.all.length, 1, "hidden: nothing");
  b.doc.visibilityState = "visible";
  b.dispatch("visibilitychange");
  assert.equal(ctx.WS.all.length, 2, "silent link: reconnected at once");
  assert.equal(ws.closed.code, 1000);
  const ws2 = ctx.WS.all.at(-1);
  await ws2.open();
  assert.ok(ws2.take()[0].resume, "resumes");
  ctx.client.close();
  assert.equal(b.count(), 0);
});

test("lifecycle: lifecycleHooks false installs nothing", async (t) => {
  const b = fakeBrowser(t);
  const ctx = setup({ lifecycleHooks: false });
  ctx.client.connect();
  assert.equal(b.count(), 0);
  ctx.client.close();
});

// ---------------------------------------------------------------------------------------
// Connection state and outcome names (the same in every SDK), maxOfflineAgeMs / `expired`

const transitions = (ctx) => ctx.named("stateChange").map((e) => `${e.from}->${e.to}`);

test("state: idle, connecting, connected, reconnecting, closed; stateChange once per change, before the event that caused it", async () => {
  const ctx = setup();
  const seenInListener = [];
  ctx.client.on("stateChange", (e) => seenInListener.push([e.to, ctx.client.state, ctx.client.stats().state]));
  assert.equal(ctx.client.state, "idle");
  assert.equal(ctx.client.stats().state, "idle");
  ctx.client.connect();
  assert.equal(ctx.client.state, "connecting");
  assert.deepEqual(transitions(ctx), ["idle->connecting"]);
  ctx.WS.all.at(-1).drop(1006); // the first attempt fails: still connecting (no session yet)
  assert.equal(ctx.client.state, "connecting");
  await sleep(20);
  let ws = ctx.WS.all.at(-1);
  await ws.open();
  assert.equal(ctx.client.state, "connecting", "handshaking is still connecting");
  ws.deliver(welcome(0));
  assert.equal(ctx.client.state, "connected");
  assert.deepEqual(transitions(ctx), ["idle->connecting", "connecting->connected"]);
  const names = () => ctx.events.map((e) => e.name).filter((n) => n !== "connectFailed");
  assert.deepEqual(names().slice(-3), ["stateChange", "connected", "newSession"]);
  ws.drop();
  assert.equal(ctx.client.state, "reconnecting");
  assert.deepEqual(names().slice(-2), ["stateChange", "disconnected"]);
  await sleep(5);
  ctx.WS.all.at(-1).drop(1006); // a failed attempt while reconnecting: no change
  assert.equal(ctx.client.state, "reconnecting");
  await sleep(20);
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(welcome(1));
  assert.equal(ctx.client.state, "connected");
  ctx.client.reconnectNow();
  assert.equal(ctx.client.state, "reconnecting");
  ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.deliver(welcome(1));
  ctx.client.close();
  assert.equal(ctx.client.state, "closed");
  assert.deepEqual(transitions(ctx), [
    "idle->connecting",
    "connecting->connected",
    "connected->reconnecting",
    "reconnecting->connected",
    "connected->reconnecting",
    "reconnecting->connected",
    "connected->closed",
  ]);
  assert.deepEqual(names().slice(-2), ["stateChange", "closed"]);
  assert.ok(seenInListener.every(([to, state, stats]) => to === state && to === stats), "state already updated in the listener");
});

test("state: closed straight from connecting (refused) and from idle (close() before connect)", async () => {
  const a = setup();
  a.client.close();
  assert.equal(a.client.state, "closed");
  assert.deepEqual(transitions(a), ["idle->closed"]);
  const b = setup();
  b.client.connect();
  const ws = b.WS.all.at(-1);
  await ws.open();
  ws.deliver({ type: "reject", code: CloseCode.auth_bad_signature, retryAfterMs: 0, message: "bad" });
  assert.equal(b.client.state, "closed");
  assert.deepEqual(transitions(b), ["idle->connecting", "connecting->closed"]);
});

test("outcome names: connected carries new_session, restored, restored_with_gap, restore_failed_new_session; the convenience events still fire", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  let w = ws;
  for (const [code, opts] of [
    [1, {}],
    [2, { serverSeqBase: 5n }],
    [3, { sessionId: id(9) }],
  ]) {
    w.drop();
    await sleep(5);
    w = ctx.WS.all.at(-1);
    await w.open();
    w.deliver(welcome(code, opts));
  }
  assert.deepEqual(ctx.named("connected").map((e) => e.outcome), ["new_session", "restored", "restored_with_gap", "restore_failed_new_session"]);
  assert.deepEqual(ctx.named("newSession").map((e) => e.restoreFailed), [false, true]);
  assert.equal(ctx.named("restored").length, 1);
  assert.deepEqual(ctx.named("restoredWithGap").map((e) => e.serverSeqBase), [5n]);
  ctx.client.close();
});

/** A controllable clock under the client's `performance.now()`: `advance(ms)` moves it on. */
function fakeClock(t) {
  const real = performance.now.bind(performance);
  let skew = 0;
  t.mock.method(performance, "now", () => real() + skew);
  return { advance: (ms) => (skew += ms) };
}

/** Up with a new session, then the link drops; returns the next socket (not yet open). */
async function upThenDropped(ctx) {
  const { ws } = await connect(ctx);
  ws.take();
  return {
    ws,
    async drop() {
      ws.drop();
      await sleep(5);
      const next = ctx.WS.all.at(-1);
      assert.notEqual(next, ws, "reconnecting");
      return next;
    },
  };
}

const upstream = (frames) => frames.filter((f) => f.type === "data").map((f) => [f.seq, text(f.payload)]);

test("maxOfflineAgeMs: on a resume, offline messages older than the bound expire, later ones are renumbered, transmitted ones stay", async (t) => {
  const clock = fakeClock(t);
  const ctx = setup({ maxOfflineAgeMs: 1000 });
  const up = await upThenDropped(ctx);
  assert.equal(ctx.client.send(1000, "sent-1"), 1n); // transmitted, never acked
  assert.deepEqual(upstream(up.ws.take()), [[1n, "sent-1"]]);
  const ws2 = await up.drop();
  assert.equal(ctx.client.send(1001, "stale-2"), 2n);
  assert.equal(ctx.client.send(1002, "stale-3", "critical"), 3n);
  clock.advance(1500);
  assert.equal(ctx.client.send(1004, "fresh-4"), 4n);
  clock.advance(900); // fresh-4 is 900 ms old: within the bound; sent-1 is 2400 ms old but went out
  assert.equal(ctx.client.send(1005, "fresh-5"), 5n);
  await ws2.open();
  ws2.take();
  ws2.deliver(welcome(1, { clientSeqAck: 0n }));
  const sent = ws2.take();
  assert.deepEqual(sent[0], { type: "ack", ack: 0n });
  assert.deepEqual(upstream(sent), [
    [1n, "sent-1"],
    [2n, "fresh-4"],
    [3n, "fresh-5"],
  ], "the stale ones are gone and the seqs stay contiguous");
  const expired = ctx.named("expired");
  assert.deepEqual(expired.map((e) => [e.msgId, e.seq]), [
    [1001, 2n],
    [1002, 3n],
  ]);
  assert.ok(expired.every((e) => e.ageMs >= 2400 && e.ageMs < 3000 && Number.isInteger(e.ageMs)), JSON.stringify(expired.map((e) => e.ageMs)));
  assert.deepEqual(
    ctx.events.map((e) => e.name).slice(-5),
    ["stateChange", "connected", "expired", "expired", "restored"],
    "expired between connected and restored",
  );
  assert.equal(ctx.named("restored").at(-1).resent, 3);
  assert.equal(ctx.client.stats().unacked, 3);
  // Numbering goes on after the renumbered tail; the server's ack covers them all.
  assert.equal(ctx.client.send(1006, "next"), 4n);
  assert.deepEqual(upstream(ws2.take()), [[4n, "next"]]);
  ws2.deliver({ type: "ack", ack: 4n });
  assert.equal(ctx.client.stats().unacked, 0);
  assert.deepEqual(ctx.named("error"), [], "no protocol error");
  ctx.client.close();
});

test("a message queued before the WELCOME above the max frame size it announces is dropped as expired, never sent; later ones renumbered", async () => {
  const ctx = setup();
  assert.equal(ctx.client.send(1000, "small-1"), 1n);
  assert.equal(ctx.client.send(1001, new Uint8Array(200)), 2n); // fits the client's own 65,536
  assert.equal(ctx.client.send(1002, "small-3"), 3n);
  ctx.client.connect();
  const ws = ctx.WS.all.at(-1);
  await ws.open();
  ws.take();
  ws.deliver(welcome(0, { maxFrameSize: 100 }));
  assert.deepEqual(upstream(ws.take()), [
    [1n, "small-1"],
    [2n, "small-3"],
  ]);
  assert.deepEqual(ctx.named("expired").map((e) => [e.msgId, e.seq]), [[1001, 2n]]);
  assert.equal(ctx.client.send(1003, "next"), 3n);
  assert.deepEqual(ctx.named("error"), [], "no protocol error");
  ctx.client.close();
});

test("maxOfflineAgeMs: restored_with_gap expires too; messages acked by client_seq_ack are simply gone", async (t) => {
  const clock = fakeClock(t);
  const ctx = setup({ maxOfflineAgeMs: 100 });
  const up = await upThenDropped(ctx);
  ctx.client.send(1000, "sent-1");
  ctx.client.send(1000, "sent-2");
  const ws2 = await up.drop();
  ctx.client.send(1000, "stale-3");
  ctx.client.send(1000, "stale-4");
  clock.advance(101);
  await ws2.open();
  ws2.take();
  ws2.deliver(welcome(2, { serverSeqBase: 9n, clientSeqAck: 1n }));
  assert.deepEqual(upstream(ws2.take()), [[2n, "sent-2"]]);
  assert.deepEqual(ctx.named("expired").map((e) => e.seq), [3n, 4n]);
  assert.equal(ctx.named("restoredWithGap")[0].resent, 1);
  assert.equal(ctx.client.send(1000, "next"), 3n);
  ctx.client.close();
});

test("maxOfflineAgeMs: no expiry with the bound 0 (the default), for fresh messages, or on a new session; before the first session as on a resume", async (t) => {
  const clock = fakeClock(t);
  // The bound 0: everything goes out however late.
  for (const options of [{}, { maxOfflineAgeMs: 0 }]) {
    const ctx = setup(options);
    const up = await upThenDropped(ctx);
    const ws2 = await up.drop();
    ctx.client.send(1000, "old-1");
    clock.advance(3_600_000);
    ctx.client.send(1000, "old-2");
    await ws2.open();
    ws2.take();
    ws2.deliver(welcome(1));
    assert.deepEqual(upstream(ws2.take()), [[1n, "old-1"], [2n, "old-2"]]);
    assert.deepEqual(ctx.named("expired"), []);
    ctx.client.close();
  }
  // Within the bound (59 s old with a 60 s bound): nothing expires.
  {
    const ctx = setup({ maxOfflineAgeMs: 60_000 });
    const up = await upThenDropped(ctx);
    const ws2 = await up.drop();
    ctx.client.send(1000, "fresh-1");
    clock.advance(59_000);
    await ws2.open();
    ws2.take();
    ws2.deliver(welcome(1));
    assert.deepEqual(upstream(ws2.take()), [[1n, "fresh-1"]]);
    assert.deepEqual(ctx.named("expired"), []);
    ctx.client.close();
  }
  // Before the first session the bound holds as on a resume (as in the Rust SDK): a
  // message queued too long before the first WELCOME expires.
  {
    const ctx = setup({ maxOfflineAgeMs: 10 });
    ctx.client.send(1000, "early-1");
    clock.advance(10_000);
    const { ws } = await connect(ctx);
    assert.deepEqual(upstream(ws.take()), []);
    assert.deepEqual(ctx.named("expired").map((e) => [e.msgId, e.seq]), [[1000, 1n]]);
    // A resume refused: a new session discards the old messages as before; none "expire".
    ctx.client.send(1000, "lost-2");
    ws.drop();
    await sleep(5);
    const ws2 = ctx.WS.all.at(-1);
    ctx.client.send(1000, "lost-3");
    clock.advance(10_000);
    await ws2.open();
    ws2.take();
    ws2.deliver(welcome(3, { sessionId: id(9) }));
    assert.deepEqual(upstream(ws2.take()), []);
    assert.equal(ctx.named("newSession").at(-1).discarded, 2);
    assert.equal(ctx.named("expired").length, 1, "a new session discards; nothing more expires");
    assert.equal(ctx.client.send(1000, "fresh"), 1n);
    ctx.client.close();
  }
});

test("maxOfflineAgeMs must be a number >= 0", () => {
  for (const bad of [-1, Number.NaN, Infinity]) {
    assert.throws(() => setup({ maxOfflineAgeMs: bad }), RangeError);
  }
});

// -------------------------------------------------------------------------------------
// Requests and answers (PROTOCOL.md §13), the server clock: the Rust SDK's requests.rs /
// clock.rs behaviour. Exactly one outcome per request.

/** The DATA frames sent on `ws` since the last take. */
const dataSent = (ws) => ws.take().filter((f) => f.type === "data");
/** A promise's rejection (fails the test when it resolves). */
const rejection = (p) => p.then((v) => assert.fail(`resolved: ${JSON.stringify(v)}`), (e) => e);
/** Waits (bounded) until `cond()` holds. */
async function until(cond, what, ms = 2000) {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await sleep(2);
  }
}

test("requests: the codec is PROTOCOL.md §13's worked example", () => {
  assert.equal(ANSWER_MSG_ID, 0xffffff02);
  assert.deepEqual([...encodeRequest(7, new TextEncoder().encode("hi"))], [0, 0, 0, 7, 0x68, 0x69]);
  const a = decodeAnswer(new Uint8Array([0, 0, 0, 7, 0, 0, 0x6f, 0x6b]));
  assert.deepEqual({ ...a, body: text(a.body) }, { id: 7, status: 0, body: "ok" });
  assert.deepEqual(decodeAnswer(new Uint8Array([0xff, 0xff, 0xff, 0xff, 0xff, 0xfe])), { id: 0xffffffff, status: 0xfffe, body: new Uint8Array(0) });
  assert.equal(decodeAnswer(new Uint8Array(5)), null, "too short");
  assert.throws(() => encodeRequest(0, new Uint8Array(0)), RangeError, "id 0 is not a request id");
});

test("request: the id goes in front of the body; the answer resolves it (status and body) and is never a message", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  const p1 = ctx.client.request(1011, "hi");
  const p2 = ctx.client.request(1011, new Uint8Array([9]), { cls: "critical" });
  const sent = dataSent(ws);
  assert.deepEqual(sent.map((f) => [f.msgId, f.cls, f.seq]), [
    [1011, "normal", 1n],
    [1011, "critical", 2n],
  ]);
  const [r1, r2] = sent.map(requestOf);
  assert.ok(r1.id > 0 && r2.id > 0 && r1.id !== r2.id, "ids not 0, unique among pending");
  assert.equal(text(r1.body), "hi");
  assert.deepEqual([...r2.body], [9]);
  assert.equal(ctx.client.stats().requestsPending, 2);
  // Answers carry the id: any order. A non-zero status is the game server's own code.
  ws.deliver(answer(1, r2.id, 7, "nope"));
  ws.deliver(answer(2, r1.id, 0, "ok"));
  const [a1, a2] = await Promise.all([p1, p2]);
  assert.ok(a1.body instanceof Uint8Array);
  assert.deepEqual([a1.status, text(a1.body)], [0, "ok"]);
  assert.deepEqual([a2.status, text(a2.body)], [7, "nope"]);
  assert.deepEqual(ctx.named("message"), [], "answers are not messages");
  assert.deepEqual(ctx.named("answer"), [], "request()'s outcome goes to its promise, not to events");
  assert.equal(ctx.client.stats().requestsPending, 0);
  assert.equal(ctx.client.stats().lastServerSeq, 2n, "answers are sequenced: counted and acked like any message");
  // A replayed answer (same server seq) is a duplicate; messages go on as before.
  ws.deliver(answer(2, r1.id, 0, "ok"));
  ws.deliver(data(3, 2000, "after"));
  assert.deepEqual(ctx.named("message").map((m) => text(m.payload)), ["after"]);
  // startRequest: the id at once, the outcome as an `answer` event.
  const id3 = ctx.client.startRequest(1011, "evt", { cls: "critical" });
  const [r3] = dataSent(ws).map(requestOf);
  assert.equal(r3.id, id3);
  ws.deliver(answer(4, id3, 0, "evt-ok"));
  assert.deepEqual(ctx.named("answer").map((e) => [e.requestId, e.status, text(e.body)]), [[id3, 0, "evt-ok"]]);
  assert.deepEqual(ctx.named("message").length, 1);
  ctx.client.close();
});

test("request refused by an ERROR for its client seq: `refused` with code, label, retryAfterMs, and no `error` event", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  assert.equal(ctx.client.send(1000, "plain"), 1n);
  const p = rejection(ctx.client.request(1011, "x")); // seq 2
  const id3 = ctx.client.startRequest(1012, "y"); // seq 3
  const [, r2] = dataSent(ws).map(requestOf);
  ws.deliver({ type: "error", code: CloseCode.no_route, msgId: 1011, clientSeq: 2n, retryAfterMs: 0 });
  ws.deliver({ type: "error", code: CloseCode.busy, msgId: 1012, clientSeq: 3n, retryAfterMs: 250 });
  ws.deliver({ type: "error", code: CloseCode.busy, msgId: 1000, clientSeq: 1n, retryAfterMs: 100 });
  const e = await p;
  assert.ok(e instanceof RequestError);
  assert.deepEqual([e.reason, e.requestId, e.code, e.label, e.retryAfterMs], ["refused", r2.id, 404, "no_route", 0]);
  assert.deepEqual(ctx.named("requestFailed"), [
    { name: "requestFailed", requestId: id3, reason: "refused", code: 402, label: "busy", retryAfterMs: 250, message: "refused: busy" },
  ]);
  assert.deepEqual(ctx.named("error").map((x) => x.clientSeq), [1n], "only the plain message's ERROR is an `error`");
  // §3.9: the same ERROR again (after a resume) is dropped; a late answer too.
  ws.deliver({ type: "error", code: CloseCode.no_route, msgId: 1011, clientSeq: 2n, retryAfterMs: 0 });
  ws.deliver(answer(1, r2.id, 0, "late"));
  assert.equal(ctx.named("error").length, 1);
  assert.deepEqual([ctx.named("answer").length, ctx.named("message").length, ctx.named("requestFailed").length], [0, 0, 1]);
  assert.equal(ctx.client.state, "connected");
  ctx.client.close();
});

test("request timeout: `timeout` after timeoutMs; a late answer, an unknown id or a short payload are dropped (and acked)", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  const started = performance.now();
  const p = rejection(ctx.client.request(1011, "slow", { timeoutMs: 30 }));
  const id2 = ctx.client.startRequest(1011, "slow too", { timeoutMs: 40 });
  const [r1] = dataSent(ws).map(requestOf);
  const e = await p;
  assert.deepEqual([e.reason, e.requestId, e.code, e.label, e.retryAfterMs], ["timeout", r1.id, null, null, 0]);
  assert.ok(performance.now() - started >= 20, "not before its time");
  await until(() => ctx.named("requestFailed").length > 0, "the second timeout");
  assert.deepEqual(ctx.named("requestFailed").map((f) => [f.requestId, f.reason, f.code, f.label, f.retryAfterMs]), [[id2, "timeout", null, null, 0]]);
  assert.equal(ctx.client.stats().requestsPending, 0);
  ws.deliver(answer(1, r1.id, 0, "too late"));
  ws.deliver(answer(2, id2, 0, "too late"));
  ws.deliver(answer(3, 4242, 0, "who?"));
  ws.deliver({ type: "data", cls: "critical", msgId: ANSWER_MSG_ID, seq: 4n, ack: null, payload: new Uint8Array([1, 2]) });
  assert.deepEqual([ctx.named("message").length, ctx.named("answer").length, ctx.named("error").length], [0, 0, 0]);
  assert.equal(ctx.named("requestFailed").length, 1, "one outcome");
  assert.equal(ctx.client.stats().lastServerSeq, 4n, "dropped answers still count as received");
  assert.equal(ctx.client.state, "connected");
  ctx.client.close();
});

test("requests not sent: not_sequenced (best-effort), buffer_full, too_large, closed; bad arguments", async () => {
  const ctx = setup({ maxUnacked: 1 });
  const { ws } = await connect(ctx, 0, { maxFrameSize: 100 });
  ws.take();
  const e1 = await rejection(ctx.client.request(1011, "x", { cls: "bestEffort" }));
  assert.ok(e1 instanceof RequestError);
  assert.deepEqual([e1.reason, e1.requestId], ["not_sequenced", null]);
  assert.throws(() => ctx.client.startRequest(1011, "x", { cls: "bestEffort" }), (e) => e instanceof RequestError && e.reason === "not_sequenced");
  assert.deepEqual(dataSent(ws), [], "nothing sent");
  assert.equal((await rejection(ctx.client.request(1011, new Uint8Array(97)))).reason, "too_large");
  const waiting = rejection(ctx.client.request(1011, "fills the send buffer"));
  assert.equal((await rejection(ctx.client.request(1011, "x"))).reason, "buffer_full");
  assert.throws(() => ctx.client.startRequest(1011, "x"), (e) => e.reason === "buffer_full");
  assert.throws(() => ctx.client.startRequest(1011, "x", { timeoutMs: -1 }), RangeError);
  assert.throws(() => ctx.client.startRequest(1011, "x", { timeoutMs: Number.NaN }), RangeError);
  await assert.rejects(ctx.client.request(-1, "x"), RangeError);
  assert.equal(ctx.client.stats().requestsPending, 1);
  assert.equal(dataSent(ws).length, 1);
  ctx.client.close();
  assert.equal((await waiting).reason, "closed");
  assert.equal((await rejection(ctx.client.request(1011, "after"))).reason, "closed");
  assert.throws(() => ctx.client.startSyncClock(1010), (e) => e instanceof RequestError && e.reason === "closed");
});

test("closed: close() (or a kick) fails every waiting request with `closed`, outcomes before the terminal events, once", async () => {
  const ctx = setup();
  // Queued before connect() too: a request waits like a message.
  const early = rejection(ctx.client.request(1011, "before connect"));
  const { ws } = await connect(ctx);
  const p = rejection(ctx.client.request(1011, "a", { timeoutMs: 100 }));
  const id2 = ctx.client.startRequest(1011, "b", { timeoutMs: 100 });
  const id3 = ctx.client.startSyncClock(1010, 100);
  ctx.client.close();
  assert.deepEqual([(await early).reason, (await p).reason], ["closed", "closed"]);
  assert.deepEqual(ctx.named("requestFailed").map((f) => [f.requestId, f.reason]), [
    [id2, "closed"],
    [id3, "closed"],
  ]);
  assert.deepEqual(ctx.events.map((e) => e.name).slice(-4), ["requestFailed", "requestFailed", "stateChange", "closed"]);
  await sleep(150); // past their timeouts: nothing more (the timers went with the outcomes)
  assert.equal(ctx.named("requestFailed").length, 2);
  ws.deliver(answer(1, id2, 0, "late")); // a socket the client dropped: ignored anyway
  assert.equal(ctx.named("answer").length, 0);

  // Kicked: terminal, the same.
  const k = setup();
  const { ws: kws } = await connect(k);
  const kp = rejection(k.client.request(1011, "a"));
  kws.deliver({ type: "close", code: CloseCode.kicked, message: "another login" });
  assert.equal((await kp).reason, "closed");
  assert.equal(k.client.stats().requestsPending, 0);
});

test("logout(): CLOSE logout on the socket, then closed (code 2) and no reconnect; close() sends CLOSE normal", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  assert.equal(ctx.client.logout(), true, "sent on the live session's socket");
  assert.deepEqual(ws.take().at(-1), { type: "close", code: CloseCode.logout, message: "logged out" });
  assert.equal(ctx.client.state, "closed");
  assert.deepEqual(ctx.named("closed").map((e) => [e.code, e.label]), [[2, "logout"]]);
  assert.equal(ctx.client.logout(), false, "twice: already ended, nothing more");
  assert.equal(ctx.named("closed").length, 1);
  await sleep(30);
  assert.equal(ctx.WS.all.length, 1, "no reconnect after a logout");

  const c2 = setup();
  const { ws: ws2 } = await connect(c2);
  ws2.take();
  c2.client.close();
  assert.deepEqual(ws2.take().at(-1), { type: "close", code: CloseCode.normal, message: "client closed" });

  // Regression (2026-12-04): a logout before the WELCOME returned false but sent
  // CLOSE(logout), which an edge whose WELCOME was on its way takes as the session's end.
  const c3 = setup();
  c3.client.connect();
  const ws3 = c3.WS.all.at(-1);
  await ws3.open();
  ws3.take(); // the HELLO; no WELCOME yet
  assert.equal(c3.client.logout(), false, "no session up yet");
  assert.deepEqual(ws3.take().at(-1), { type: "close", code: CloseCode.normal, message: "logged out" });
});

test("session_lost: a resume keeps requests; a new session (restore failed, or new_session after a session) fails them", async () => {
  const ctx = setup();
  const { ws } = await connect(ctx);
  ws.take();
  const pa = ctx.client.request(1011, "a"); // seq 1, in session 1
  const [ra] = dataSent(ws).map(requestOf);
  ws.drop();
  await sleep(5);
  const ws2 = ctx.WS.all.at(-1);
  const pb = ctx.client.request(1011, "b"); // seq 2, queued while down
  await ws2.open();
  ws2.take();
  ws2.deliver(welcome(1, { resumeToken: id(3) }));
  const resent = dataSent(ws2).map(requestOf);
  assert.deepEqual(resent.map((r) => text(r.body)), ["a", "b"], "resent with their ids");
  assert.equal(resent[0].id, ra.id);
  ws2.deliver(answer(1, resent[1].id, 0, "B"));
  ws2.deliver(answer(2, ra.id, 0, "A"));
  assert.deepEqual([text((await pa).body), text((await pb).body)], ["A", "B"], "requests survive a resume");
  ws2.deliver({ type: "ack", ack: 2n });

  // Restore refused: a new session. The request sent in the old one and the one queued
  // while down are both lost; their outcomes come before the WELCOME's events.
  const pc = rejection(ctx.client.request(1011, "c"));
  ws2.drop();
  await sleep(5);
  const ws3 = ctx.WS.all.at(-1);
  const pd = rejection(ctx.client.request(1011, "d"));
  const idE = ctx.client.startRequest(1011, "e");
  const before = ctx.events.length;
  await ws3.open();
  ws3.take();
  ws3.deliver(welcome(3, { sessionId: id(9) }));
  assert.deepEqual(dataSent(ws3), [], "the old session's messages are discarded");
  assert.deepEqual([(await pc).reason, (await pd).reason], ["session_lost", "session_lost"]);
  assert.deepEqual(ctx.events.slice(before).map((e) => e.name), ["requestFailed", "stateChange", "connected", "newSession"]);
  assert.deepEqual(ctx.named("requestFailed").map((f) => [f.requestId, f.reason]), [[idE, "session_lost"]]);
  assert.equal(ctx.named("newSession").at(-1).discarded, 3);
  assert.equal(ctx.client.stats().requestsPending, 0);

  // The new session's requests number from 1 again and are answered.
  const pf = ctx.client.request(1011, "f");
  const [rf] = dataSent(ws3);
  assert.equal(rf.seq, 1n);
  ws3.deliver(answer(1, requestOf(rf).id, 0, "F"));
  assert.equal(text((await pf).body), "F");

  // outcome new_session after a session (the edge forgot it): the same.
  const pg = rejection(ctx.client.request(1011, "g"));
  ws3.drop();
  await sleep(5);
  const ws4 = ctx.WS.all.at(-1);
  await ws4.open();
  ws4.take();
  ws4.deliver(welcome(0, { sessionId: id(10) }));
  assert.equal((await pg).reason, "session_lost");
  ctx.client.close();
});

test("requests and maxOfflineAgeMs: an expired request fails `expired` (no `expired` event); later requests keep their seq mapping", async (t) => {
  const clock = fakeClock(t);
  const ctx = setup({ maxOfflineAgeMs: 1000 });
  const up = await upThenDropped(ctx);
  const ws2 = await up.drop();
  assert.equal(ctx.client.send(1001, "stale-1"), 1n);
  const pa = rejection(ctx.client.request(1011, "stale request")); // seq 2
  const idA2 = ctx.client.startRequest(1012, "stale request 2"); // seq 3
  clock.advance(1500);
  const pb = ctx.client.request(1013, "fresh b"); // seq 4 -> 1
  const idC = ctx.client.startRequest(1014, "fresh c"); // seq 5 -> 2
  assert.equal(ctx.client.send(1005, "fresh-6"), 6n); // -> 3
  const before = ctx.events.length;
  await ws2.open();
  ws2.take();
  ws2.deliver(welcome(1));
  const sent = dataSent(ws2);
  assert.deepEqual(sent.map((f) => [f.seq, f.msgId]), [
    [1n, 1013],
    [2n, 1014],
    [3n, 1005],
  ]);
  const ea = await pa;
  assert.deepEqual([ea.reason, ea.code], ["expired", null]);
  assert.deepEqual(ctx.named("expired").map((e) => [e.msgId, e.seq]), [[1001, 1n]], "a request's expiry is its rejection, not an `expired` event");
  assert.deepEqual(
    ctx.events.slice(before).map((e) => e.name),
    ["requestFailed", "stateChange", "connected", "expired", "restored"],
  );
  assert.deepEqual(ctx.named("requestFailed").map((f) => [f.requestId, f.reason]), [[idA2, "expired"]]);
  // Seq 2 is now request c (it was 5): its ERROR refuses c, not b.
  ws2.deliver({ type: "error", code: CloseCode.busy, msgId: 1014, clientSeq: 2n, retryAfterMs: 5 });
  assert.deepEqual(ctx.named("requestFailed").at(-1), { name: "requestFailed", requestId: idC, reason: "refused", code: 402, label: "busy", retryAfterMs: 5, message: "refused: busy" });
  // An ERROR for seq 3 is the plain message's: an `error` event.
  ws2.deliver({ type: "error", code: CloseCode.busy, msgId: 1005, clientSeq: 3n, retryAfterMs: 0 });
  assert.deepEqual(ctx.named("error").map((e) => [e.msgId, e.clientSeq]), [[1005, 3n]]);
  ws2.deliver(answer(1, requestOf(sent[0]).id, 0, "B"));
  assert.equal(text((await pb).body), "B");
  assert.equal(ctx.client.stats().requestsPending, 0);
  // New requests go on after the renumbered tail.
  const pn = rejection(ctx.client.request(1011, "next"));
  assert.deepEqual(dataSent(ws2).map((f) => f.seq), [4n]);
  ctx.client.close();
  assert.equal((await pn).reason, "closed");
});

test("clock: ClockSync keeps the last 8 samples and chooses the one with the smallest round trip", () => {
  const c = new ClockSync();
  assert.equal(c.estimate(), null);
  // Server 5 s ahead; 100 ms round trip, symmetric.
  assert.deepEqual(c.observe(1_000_000, 100, 1_005_050), { offsetMs: 5000, rttMs: 100, samples: 1 });
  // A slow exchange does not move it; a faster one does.
  assert.deepEqual(c.observe(1_001_000, 500, 1_006_050), { offsetMs: 5000, rttMs: 100, samples: 2 });
  assert.deepEqual(c.observe(1_002_000, 20, 1_007_011), { offsetMs: 5001, rttMs: 20, samples: 3 });
  // Old samples age out.
  for (let i = 0; i < 8; i++) c.observe(1_003_000 + i, 60, 1_003_030 + i - 250);
  assert.deepEqual(c.estimate(), { offsetMs: -250, rttMs: 60, samples: 11 });
  // Equal round trips: the earlier sample stays.
  c.observe(1_010_000, 60, 1_010_030 + 7);
  assert.equal(c.estimate().offsetMs, -250);
});

test("syncClock: a critical request with an empty body; offset T - (t0 + rtt/2) from the min-rtt sample; clockOffset and stats().clock", async (t) => {
  const ctx = setup({ livenessMs: 0 });
  const { ws } = await connect(ctx);
  ws.take();
  // Wall clock (t0) and monotonic clock (rtt) under the test's control.
  let mono = 50_000;
  let wall = 0;
  t.mock.method(performance, "now", () => mono);
  t.mock.method(Date, "now", () => wall);
  assert.equal(ctx.client.clockOffset, null);
  assert.equal(ctx.client.stats().clock, null);
  let seq = 0;
  /** One exchange: sent at local `at`, answered `server` after `rtt` ms. */
  const exchange = (at, rtt, server, { status = 0, body = unixMsBody(server), start = false } = {}) => {
    wall = at;
    const p = start ? ctx.client.startSyncClock(1010) : ctx.client.syncClock(1010);
    const [f] = dataSent(ws);
    assert.deepEqual([f.cls, f.msgId, requestOf(f).body.length], ["critical", 1010, 0]);
    mono += rtt;
    wall += rtt + 1234; // the wall clock at receipt plays no part
    ws.deliver(answer(++seq, requestOf(f).id, status, body));
    return start ? requestOf(f).id : p;
  };
  assert.deepEqual(await exchange(1_000_000, 100, 1_005_050), { offsetMs: 5000, rttMs: 100, samples: 1 });
  assert.equal(ctx.client.clockOffset, 5000);
  assert.deepEqual(await exchange(1_001_000, 500, 1_006_050), { offsetMs: 5000, rttMs: 100, samples: 2 }, "a slow exchange does not move it");
  assert.deepEqual(await exchange(1_002_000, 20, 1_007_011), { offsetMs: 5001, rttMs: 20, samples: 3 });
  assert.deepEqual(ctx.client.stats().clock, { offsetMs: 5001, rttMs: 20, samples: 3 });
  // Not a clock answer: `bad_answer`, no sample.
  for (const opts of [{ status: 3 }, { body: new Uint8Array(4) }]) {
    const e = await rejection(exchange(1_003_000, 1, 1_003_000, opts));
    assert.equal(e.reason, "bad_answer");
  }
  assert.deepEqual(ctx.client.stats().clock, { offsetMs: 5001, rttMs: 20, samples: 3 });
  // startSyncClock: the outcome as an `answer` event; the estimate follows it.
  const id = exchange(1_004_000, 10, 1_009_000, { start: true });
  assert.deepEqual(ctx.named("answer").map((e) => [e.requestId, e.status, e.body.length]), [[id, 0, 8]]);
  assert.deepEqual(ctx.client.stats().clock, { offsetMs: 4995, rttMs: 10, samples: 4 });
  assert.equal(ctx.client.clockOffset, 4995);
  assert.deepEqual(ctx.named("message"), []);
  ctx.client.close();
});
