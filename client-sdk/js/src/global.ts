// The browser global: `import "@waygate/client/global"` (or a
// `<script type="module" src=".../dist/global.js">`) puts the whole SDK on
// `globalThis.Waygate` for code that cannot import ES modules: a Unity WebGL build's .jslib
// (client-sdk/unity-webgl), classic scripts, the console. It then dispatches a `waygate:ready`
// event on globalThis (where `dispatchEvent` exists). Nothing else here has side effects.
import * as Waygate from "./index.js";

declare global {
  // eslint-disable-next-line no-var
  var Waygate: typeof import("./index.js");
}

globalThis.Waygate = Waygate;
const g = globalThis as { dispatchEvent?: (e: Event) => boolean };
if (typeof g.dispatchEvent === "function" && typeof Event === "function") g.dispatchEvent(new Event("waygate:ready"));

export { Waygate };
