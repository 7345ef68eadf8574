// A minimal stand-in for what Emscripten does with a .jslib, to test the Unity WebGL bridge
// (client-sdk/unity-webgl/Plugins/WaygateWebGL.jslib) at its JS boundary without Unity:
//
// - evaluates the .jslib source with `mergeInto` and `LibraryManager.library`;
// - "links" it like Emscripten's jsifier: every library item is stringified into one
//   module's code (`$name` items become `name`, functions `_name`), so a function that
//   closed over something in the .jslib file fails here as it would in a build;
// - checks that every `$` helper a function uses is among its `__deps` (Emscripten leaves
//   out what is not listed);
// - runs that code against a heap (an ArrayBuffer as `HEAPU8`), `_malloc` / `_free` (a bump
//   allocator that checks frees), `UTF8ToString`, `stringToUTF8` and `lengthBytesUTF8`.
//
// No node-specific API: used by node tests and by a Chromium page alike.

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/**
 * Loads the .jslib `source`. Returns `{ api, library, heap, cstr, bytes, read, readText,
 * malloc, free, live }`: `api` holds the exported functions by their C name
 * (`api.WaygateWebGL_Create(...)`).
 */
export function loadJslib(source, { heapBytes = 1 << 22 } = {}) {
  const library = {};
  const LibraryManager = { library };
  const mergeInto = (target, items) => Object.assign(target, items);
  // Emscripten evaluates library files with these in scope (and more we do not offer).
  new Function("mergeInto", "LibraryManager", source)(mergeInto, LibraryManager);

  const items = Object.keys(library).filter((k) => !k.includes("__"));
  const helpers = items.filter((k) => k.startsWith("$"));
  for (const k of items) {
    const value = library[k];
    const body = typeof value === "function" ? value.toString() : JSON.stringify(value);
    const deps = library[`${k}__deps`] ?? [];
    for (const h of helpers) {
      if (h === k) continue;
      const used = new RegExp(`\\b${h.slice(1)}\\b`).test(body);
      if (used && !deps.includes(h)) throw new Error(`${k} uses ${h.slice(1)} but does not list ${h} in ${k}__deps`);
    }
    for (const d of deps) {
      if (!(d in library)) throw new Error(`${k}__deps lists ${d}, which the library does not define`);
    }
    if (typeof value === "function" && !/^function\b/.test(body)) {
      throw new Error(`${k} must be written \`${k}: function (...) {...}\` (Emscripten stringifies it): ${body.slice(0, 60)}`);
    }
  }

  let code = "";
  for (const k of helpers) {
    const v = library[k];
    code += `var ${k.slice(1)} = ${typeof v === "function" ? v.toString() : JSON.stringify(v)};\n`;
  }
  const exported = items.filter((k) => !k.startsWith("$"));
  for (const k of exported) code += `var _${k} = ${library[k].toString()};\n`;
  code += `return { ${exported.map((k) => `${k}: _${k}`).join(", ")} };`;

  const heap = new ArrayBuffer(heapBytes);
  const HEAPU8 = new Uint8Array(heap);
  let top = 8; // 0 stays NULL
  const live = new Map(); // ptr -> size
  const _malloc = (n) => {
    const ptr = (top + 7) & ~7;
    if (ptr + n > heapBytes) throw new Error("mock heap exhausted");
    top = ptr + Math.max(n, 1);
    live.set(ptr, n);
    return ptr;
  };
  const _free = (ptr) => {
    if (ptr === 0) return;
    if (!live.delete(ptr)) throw new Error(`free of ${ptr}, which is not allocated`);
  };
  const UTF8ToString = (ptr) => {
    let end = ptr;
    while (HEAPU8[end] !== 0) end++;
    return decoder.decode(HEAPU8.subarray(ptr, end));
  };
  const lengthBytesUTF8 = (s) => encoder.encode(s).length;
  const stringToUTF8 = (s, ptr, max) => {
    if (!(max > 0)) return 0;
    const b = encoder.encode(s);
    if (b.length > max - 1) throw new Error("stringToUTF8 would truncate: the bridge must check the size first");
    HEAPU8.set(b, ptr);
    HEAPU8[ptr + b.length] = 0;
    return b.length;
  };
  const api = new Function("HEAPU8", "UTF8ToString", "stringToUTF8", "lengthBytesUTF8", "_malloc", "_free", code)(
    HEAPU8,
    UTF8ToString,
    stringToUTF8,
    lengthBytesUTF8,
    _malloc,
    _free,
  );

  /** A NUL-terminated UTF-8 copy of `s` on the heap (as IL2CPP passes a C# string). */
  const cstr = (s) => {
    const b = encoder.encode(s);
    const p = _malloc(b.length + 1);
    HEAPU8.set(b, p);
    HEAPU8[p + b.length] = 0;
    return p;
  };
  /** A copy of `bytes` on the heap: [ptr, len]. */
  const bytes = (b) => {
    const u = typeof b === "string" ? encoder.encode(b) : b;
    const p = _malloc(u.length);
    HEAPU8.set(u, p);
    return [p, u.length];
  };
  const read = (ptr, n) => HEAPU8.slice(ptr, ptr + n);
  const readText = (ptr, n) => decoder.decode(HEAPU8.subarray(ptr, ptr + n));
  return { api, library, HEAPU8, cstr, bytes, read, readText, malloc: _malloc, free: _free, live };
}
