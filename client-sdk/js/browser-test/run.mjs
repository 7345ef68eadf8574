#!/usr/bin/env node
// Drives headless Chromium (Debian's /usr/bin/chromium through playwright-core; never a
// downloaded browser) through browser-test/page.html against a running edge.
//
//   node browser-test/run.mjs --ws ws://127.0.0.1:P/ --token <base64url> --player NAME
//
// It serves the package folder (dist/ + test page) on 127.0.0.1 with node's http module,
// starts the scenario, and prints JSON lines on stdout for the controlling test:
//   {"event":"progress", ...}   every 50 ms (the test drops the link from the server side)
//   {"event":"stream_done"}     everything received, the channel step (CHANNEL_JOIN + CHAT
//                               on `world`) done or given up after --channel-wait-ms, an
//                               RTT sample taken, nothing unacked: the test kicks
//   {"event":"result", ...}     the page's full record; exit 0 (1 on a harness failure)
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, extname, join, normalize, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []),
);
const need = (k) => {
  if (!args[k]) fail(`missing --${k}`);
  return args[k];
};
const cfg = {
  url: need("ws"),
  token: need("token"),
  player: need("player"),
  room: args.room ?? `room-${need("player")}`,
  echoCount: Number(args["echo-count"] ?? 200),
  sayCount: Number(args["say-count"] ?? 100),
  intervalMs: Number(args["interval-ms"] ?? 20),
};
const timeoutMs = Number(args["timeout-ms"] ?? 90_000);
const kickWaitMs = Number(args["kick-wait-ms"] ?? 10_000);
// How long the channel step may take once the stream is in; past it the result's `channel`
// record says what was missing.
const channelWaitMs = Number(args["channel-wait-ms"] ?? 15_000);
const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";

const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
let browser = null;
let server = null;
let profile = null;

async function cleanup() {
  try {
    await browser?.close();
  } catch {}
  server?.close();
  if (profile) rmSync(profile, { recursive: true, force: true });
}

function fail(message) {
  out({ event: "result", ok: false, error: message });
  cleanup().finally(() => process.exit(1));
  throw new Error(message);
}

const hardTimer = setTimeout(() => fail(`timed out after ${timeoutMs} ms`), timeoutMs);
hardTimer.unref();

const TYPES = { ".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".map": "application/json", ".css": "text/css" };

function serve() {
  return new Promise((ok) => {
    server = createServer((req, res) => {
      const path = normalize(decodeURIComponent(new URL(req.url, "http://x").pathname));
      const file = join(root, path);
      if (req.method !== "GET" || !(file === root || file.startsWith(root + sep)) || file.includes(`${sep}node_modules${sep}`)) {
        res.writeHead(404).end();
        return;
      }
      try {
        if (!statSync(file).isFile()) throw new Error("not a file");
        res.writeHead(200, { "content-type": TYPES[extname(file)] ?? "application/octet-stream", "cache-control": "no-store" });
        res.end(readFileSync(file));
      } catch {
        res.writeHead(404).end();
      }
    });
    server.listen(0, "127.0.0.1", () => ok(server.address().port));
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  try {
    statSync(chromiumPath);
  } catch {
    fail(`${chromiumPath} not found: install Debian's chromium (apt-get install chromium) or set CHROMIUM`);
  }
  try {
    statSync(join(root, "dist/index.js"));
  } catch {
    fail("dist/index.js missing: run `npm run build` first");
  }
  const port = await serve();
  profile = mkdtempSync(join(tmpdir(), "waygate-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: chromiumPath,
    headless: true,
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--no-first-run",
    ],
  });
  browser = context;
  const page = context.pages()[0] ?? (await context.newPage());
  const pageErrors = [];
  page.on("console", (m) => process.stderr.write(`[page ${m.type()}] ${m.text()}\n`));
  page.on("pageerror", (e) => {
    pageErrors.push(String(e));
    process.stderr.write(`[page error] ${e}\n`);
  });
  await page.goto(`http://127.0.0.1:${port}/browser-test/page.html`);
  await page.waitForFunction(() => window.scenarioReady === true, null, { timeout: 10_000 });
  await page.evaluate((c) => window.startScenario(c), cfg);

  // Stream until every reply and room event arrived (the test drops the link meanwhile),
  // the channel step after it finished, and one PONG gave an RTT sample.
  let streamInAt = null;
  for (;;) {
    const st = await page.evaluate(() => window.scenarioState());
    out({ event: "progress", ...st });
    if (pageErrors.length) fail(`page error: ${pageErrors[0]}`);
    if (st.events.closed > 0) break;
    const streamIn = st.echo >= cfg.echoCount && st.room >= cfg.sayCount;
    if (streamIn && streamInAt === null) streamInAt = Date.now();
    const channelSettled = st.channelDone || (streamInAt !== null && Date.now() - streamInAt > channelWaitMs);
    if (streamIn && channelSettled && st.rttSamples > 0 && st.unacked === 0) break;
    await sleep(50);
  }
  out({ event: "stream_done" });

  // The test kicks the player now: the client must end for good, without reconnecting.
  const kickDeadline = Date.now() + kickWaitMs;
  for (;;) {
    const st = await page.evaluate(() => window.scenarioState());
    if (st.events.closed > 0 || Date.now() > kickDeadline) break;
    await sleep(50);
  }
  await sleep(1500); // A reconnect loop would show up as more connects.
  const result = await page.evaluate(() => window.scenarioResult());

  // The demo page, clicked through like a person would (with its own player's token).
  let demo = null;
  if (args["demo-token"]) {
    const dp = await context.newPage();
    dp.on("pageerror", (e) => pageErrors.push(`demo: ${e}`));
    await dp.goto(`http://127.0.0.1:${port}/demo/index.html`);
    await dp.fill("#url", cfg.url);
    await dp.fill("#token", args["demo-token"]);
    await dp.click("#connect");
    const seen = async (needle) => {
      await dp.waitForFunction((n) => document.getElementById("log").textContent.includes(n), needle, { timeout: 10_000 });
    };
    await seen("connected to");
    await dp.click("#send-echo");
    await seen("<- ECHO_REPLY");
    await dp.click("#join");
    await seen("<- JOINED");
    await dp.click("#send-say");
    await seen("<- ROOM_EVENT");
    demo = await dp.evaluate(() => document.getElementById("log").textContent);
    await dp.close();
  }
  out({ event: "result", ok: pageErrors.length === 0, pageErrors, demo, ...result });
  await cleanup();
  process.exit(0);
}

main().catch((e) => fail(`driver: ${e && e.stack ? e.stack : e}`));
