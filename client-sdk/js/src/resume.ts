// Proof of possession of a resume token (PROTOCOL.md §7.3.1). A resuming client never sends
// its resume token: its HELLO carries
//
//   proof = HMAC-SHA256(key = SHA-256(resume_token),
//                       "waygate resume v1" || session_id || last_server_seq (u64 BE) || nonce (u64 BE))
//
// computed with WebCrypto (`globalThis.crypto.subtle`), which browsers expose only in a
// secure context (https, or http on localhost).

/** The 17 ASCII bytes that start the proof's message. */
const LABEL = new TextEncoder().encode("waygate resume v1");
const U64_MAX = (1n << 64n) - 1n;

function subtleCrypto(): SubtleCrypto | null {
  const c = (globalThis as { crypto?: Crypto }).crypto;
  return c?.subtle ?? null;
}

/**
 * Whether resume proofs can be computed here: `crypto.subtle` exists (browsers: a secure
 * context, i.e. https or localhost; node 20+).
 */
export function resumeProofSupported(): boolean {
  return subtleCrypto() !== null;
}

function requireSubtle(): SubtleCrypto {
  const s = subtleCrypto();
  if (!s) throw new Error("crypto.subtle is unavailable (not a secure context: use https or localhost)");
  return s;
}

function checkId(b: Uint8Array, what: string): void {
  if (b.length !== 16) throw new RangeError(`${what} is 16 bytes, got ${b.length}`);
}

function checkU64(v: bigint, what: string): void {
  if (v < 0n || v > U64_MAX) throw new RangeError(`${what} must be a u64: ${v}`);
}

function digestToken(resumeToken: Uint8Array): Promise<ArrayBuffer> {
  checkId(resumeToken, "a resume token");
  return requireSubtle().digest("SHA-256", new Uint8Array(resumeToken));
}

/** The resume key SHA-256(resume_token) (§7.3): what the edge stores. */
export async function resumeKey(resumeToken: Uint8Array): Promise<Uint8Array> {
  return new Uint8Array(await digestToken(resumeToken));
}

/**
 * The HELLO resume part's `proof` (32 bytes, §7.3.1) for `sessionId` (16 bytes) held with
 * `resumeToken` (16 bytes), `lastServerSeq` and `nonce` (u64s). Rejects with RangeError on
 * bad lengths or values, and with Error when `crypto.subtle` is unavailable
 * (see {@link resumeProofSupported}).
 */
export async function resumeProof(
  resumeToken: Uint8Array,
  sessionId: Uint8Array,
  lastServerSeq: bigint,
  nonce: bigint,
): Promise<Uint8Array> {
  checkId(sessionId, "a session id");
  checkU64(lastServerSeq, "last_server_seq");
  checkU64(nonce, "nonce");
  const message = new Uint8Array(LABEL.length + 16 + 8 + 8);
  message.set(LABEL, 0);
  message.set(sessionId, LABEL.length);
  const view = new DataView(message.buffer);
  view.setBigUint64(LABEL.length + 16, lastServerSeq, false);
  view.setBigUint64(LABEL.length + 24, nonce, false);
  const subtle = requireSubtle();
  const key = await subtle.importKey("raw", await digestToken(resumeToken), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  return new Uint8Array(await subtle.sign("HMAC", key, message));
}
