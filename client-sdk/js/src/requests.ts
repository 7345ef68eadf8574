// Requests and answers (PROTOCOL.md §13), and the game server's clock offset: the codec of
// the convention, the table of requests waiting for their answer, and the clock filter.
// The JS counterpart of the Rust SDK's requests.rs and clock.rs; WaygateClient drives them
// (`request`, `startRequest`, `syncClock`, `startSyncClock`).
//
// A request is a sequenced DATA whose payload starts with a request id (u32 big-endian, not
// 0, not reused while that request waits); its answer is a critical DATA with msg id
// ANSWER_MSG_ID whose payload is the id, a status (u16 big-endian: 0 success, else the game
// server's own code) and the answer's body. Every request leaves the table exactly once,
// with one outcome: its answer, or a RequestError.

import type { TrafficClass } from "./codec.js";

/** The msg id of an answer (PROTOCOL.md §13; reserved downstream, §3.4). Answers are never `message` events. */
export const ANSWER_MSG_ID = 0xffffff02;

/** Clock samples the estimate is chosen from (the last ones). */
export const CLOCK_SAMPLES_KEPT = 8;

/** The largest request id this SDK uses (ids wrap to 1 after it; a C# `int` holds every id). */
export const MAX_REQUEST_ID = 0x7fff_ffff;

/** The default request timeout, ms. */
export const DEFAULT_REQUEST_TIMEOUT_MS = 10_000;

/**
 * Why a request has no answer ({@link RequestError.reason}), by the same names as the C ABI's
 * `WAYGATE_EVENT_REQUEST_FAILED` text:
 * - `timeout`: no answer within the request's timeout (a later answer is dropped);
 * - `refused`: the edge or the game server refused it (an ERROR for its client seq:
 *   `code`, `label`, `retryAfterMs`);
 * - `expired`: queued while no session was up for longer than `maxOfflineAgeMs`: never sent;
 * - `session_lost`: the session it was sent in was replaced by a new one (outcome
 *   `new_session` after an earlier session, or `restore_failed_new_session`): it may or may
 *   not have reached the game server;
 * - `closed`: the client ended (or was closed) first;
 * - `bad_answer`: a clock sample whose answer is not status 0 with 8 bytes of Unix ms;
 * - not sent at all: `not_sequenced` (a best-effort class), `buffer_full` (too many
 *   unacked messages: retry later), `too_large` (above the max frame size).
 */
export type RequestErrorReason =
  | "timeout"
  | "refused"
  | "expired"
  | "session_lost"
  | "closed"
  | "bad_answer"
  | "not_sequenced"
  | "buffer_full"
  | "too_large";

/** A request without an answer: see {@link RequestErrorReason}. */
export class RequestError extends Error {
  /** Why. */
  readonly reason: RequestErrorReason;
  /** The request's id; null when it was not sent (`not_sequenced`, `buffer_full`, `too_large`, `closed` at start). */
  readonly requestId: number | null;
  /** `refused`: the ERROR's code (402 busy, 404 no_route, or the game server's refusal code); else null. */
  readonly code: number | null;
  /** `refused`: the code's name (`busy`, `no_route`, ...); else null. */
  readonly label: string | null;
  /** `refused`: the ERROR's retry hint, ms (0: none); else 0. */
  readonly retryAfterMs: number;
  constructor(
    reason: RequestErrorReason,
    message: string,
    details: { requestId?: number | null; code?: number | null; label?: string | null; retryAfterMs?: number } = {},
  ) {
    super(message);
    this.name = "RequestError";
    this.reason = reason;
    this.requestId = details.requestId ?? null;
    this.code = details.code ?? null;
    this.label = details.label ?? null;
    this.retryAfterMs = details.retryAfterMs ?? 0;
  }
}

/** A game server's answer. */
export interface RequestAnswer {
  /** 0 for success, else the game server's own code. */
  status: number;
  /** The answer's body. */
  body: Uint8Array;
}

/** How to send a request. */
export interface RequestOptions {
  /** `critical` or `normal` (default); `bestEffort` is refused (`not_sequenced`). */
  cls?: TrafficClass;
  /** Fail with `timeout` after this long without an answer, ms. Default 10000. */
  timeoutMs?: number;
}

/**
 * The game server's clock as seen from here: server time = `Date.now() + offsetMs`, within
 * `rttMs / 2` (the round trip of the sample it rests on).
 */
export interface ClockEstimate {
  /** Server clock minus local clock (`Date.now()`), ms. */
  offsetMs: number;
  /** Round trip of the sample chosen, ms. */
  rttMs: number;
  /** Samples taken so far. */
  samples: number;
}

/** A request's payload: the id (u32 big-endian) in front of the body. */
export function encodeRequest(id: number, body: Uint8Array): Uint8Array {
  if (!Number.isInteger(id) || id <= 0 || id > 0xffff_ffff) throw new RangeError(`a request id is a u32 above 0: ${id}`);
  const out = new Uint8Array(4 + body.length);
  new DataView(out.buffer).setUint32(0, id);
  out.set(body, 4);
  return out;
}

