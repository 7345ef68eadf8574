#!/usr/bin/env node
// The Unity WebGL bridge (client-sdk/unity-webgl/Plugins/WaygateWebGL.jslib) in headless
// Chromium (Debian's /usr/bin/chromium through playwright-core, or $CHROMIUM): no edge and no
// Unity needed. Serves client-sdk/ on 127.0.0.1 (a secure context, so WebCrypto resumes
// work), opens browser-test/webgl-bridge.html and prints the page's checks.
//
//   npm run build && node browser-test/webgl-bridge.mjs      (npm run test:webgl-browser)
//
// Exit status 0 when every check passed.
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, extname, join, normalize, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const sdkRoot = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";
const TYPES = { ".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".map": "application/json", ".jslib": "text/plain" };

const hardTimer = setTimeout(() => {
  console.error("timed out after 60 s");
  process.exit(1);
}, 60_000);
hardTimer.unref();

const server = createServer((req, res) => {
  const path = normalize(decodeURIComponent(new URL(req.url, "http://x").pathname));
  const file = join(sdkRoot, path);
  if (req.method !== "GET" || !file.startsWith(sdkRoot + sep) || file.includes(`${sep}node_modules${sep}`)) {
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

let context = null;
let profile = null;
let status = 1;
try {
  statSync(chromiumPath);
  statSync(join(sdkRoot, "js/dist/global.js"));
  const port = await new Promise((ok) => server.listen(0, "127.0.0.1", () => ok(server.address().port)));
  profile = mkdtempSync(join(tmpdir(), "waygate-chromium-"));
  context = await chromium.launchPersistentContext(profile, {
    executablePath: chromiumPath,
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"],
  });
  const page = context.pages()[0] ?? (await context.newPage());
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  page.on("console", (m) => process.stderr.write(`[page ${m.type()}] ${m.text()}\n`));
  await page.goto(`http://127.0.0.1:${port}/js/browser-test/webgl-bridge.html`);
  await page.waitForFunction(() => window.bridgeResult !== undefined, null, { timeout: 20_000 });
  const result = await page.evaluate(() => window.bridgeResult);
  const version = context.browser()?.version() ?? "chromium";
  for (const c of result.checks) console.log(`${c.ok ? "ok" : "FAILED"} - ${c.what}`);
  if (result.error) console.log(`error: ${result.error}`);
  for (const e of pageErrors) console.log(`page error: ${e}`);
  const ok = !result.error && pageErrors.length === 0 && result.checks.length > 0 && result.checks.every((c) => c.ok);
  console.log(`${ok ? "PASS" : "FAIL"}: ${result.checks.filter((c) => c.ok).length}/${result.checks.length} checks in ${version}`);
  status = ok ? 0 : 1;
} catch (e) {
  console.error(`webgl-bridge browser check: ${e && e.stack ? e.stack : e}`);
} finally {
  try {
    await context?.close();
  } catch {}
  server.close();
  if (profile) rmSync(profile, { recursive: true, force: true });
}
process.exit(status);
