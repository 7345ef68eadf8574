// Resume proofs (PROTOCOL.md §7.3.1) computed with WebCrypto, against the worked example and
// an independent HMAC (node:crypto).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash, createHmac } from "node:crypto";
import { resumeKey, resumeProof, resumeProofSupported } from "../dist/index.js";

const hex = (b) => Buffer.from(b).toString("hex");
const bytes = (h) => new Uint8Array(Buffer.from(h, "hex"));

test("resume proof: the worked example of §7.3.1", async () => {
  assert.equal(resumeProofSupported(), true);
  const token = bytes("000102030405060708090a0b0c0d0e0f");
  const sessionId = new Uint8Array(16).fill(0xaa);
  assert.equal(hex(await resumeKey(token)), "be45cb2605bf36bebde684841a28f0fd43c69850a3dce5fedba69928ee3a8991");
  const proof = await resumeProof(token, sessionId, 5n, 1n);
  assert.ok(proof instanceof Uint8Array);
  assert.equal(hex(proof), "386d72d0e86dcf50295e6f74a1e8accf1f603b302a5b5f7e84e2e3cb641f721a");
});

test("resume proof: message layout (u64 big-endian seq and nonce) matches node:crypto", async () => {
  const max = (1n << 64n) - 1n;
  const cases = [
    [0n, 1n],
    [300n, 2n],
    [1n << 40n, 1_700_000_000_000n],
    [max, max],
  ];
  const token = bytes("f0e1d2c3b4a5968778695a4b3c2d1e0f");
  const sessionId = bytes("00112233445566778899aabbccddeeff");
  for (const [seq, nonce] of cases) {
    const msg = Buffer.alloc(17 + 16 + 16);
    msg.write("waygate resume v1", 0, "ascii");
    Buffer.from(sessionId).copy(msg, 17);
    msg.writeBigUInt64BE(seq, 33);
    msg.writeBigUInt64BE(nonce, 41);
    const key = createHash("sha256").update(token).digest();
    const want = createHmac("sha256", key).update(msg).digest("hex");
    assert.equal(hex(await resumeProof(token, sessionId, seq, nonce)), want, `seq ${seq}, nonce ${nonce}`);
  }
});

test("resume proof: refuses bad lengths and values", async () => {
  const t = new Uint8Array(16);
  await assert.rejects(resumeProof(new Uint8Array(15), t, 0n, 1n), RangeError);
  await assert.rejects(resumeProof(t, new Uint8Array(17), 0n, 1n), RangeError);
  await assert.rejects(resumeProof(t, t, -1n, 1n), RangeError);
  await assert.rejects(resumeProof(t, t, 0n, 1n << 64n), RangeError);
});