/** An answer's payload (id, status, body), or null when it is too short. The body is a view into `payload`. */
export function decodeAnswer(payload: Uint8Array): { id: number; status: number; body: Uint8Array } | null {
  if (payload.length < 6) return null;
  const v = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  return { id: v.getUint32(0), status: v.getUint16(4), body: payload.subarray(6) };
}

/** A clock answer's body: the server's Unix time, ms (u64 big-endian, 8 bytes), or null. */
export function decodeClock(body: Uint8Array): number | null {
  if (body.length !== 8) return null;
  const v = new DataView(body.buffer, body.byteOffset, body.byteLength);
  return Number(v.getBigUint64(0));
}

/**
 * Keeps the recent clock samples and chooses the estimate: the sample with the smallest
 * round trip among the last {@link CLOCK_SAMPLES_KEPT} (queueing only ever adds delay, so
 * the fastest exchange is the least distorted; NTP's clock filter).
 */
export class ClockSync {
  private readonly recent: { rttMs: number; offsetMs: number }[] = [];
  private samples = 0;

  /**
   * Adds a sample: sent at local Unix ms `sentUnixMs`, answered with `serverUnixMs`, after a
   * round trip of `rttMs`. The offset is `T - (t0 + rtt / 2)`. Returns the new estimate.
   */
  observe(sentUnixMs: number, rttMs: number, serverUnixMs: number): ClockEstimate {
    const rtt = Math.max(0, rttMs);
    const offsetMs = serverUnixMs - (sentUnixMs + rtt / 2);
    if (this.recent.length === CLOCK_SAMPLES_KEPT) this.recent.shift();
    this.recent.push({ rttMs: rtt, offsetMs });
    this.samples++;
    return this.estimate() as ClockEstimate;
  }

  /** The current estimate; null before the first sample. */
  estimate(): ClockEstimate | null {
    let best: { rttMs: number; offsetMs: number } | null = null;
    for (const s of this.recent) if (best === null || s.rttMs < best.rttMs) best = s;
    return best === null ? null : { offsetMs: best.offsetMs, rttMs: best.rttMs, samples: this.samples };
  }
}

/** One request waiting for its outcome (internal). */
export interface PendingRequest<R> {
  id: number;
  /** The client seq its DATA has (renumbered when earlier offline messages expire). */
  seq: bigint;
  /** The timeout timer (cleared with the outcome). */
  timer: ReturnType<typeof setTimeout> | null;
  /** A clock sample: local `Date.now()` and monotonic time when sent. */
  clock: { sentUnixMs: number; sentAt: number } | null;
  /** Where the outcome goes. */
  reply: R;
}

/** The requests waiting for their answer, by id and by client seq (internal). */
export class RequestTable<R> {
  private readonly byId = new Map<number, PendingRequest<R>>();
  private idBySeq = new Map<bigint, number>();
  private next = 1;

  /** A request id not in use, 1..MAX_REQUEST_ID. */
  nextId(): number {
    for (let i = 0; i <= this.byId.size; i++) {
      const id = this.next;
      this.next = id >= MAX_REQUEST_ID ? 1 : id + 1;
      if (!this.byId.has(id)) return id;
    }
    throw new Error("no free request id");
  }

  insert(p: PendingRequest<R>): void {
    this.byId.set(p.id, p);
    this.idBySeq.set(p.seq, p.id);
  }

  /** Removes request `id` (an answer, a timeout); undefined when it is not waiting. */
  remove(id: number): PendingRequest<R> | undefined {
    const p = this.byId.get(id);
    if (p === undefined) return undefined;
    this.byId.delete(id);
    if (this.idBySeq.get(p.seq) === id) this.idBySeq.delete(p.seq);
    return p;
  }

  /** Removes the request sent as client seq `seq` (an ERROR for it), if any. */
  removeBySeq(seq: bigint): PendingRequest<R> | undefined {
    const id = this.idBySeq.get(seq);
    return id === undefined ? undefined : this.remove(id);
  }

  /**
   * The never-sent messages with these client seqs (as numbered before) were dropped and
   * every later one moved down by the number dropped before it: removes and returns the
   * requests among the dropped, and keeps the others' seqs right.
   */
  onExpired(expired: bigint[]): PendingRequest<R>[] {
    if (expired.length === 0) return [];
    const out: PendingRequest<R>[] = [];
    for (const seq of expired) {
      const p = this.removeBySeq(seq);
      if (p !== undefined) out.push(p);
    }
    const sorted = [...expired].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    const moved = new Map<bigint, number>();
    for (const [seq, id] of this.idBySeq) {
      let below = 0n;
      for (const e of sorted) {
        if (e < seq) below++;
        else break;
      }
      const p = this.byId.get(id);
      const renumbered = seq - below;
      if (p !== undefined) p.seq = renumbered;
      moved.set(renumbered, id);
    }
    this.idBySeq = moved;
    return out;
  }

  /** Removes every request, in seq order (a new session voided them, the client ended). */
  takeAll(): PendingRequest<R>[] {
    const all = [...this.byId.values()].sort((a, b) => (a.seq < b.seq ? -1 : a.seq > b.seq ? 1 : 0));
    this.byId.clear();
    this.idBySeq.clear();
    return all;
  }

  /** Requests waiting. */
  get size(): number {
    return this.byId.size;
  }
}
