// The in-page half of the Chromium check of the Unity WebGL bridge: the SDK comes from the
// global bootstrap (dist/global.js, loaded by the page before this module), the .jslib is
// fetched and linked with the Emscripten stand-in, and a scripted WebSocket plays the edge.
// What differs from the node test: a real browser's globals (window.Waygate, btoa,
// TextEncoder, WebCrypto's resume proof in a secure context, the `waygate:ready` event).
import { loadJslib } from "../test-support/emscripten-mock.mjs";
import { answer, data, requestOf, scriptedWebSocket, sleep, unixMsBody, welcome } from "../test-support/fake-edge.mjs";

const checks = [];
const check = (ok, what) => checks.push({ ok: Boolean(ok), what });

async function run() {
  check(typeof window.Waygate?.WaygateClient === "function", "window.Waygate set by dist/global.js");
  check(window.readyEvents === 1, "one waygate:ready event, seen by a classic script");
  const source = await (await fetch("../../unity-webgl/Plugins/WaygateWebGL.jslib")).text();
  const m = loadJslib(source);
  const api = m.api;
  const bufLen = 65536;
  const buf = m.malloc(bufLen);
  const poll = (h) => {
    const n = api.WaygateWebGL_Poll(h, buf, bufLen);
    return n > 0 ? JSON.parse(m.readText(buf, n)) : n;
  };
  const drain = (h) => {
    const out = [];
    for (let i = 0; i < 1000; i++) {
      const e = poll(h);
      if (typeof e === "number") break;
      out.push(e);
    }
    return out;
  };
  const WS = scriptedWebSocket();
  const RealWS = window.WebSocket;
  window.WebSocket = WS;
  const opts = m.cstr(JSON.stringify({ urls: ["wss://edge.example/"], token: "qrs", backoffMinMs: 1, backoffMaxMs: 8 }));
  const h = api.WaygateWebGL_Create(opts);
  window.WebSocket = RealWS;
  check(h >= 1, "create");
  check(api.WaygateWebGL_Connect(h) === 0, "connect");
  let ws = WS.all.at(-1);
  await ws.open();
  ws.take();
  ws.deliver(welcome(0));
  const first = drain(h);
  check(first.some((e) => e.kind === "connected" && e.outcome === "new_session"), "connected new_session");
  check(api.WaygateWebGL_State(h) === 2, "state connected");
  const [p, len] = m.bytes("hello");
  check(api.WaygateWebGL_Send(h, 1, 1000, p, len) === 0, "send");
  check(ws.take().some((f) => f.type === "data" && f.seq === 1n && f.msgId === 1000), "DATA on the wire");
  ws.deliver(data(1, 2001, "héllo ☃"));
  const msg = poll(h);
  const bytes = Uint8Array.from(atob(msg.payload), (c) => c.charCodeAt(0));
  check(msg.kind === "message" && new TextDecoder().decode(bytes) === "héllo ☃", "message payload (base64 via btoa)");
  // Resume: the HELLO carries a proof computed with the browser's WebCrypto.
  api.WaygateWebGL_DropLink(h);
  check(api.WaygateWebGL_State(h) === 3, "state reconnecting");
  await sleep(10);
  ws = WS.all.at(-1);
  await ws.open();
  const [hello] = ws.take();
  check(hello?.resume?.proof?.length === 32 && hello.resume.nonce === 1n, "resume proof from crypto.subtle");
  ws.deliver(welcome(1, { serverSeqBase: 1n, clientSeqAck: 1n }));
  check(drain(h).some((e) => e.kind === "connected" && e.outcome === "restored"), "connected restored");
  // A request and a clock sample (PROTOCOL.md §13): ids at once, outcomes polled.
  ws.take();
  const [bp, blen] = m.bytes("hi");
  const rid = api.WaygateWebGL_Request(h, 1, 1011, bp, blen, 5000);
  const cid = api.WaygateWebGL_SyncClock(h, 1010, 5000);
  const reqs = ws.take().filter((f) => f.type === "data").map(requestOf);
  check(rid > 0 && cid > 0 && reqs.length === 2 && reqs[0].id === rid && reqs[1].id === cid, "request and clock sample sent with their ids");
  ws.deliver(answer(2, rid, 0, "ok"));
  ws.deliver(answer(3, cid, 0, unixMsBody(Date.now() + 60_000)));
  const answers = drain(h);
  check(answers.length === 2 && answers[0].kind === "answer" && answers[0].requestId === rid && atob(answers[0].payload) === "ok", "answer polled");
  const offset = api.WaygateWebGL_ClockOffset(h);
  check(answers[1].requestId === cid && Math.abs(offset - 60_000) < 1000, `clock offset ${offset}`);
  const small = m.malloc(8);
  ws.deliver(data(4, 2001, "x".repeat(100)));
  const need = api.WaygateWebGL_Poll(h, small, 8);
  check(need > 8 && api.WaygateWebGL_Pending(h) === 1, "too-small buffer: the length needed, event kept");
  api.WaygateWebGL_Close(h);
  const end = drain(h);
  check(end.at(-1)?.kind === "closed" && api.WaygateWebGL_State(h) === 4, "closed");
  check(api.WaygateWebGL_Poll(h, buf, bufLen) === -4, "poll after the end: CLOSED");
  api.WaygateWebGL_Free(h);
}

window.bridgeResult = new Promise((resolve) => {
  run()
    .then(() => resolve({ checks }))
    .catch((e) => resolve({ checks, error: String(e && e.stack ? e.stack : e) }));
});
window.bridgeResult.then((r) => {
  document.getElementById("log").textContent = JSON.stringify(r, null, 1);
});
