// The waygate session client over WebSocket (PROTOCOL.md §2.2, §5, §7): HELLO with token
// and/or resume part (a proof of holding the resume token, never the token itself: §7.3.1;
// computed with WebCrypto, so only in a secure context), WELCOME outcomes, client seqs from
// 1 kept until acked and resent after a restore, cumulative acks (piggybacked, or ACK after
// a delay / every N messages), de-duplication of server seqs, PING/PONG heartbeats with RTT,
// reconnect with exponential backoff and full jitter (the URL that worked tried first),
// REJECT retry-after, MIGRATE, terminal kicked/expired, `reconnectNow()`, `giveUpAfterMs`,
// and the browser's `online` / `visibilitychange` hooks.
// Channel events (§12: DATA of CHANNEL_EVENT_MSG_ID) go through a ChannelTracker and are
// surfaced as `channel` events, never as `message`s.
// Requests (§13: a request id in front of the body, answers as DATA of ANSWER_MSG_ID) wait
// in a RequestTable until their one outcome: the answer, an ERROR for their seq, the
// timeout, an expiry offline, a new session, the end of the client. Answers are never
// `message`s; an ERROR or an expiry that is a request's outcome is not an `error` or
// `expired` event.

import { type ChannelPosition, ChannelTracker, type ChannelUpdate } from "./channels.js";
import {
  CHANNEL_EVENT_MSG_ID,
  RESERVED_MSG_IDS_START,
  CloseCode,
  DEFAULT_MAX_FRAME_SIZE,
  MAX_TOKEN_LEN,
  type Frame,
  type Id,
  PROTOCOL_VERSION,
  ProtocolError,
  type ResumeRequest,
  SUBPROTOCOL,
  type TrafficClass,
  WelcomeOutcome,
  base64UrlDecode,
  closeKeepsSession,
  codeClass,
  codeLabel,
  decodeFrame,
  encodeFrame,
  isSequenced,
  toHex,
} from "./codec.js";
import {
  ANSWER_MSG_ID,
  ClockSync,
  type ClockEstimate,
  DEFAULT_REQUEST_TIMEOUT_MS,
  type PendingRequest,
  type RequestAnswer,
  RequestError,
  type RequestErrorReason,
  type RequestOptions,
  RequestTable,
  decodeAnswer,
  decodeClock,
  encodeRequest,
} from "./requests.js";
import { resumeProof, resumeProofSupported } from "./resume.js";

/** Seqs above the cumulative a receiver accepts (§7.4.1); further ahead is protocol_error. */
export const RECV_WINDOW = 4096n;

/** The subset of the WHATWG WebSocket the client uses (browsers' global by default). */
export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string; wasClean?: boolean }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  send(data: Uint8Array): void;
  close(code?: number, reason?: string): void;
}
export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocketLike;

const WS_OPEN = 1;
/** ERROR answers remembered to drop a repeat (PROTOCOL.md §3.9; the edge repeats at most 256). */
const ERRORED_SEQS_KEPT = 1024;
/** The largest ack a resent DATA frame could carry (the size check counts it). */
const MAX_U64 = 2n ** 64n - 1n;

/** Most doublings of the liveness timeout after links it called dead (8x; PROTOCOL.md §7.5). */
export const LIVENESS_BACKOFF_MAX = 3;
/** A link this long without the liveness rule firing halves the timeout again, ms. */
export const LIVENESS_CALM_MS = 30_000;

/** Client settings. Only `urls` and `token` are required. */
export interface ClientOptions {
  /**
   * Edge WebSocket URLs (`ws://` / `wss://`), tried in order; a failed attempt moves on.
   * Sticky: the URL a WELCOME came from is tried first on the next connect (after a
   * MIGRATE target, which always goes first).
   */
  urls: string | string[];
  /** Auth token from the login service: raw bytes, or its base64url text. May be empty when only resuming. */
  token: Uint8Array | string;
  /** First reconnect delay cap, ms; doubles per failed attempt (full jitter). Default 100. */
  backoffMinMs?: number;
  /** Largest reconnect delay cap, ms. Default 5000. */
  backoffMaxMs?: number;
  /** Time from opening the socket to WELCOME before the attempt fails, ms. Default 10000. */
  handshakeTimeoutMs?: number;
  /** A standalone ACK is sent this long after the first unacknowledged message, ms. Default 20. */
  ackDelayMs?: number;
  /** ...or at once when this many messages are unacknowledged. Default 16. */
  ackEvery?: number;
  /** Most unacked sequenced upstream messages kept for resending; beyond it `send` throws. Default and most 4096 (the edge's window). */
  maxUnacked?: number;
  /**
   * A connection is dead when a sequenced message or a PING has been outstanding this long
   * with no frame received (PROTOCOL.md §7.5): the client drops it and resumes. Default 1000;
   * 0 turns the rule off. Each link the rule calls dead doubles the timeout for the next ones
   * (at most `LIVENESS_BACKOFF_MAX` times); every `LIVENESS_CALM_MS` of a link on which it
   * did not fire halves it again.
   */
  livenessMs?: number;
  /**
   * Give up when no WELCOME has been received for this long, ms, since `connect()` or since
   * the session went down: the client ends with `closed` code 403 (`unavailable`).
   * Default undefined: retry for ever. Rust's `give_up_after`, C's `give_up_after_ms`.
   */
  giveUpAfterMs?: number;
  /**
   * Give up after this many failed connect attempts in a row with no session in between:
   * the client ends with `closed` code 403 (`unavailable`). Default undefined: no cap.
   * Rust's `give_up_after_attempts` (which counts rounds over the URL list; with one URL
   * the same), C's `give_up_after_attempts`.
   */
  giveUpAfterAttempts?: number;
  /**
   * Staleness bound, ms, for sequenced messages queued while no session is up (sent before
   * a WELCOME, never transmitted on any link). When the session comes back by resume
   * (outcome `restored` / `restored_with_gap`) or up for the first time, before sending, every such
   * message older than this (now minus the time `send()` queued it) is dropped and reported
   * with an `expired` event; the messages queued after it are renumbered so the client seqs
   * on the wire stay contiguous. Messages that went out on a link once are never dropped.
   * Default 0: no bound (everything is sent however late). Rust's `max_offline_age`.
   */
  maxOfflineAgeMs?: number;
  /**
   * Browser lifecycle hooks, when `globalThis.addEventListener` exists: `online` reconnects
   * at once unless connected; `visibilitychange` to visible reconnects at once when the link
   * has received nothing for longer than the heartbeat interval (or the client is backing
   * off). Listeners are added by `connect()` and removed when the client closes. Default true.
   */
  lifecycleHooks?: boolean;
  /** Offer the `waygate.v1` subprotocol (§2.2). Default true. */
  offerSubprotocol?: boolean;
  /** WebSocket implementation (tests, node); default `globalThis.WebSocket`. */
  WebSocket?: WebSocketConstructor;
  /** Random source in [0, 1) for the jitter (tests). Default Math.random. */
  random?: () => number;
}

/**
 * How a HELLO was answered: WELCOME's outcome (PROTOCOL.md §7.1.1), by the same names in
 * every SDK.
 * - `new_session`: a fresh session (the first login, or a resume without the resume part).
 * - `restored`: the session resumed with nothing lost.
 * - `restored_with_gap`: the session resumed, but downstream messages were evicted: resync.
 * - `restore_failed_new_session`: the resume was refused and a new session started: resync.
 */
export type SessionOutcome = "new_session" | "restored" | "restored_with_gap" | "restore_failed_new_session";
/** WELCOME outcome codes 0..3 (`WelcomeOutcome`) by name. */
const OUTCOMES: readonly SessionOutcome[] = ["new_session", "restored", "restored_with_gap", "restore_failed_new_session"];
/** @deprecated Use {@link SessionOutcome} (the same type). */
export type Outcome = SessionOutcome;

/**
 * The client's connection state (`client.state`), by the same names in every SDK.
 * - `idle`: created, `connect()` not called yet.
 * - `connecting`: the first session is not up yet (attempts, backoff, handshake).
 * - `connected`: a session is up.
 * - `reconnecting`: a session was up and the link dropped: the client is trying to resume.
 * - `closed`: terminal (`close()`, kicked, session expired, refused, gave up).
 */
export type ConnectionState = "idle" | "connecting" | "connected" | "reconnecting" | "paused" | "closed";

/** A downstream application message. */
export interface Message {
  msgId: number;
  cls: TrafficClass;
  /** Server seq (0n for best-effort). */
  seq: bigint;
  payload: Uint8Array;
}

/** A failed connect attempt (the `connectFailed` event). */
export interface ConnectFailed {
  /** The URL tried. */
  url: string;
  /** Why it failed, for people (logs, a "reconnecting" screen). */
  reason: string;
  /** Failed attempts since the last WELCOME, this one included (1 = the first). */
  attempt: number;
}

/** Payloads of every event. */
export interface ClientEvents {
  /**
   * WELCOME received (any outcome), on every WELCOME; followed by the `expired` events of
   * this resume, if any, then by one of newSession / restored / restoredWithGap.
   */
  connected: { url: string; sessionId: string; outcome: SessionOutcome };
  /**
   * `client.state` changed (emitted before the event that caused it: `connected`,
   * `disconnected`, `closed`).
   */
  stateChange: { from: ConnectionState; to: ConnectionState };
  /**
   * A sequenced message queued while no session was up was dropped on a resume because it
   * was older than `maxOfflineAgeMs`, or above the max frame size the WELCOME announced; it
   * never went out on any link. `seq` is the client seq
   * it had (`send()`'s return value); the messages queued after it were renumbered down.
   */
  expired: { msgId: number; seq: bigint; ageMs: number };
  /** A fresh session: both seq spaces restart at 1. `restoreFailed`: a resume was refused and replaced by a new session (resync!). */
  newSession: { sessionId: string; restoreFailed: boolean; discarded: number };
  /** The session resumed with nothing lost. */
  restored: { sessionId: string; resent: number };
  /** The session resumed, but downstream messages up to `serverSeqBase` were evicted: resync your state. */
  restoredWithGap: { sessionId: string; serverSeqBase: bigint; resent: number };
  /**
   * One connect attempt to `url` failed before its WELCOME (the socket closed or errored
   * before or after opening, an HTTP refusal such as 503 or a 403 origin check, which a
   * browser reports as a close before open; no WELCOME within the handshake timeout; a URL
   * the WebSocket constructor refused; a CLOSE or a protocol violation before WELCOME).
   * Emitted once per failed attempt, before the client moves on to its next URL and backs
   * off (a `disconnected` event with `wasActive: false` follows). Not emitted for a REJECT
   * (an `error` of kind `rejected`) nor for a session that was up and dropped
   * (`disconnected` with `wasActive: true`). `attempt` counts the failed attempts since the
   * last WELCOME (1 = the first), the number the backoff doubles with: this client tries
   * one URL per backoff step. Rust's `Event::ConnectFailed`, C's `WAYGATE_EVENT_CONNECT_FAILED`.
   */
  connectFailed: ConnectFailed;
  /** A link ended (or an attempt failed). `code` is the close code when known. */
  disconnected: {
    code: number | null;
    label: string;
    reason: string;
    /** Whether the link had been welcomed. */
    wasActive: boolean;
    willReconnect: boolean;
    /** Delay before the next attempt, ms (when reconnecting). */
    retryInMs: number;
  };
  /** Another login of the same player took over: terminal, no reconnect. */
  kicked: { code: number; message: string };
  /** The server asks to move: the client reconnects (to `target` when it is a ws/wss URL) and resumes. */
  migrating: { target: string; deadlineMs: number };
  /** A downstream message; each sequenced one exactly once, in seq order. Channel events are not messages: see `channel`. */
  message: Message;
  /**
   * A channel event (PROTOCOL.md §12): a publication, or joined / left / historyLost.
   * Publications already shown are dropped; `channelPositions()` has each channel's last position.
   */
  channel: ChannelUpdate;
  /** Something went wrong; see `kind`. The client keeps going unless a `closed` event follows. */
  error:
    | { kind: "undelivered"; code: number; label: string; msgId: number; clientSeq: bigint; retryAfterMs: number }
    | { kind: "rejected"; code: number; label: string; retryAfterMs: number; message: string }
    | { kind: "protocol"; code: number; message: string };
  /** The client stopped for good (kicked, session expired, auth refused, or `close()`). */
  closed: { code: number; label: string; reason: string };
  /**
   * The answer to a request started with `startRequest` / `startSyncClock` (never for
   * `request` / `syncClock`, whose promise has it). Rust's `Event::Answered`, C's
   * `WAYGATE_EVENT_ANSWER`.
   */
  answer: { requestId: number; status: number; body: Uint8Array };
  /**
   * A request started with `startRequest` / `startSyncClock` has no answer: `reason` as
   * {@link RequestError.reason}; `code`, `label`, `retryAfterMs` when refused (else null,
   * null, 0); `message` for people. Exactly one `answer` or `requestFailed` per started
   * request. C's `WAYGATE_EVENT_REQUEST_FAILED`.
   */
  requestFailed: {
    requestId: number;
    reason: RequestErrorReason;
    code: number | null;
    label: string | null;
    retryAfterMs: number;
    message: string;
  };
}
export type EventName = keyof ClientEvents;
type Listener<K extends EventName> = (ev: ClientEvents[K]) => void;

/** @deprecated Use {@link ConnectionState} (the same type). */
export type ClientState = ConnectionState;

/** Where the session machine is (internal; `state` maps it to a {@link ConnectionState}). */
type Phase = "idle" | "connecting" | "handshaking" | "active" | "waiting" | "closed";

/** Round-trip statistics from the client's PINGs. */
export interface RttStats {
  latestMs: number | null;
  /** RFC 6298 weights: 7/8 old, 1/8 new. */
  smoothedMs: number | null;
  minMs: number | null;
  samples: number;
}

export interface ClientStats {
  state: ConnectionState;
  rtt: RttStats;
  /** Sequenced upstream messages not yet acked by the server. */
  unacked: number;
  /** Highest server seq received with nothing missing below it. */
  lastServerSeq: bigint;
  /** WELCOMEs received. */
  connects: number;
  /** Current session id (hex), if any. */
  sessionId: string | null;
  /** Channel publications dropped as already shown (§12.3). */
  channelDuplicates: number;
  /** Channel event payloads dropped because they could not be decoded. */
  channelUndecodable: number;
  /** The game server's clock offset estimate, once a clock sample was answered (`syncClock`); else null. */
  clock: ClockEstimate | null;
  /** Requests waiting for their outcome. */
  requestsPending: number;
}

/** Why `send` refused a message ({@link SendError.reason}). */
export type SendErrorReason = "closed" | "buffer_full" | "too_large";

/** `send` refused: the unacked buffer is full, the frame too large, or the client closed. */
export class SendError extends Error {
  /** Why: `closed`, `buffer_full` (too many unacked: send again after acks), `too_large` (above the max frame size). */
  readonly reason: SendErrorReason;
  constructor(message: string, reason: SendErrorReason) {
    super(message);
    this.name = "SendError";
    this.reason = reason;
  }
}

/** Where a request's outcome goes: a waiting promise, or the `answer` / `requestFailed` events. */
type RequestReply =
  | { kind: "caller"; resolve: (v: RequestAnswer | ClockEstimate) => void; reject: (e: RequestError) => void }
  | { kind: "event" };

interface Unacked {
  seq: bigint;
  cls: TrafficClass;
  msgId: number;
  payload: Uint8Array;
  /** `now()` when `send()` queued it (for `maxOfflineAgeMs`). */
  queuedAt: number;
  /** Handed to a link at least once (the server may have it): never expired nor renumbered. */
  transmitted: boolean;
}

interface Session {
  id: Id;
  /** The resume token: kept secret, only proven (§7.3.1). */
  token: Id;
  /** Nonce of the last resume HELLO of this session (§7.3.1): 1, 2, 3, ...; 0 before the first. */
  nonce: bigint;
}

function sameId(a: Id, b: Id): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

// Codes after which the client must not reconnect on its own.
const TERMINAL_REJECTS = new Set<number>([
  CloseCode.auth_malformed,
  CloseCode.auth_bad_signature,
  CloseCode.auth_expired,
  CloseCode.auth_unknown_key,
  CloseCode.auth_unsupported_version,
  CloseCode.auth_rejected,
  CloseCode.unsupported_version,
]);

const encoder = new TextEncoder();

/** The WebSocket status of a close the server started (§2.2), mapped back to a close code. */
function codeFromWsStatus(status: number): number | null {
  switch (status) {
    case 1000:
      return CloseCode.normal;
    case 1001:
      return CloseCode.going_away;
    case 1002:
      return CloseCode.protocol_error;
    case 1003:
      return CloseCode.text_message;
    case 1009:
      return CloseCode.frame_too_large;
  }
  if (status >= 4000 && status < 5000) return status - 4000;
  return null;
}

/** An auth token as bytes; a `RangeError` if no HELLO can carry it (§1: at most 4,096 bytes). */
function checkedToken(token: Uint8Array | string): Uint8Array {
  const bytes = typeof token === "string" ? base64UrlDecode(token) : token;
  if (bytes.length > MAX_TOKEN_LEN) {
    throw new RangeError(`auth token of ${bytes.length} bytes: at most ${MAX_TOKEN_LEN} fit a HELLO`);
  }
  return bytes;
}

/**
 * A waygate session over WebSocket. Create it, subscribe with `on`, call `connect()`, then
 * `send()`; it reconnects and resumes by itself until `close()` or a terminal event.
 */
export class WaygateClient {
  private readonly urls: string[];
  private token: Uint8Array;
  private readonly opts: Required<Omit<ClientOptions, "urls" | "token" | "WebSocket" | "giveUpAfterMs" | "giveUpAfterAttempts">>;
  private readonly giveUpAfterAttempts: number | undefined;
  private readonly giveUpAfterMs: number | undefined;
  private readonly WS: WebSocketConstructor;
  private readonly listeners = new Map<EventName, Set<Listener<EventName>>>();

  private _state: Phase = "idle";
  /** The state last reported by `stateChange`. */
  private reported: ConnectionState = "idle";
  private ws: WebSocketLike | null = null;
  /** Bumped for every socket: events of older sockets are ignored. */
  private gen = 0;
  private url = "";
  private urlIndex = 0;
  private migrateTo: string | null = null;
  private failures = 0;
  private connects = 0;
  /** When the last WELCOME came (ms, `now()`), and how many links in a row died within
   * {@link QUICK_LOSS_MS} of theirs (each such loss backs off). */
  private welcomedAt = 0;
  private quickLosses = 0;
  /** The auth token expired: resume with the resume part alone (§7.1.1). */
  private resumeOnly = false;
  /** Bumped by `setToken`; `helloTokenEpoch` is its value when the last HELLO went out. */
  private tokenEpoch = 0;
  private helloTokenEpoch = 0;
  /** The socket is open but its HELLO not yet sent (the resume proof is computed): nothing else goes out. */
  private helloPending = false;
  /** The "cannot resume without crypto.subtle" warning was logged. */
  private warnedNoResume = false;

  private session: Session | null = null;
  private heartbeatMs = 10_000;
  private idleTimeoutMs = 30_000;
  private maxFrameSize = DEFAULT_MAX_FRAME_SIZE;
  /** The last WELCOME's max frame size (what the edge may send). */
  private serverMaxFrameSize = DEFAULT_MAX_FRAME_SIZE;

  // Downstream: cumulative C and the seqs received above it (§7.4.1); ack state (§7.4.2).
  private cum = 0n;
  private above = new Set<bigint>();
  private ackSent = 0n;
  private ackOwed = false;
  private unackedDown = 0;
  private ackTimer: ReturnType<typeof setTimeout> | null = null;

  // Upstream: next seq and everything sent but not acked.
  private nextSeq = 1n;
  private unacked: Unacked[] = [];
  /** Client seqs already answered by an ERROR (insertion order, the latest ERRORED_SEQS_KEPT). */
  private errored = new Set<bigint>();

  // Channels (§12): positions and the duplicate filter. Kept across sessions: after a new
  // session the positions are what the game hands its backend to recover (§12.4).
  private readonly channels = new ChannelTracker();

  // Requests (§13) waiting for their outcome, and the server clock samples.
  private readonly requests = new RequestTable<RequestReply>();
  private readonly clockSync = new ClockSync();

  private lastTx = 0;
  private lastRx = 0;
  /** Since when something has been outstanding with no frame received (liveness). */
  private waitingSince: number | null = null;
  /** The liveness timeout ran out at the last tick: the link is called dead at the next one
   * unless a frame arrives in between (input that queued while this page or process was
   * stalled is read before the verdict). */
  private livenessSuspect = false;
  /** Doublings of the liveness timeout in force (links called dead lately). */
  private livenessBackoff = 0;
  /** Since when the rule has not fired on the current link (WELCOME, each step down). */
  private calmSince: number | null = null;
  private ticker: ReturnType<typeof setInterval> | null = null;
  private handshakeTimer: ReturnType<typeof setTimeout> | null = null;
  private reconnectTimer: ReturnType<typeof setTimeout> | null = null;
  /** Armed while no session is up (giveUpAfterMs); cleared by a WELCOME. */
  private giveUpTimer: ReturnType<typeof setTimeout> | null = null;
  /** Paused by the application: no socket until reconnectNow(). */
  private paused = false;
  /** Removes the lifecycle listeners (set while they are installed). */
  private unhook: (() => void) | null = null;
  private readonly epoch = now();
  private readonly rtt: RttStats = { latestMs: null, smoothedMs: null, minMs: null, samples: 0 };

  constructor(options: ClientOptions) {
    this.urls = Array.isArray(options.urls) ? [...options.urls] : [options.urls];
    if (this.urls.length === 0) throw new TypeError("at least one URL is required");
    for (const u of this.urls) {
      if (!/^wss?:\/\//i.test(u)) throw new TypeError(`not a ws:// or wss:// URL: ${u}`);
    }
    this.token = checkedToken(options.token);
    const WS = options.WebSocket ?? (globalThis as { WebSocket?: WebSocketConstructor }).WebSocket;
    if (!WS) throw new TypeError("no WebSocket implementation: pass options.WebSocket");
    this.WS = WS;
    this.opts = {
      backoffMinMs: options.backoffMinMs ?? 100,
      backoffMaxMs: options.backoffMaxMs ?? 5000,
      handshakeTimeoutMs: options.handshakeTimeoutMs ?? 10_000,
      ackDelayMs: options.ackDelayMs ?? 20,
      ackEvery: options.ackEvery ?? 16,
      // Never beyond the edge's window (§7.4.1): a seq past it closes the link.
      maxUnacked: Math.min(options.maxUnacked ?? 4096, 4096),
      livenessMs: options.livenessMs ?? 1000,
      maxOfflineAgeMs: options.maxOfflineAgeMs ?? 0,
      lifecycleHooks: options.lifecycleHooks ?? true,
      offerSubprotocol: options.offerSubprotocol ?? true,
      random: options.random ?? Math.random,
    };
    const g = options.giveUpAfterMs;
    if (g !== undefined && !(Number.isFinite(g) && g >= 0)) throw new RangeError(`giveUpAfterMs must be a number >= 0: ${g}`);
    this.giveUpAfterMs = g;
    const cap = options.giveUpAfterAttempts;
    if (cap !== undefined && !(Number.isInteger(cap) && cap >= 1)) {
      throw new RangeError(`giveUpAfterAttempts must be an integer >= 1: ${cap}`);
    }
    this.giveUpAfterAttempts = cap;
    const a = this.opts.maxOfflineAgeMs;
    if (!(Number.isFinite(a) && a >= 0)) throw new RangeError(`maxOfflineAgeMs must be a number >= 0: ${a}`);
  }

  // -------------------------------------------------------------------------------------
  // Public API

  /** The connection state: `idle`, `connecting`, `connected`, `reconnecting`, `paused` or `closed`. */
  get state(): ConnectionState {
    if (this.paused && this._state === "waiting") return "paused";
    switch (this._state) {
      case "idle":
        return "idle";
      case "active":
        return "connected";
      case "closed":
        return "closed";
      default:
        // Connecting, handshaking or backing off: before the first session, or after one.
        return this.connects > 0 ? "reconnecting" : "connecting";
    }
  }

  /**
   * The liveness timeout in force, ms: `livenessMs`, doubled for each recent link the rule
   * called dead (an overloaded edge meets a calmer reconnect wave; PROTOCOL.md §7.5).
   */
  get livenessTimeoutMs(): number {
    return this.opts.livenessMs * 2 ** this.livenessBackoff;
  }

  /** Subscribes to an event; returns a function that unsubscribes. */
  on<K extends EventName>(event: K, fn: Listener<K>): () => void {
    let set = this.listeners.get(event);
    if (!set) this.listeners.set(event, (set = new Set()));
    set.add(fn as Listener<EventName>);
    return () => this.off(event, fn);
  }

  off<K extends EventName>(event: K, fn: Listener<K>): void {
    this.listeners.get(event)?.delete(fn as Listener<EventName>);
  }

  /** Starts connecting (no-op unless idle). */
  connect(): void {
    if (this._state !== "idle") return;
    this.installHooks();
    this.armGiveUp();
    this.openSocket();
    this.reportState();
  }

  /**
   * Reconnects now: drops the current link even if it looks alive (a page back from the
   * background often holds a socket the browser never reported dead), forgets the backoff
   * and opens a new socket at once; the session resumes. A `disconnected` event (code
   * `going_away`, `willReconnect: true`) reports the dropped link. No-op before `connect()`
   * and after the client closed. Rust's `reconnect_now`, C's `waygate_client_reconnect_now`.
   */
  reconnectNow(): void {
    if (this._state === "idle" || this._state === "closed") return;
    if (this.paused) {
      this.paused = false;
      this.armGiveUp();
    }
    this.clearReconnect();
    this.failures = 0;
    this.quickLosses = 0;
    if (this._state !== "waiting") {
      const wasActive = this._state === "active";
      const ws = this.ws;
      if (ws && ws.readyState === WS_OPEN) {
        this.transmit({ type: "close", code: CloseCode.going_away, message: "reconnecting" });
      }
      this.dropSocket(1000, "reconnecting");
      this.scheduleReconnect(0, { code: CloseCode.going_away, reason: "reconnect requested", wasActive }, true);
      if ((this._state as Phase) !== "waiting") return; // A listener closed the client (or already reconnected).
    }
    this.openSocket();
  }

  /**
   * Pauses the client (the page or app goes to the background): closes the link with
   * CLOSE `going_away`, so the session lingers on the edge, and opens no socket until
   * {@link reconnectNow} resumes it (the lifecycle hooks do not). Messages sent meanwhile
   * wait (subject to `maxOfflineAgeMs`); the give-up deadline does not run. State `paused`.
   * No-op before `connect()`, after the client closed, or when already paused. Rust's
   * `pause`, C's `waygate_client_pause`.
   */
  pause(): void {
    if (this._state === "idle" || this._state === "closed" || this.paused) return;
    this.paused = true;
    this.clearReconnect();
    this.clearGiveUp();
    const wasActive = this._state === "active";
    const ws = this.ws;
    if (ws && ws.readyState === WS_OPEN) {
      this.transmit({ type: "close", code: CloseCode.going_away, message: "paused" });
    }
    this.dropSocket(1000, "paused");
    this._state = "waiting";
    this.reportState();
    if (this._state !== "waiting") return; // A stateChange listener closed the client.
    this.emit("disconnected", {
      code: CloseCode.going_away,
      label: codeLabel(CloseCode.going_away),
      reason: "paused",
      wasActive,
      willReconnect: false,
      retryInMs: 0,
    });
  }

  /**
   * Replaces the auth token (e.g. refreshed from the login service). Throws `RangeError`
   * for a token over {@link MAX_TOKEN_LEN} bytes (no HELLO can carry it, §1).
   */
  setToken(token: Uint8Array | string): void {
    this.token = checkedToken(token);
    this.resumeOnly = false;
    this.tokenEpoch++;
  }

  /**
   * Sends an application message (`payload`: bytes, or a string sent as UTF-8).
   * Sequenced classes (critical, normal) are kept until the server acks them and are
   * queued while disconnected; returns their client seq. Best-effort is sent only while
   * connected and returns 0n, or null when it was dropped. Throws {@link SendError} when
   * the unacked buffer is full, the frame would exceed the max frame size, or the client is closed.
   */
  send(msgId: number, payload: Uint8Array | ArrayBuffer | string, cls: TrafficClass = "normal"): bigint | null {
    if (this._state === "closed") throw new SendError("the client is closed", "closed");
    if (!Number.isInteger(msgId) || msgId < 0 || msgId >= 2 ** 32) throw new RangeError(`msg_id must be a u32: ${msgId}`);
    const bytes =
      typeof payload === "string" ? encoder.encode(payload) : payload instanceof Uint8Array ? payload : new Uint8Array(payload);
    // Worst case header: type, flags, msg_id (5), seq (10), ack (10).
    if (bytes.length + 27 > this.maxFrameSize) {
      const exact = encodeFrame({ type: "data", cls, msgId, seq: this.nextSeq, ack: this.cum, payload: bytes }).length;
      if (exact > this.maxFrameSize) throw new SendError(`frame of ${exact} bytes above the max frame size ${this.maxFrameSize}`, "too_large");
    }
    const active = this._state === "active";
    if (!isSequenced(cls)) {
      if (!active) return null;
      this.sendData({ cls, msgId, seq: 0n, payload: bytes }, true);
      return 0n;
    }
    if (this.unacked.length >= this.opts.maxUnacked) {
      throw new SendError(`upstream send buffer full (${this.unacked.length} unacked messages)`, "buffer_full");
    }
    const seq = this.nextSeq++;
    const m: Unacked = { seq, cls, msgId, payload: bytes, queuedAt: now(), transmitted: false };
    this.unacked.push(m);
    if (active && this.sendData(m, true)) m.transmitted = true;
    return seq;
  }

  /**
   * Sends a request (PROTOCOL.md §13) to message id `msgId` and waits for its answer: the
   * game server's `{ status, body }` (status 0 or its own error code), or a rejection with a
   * {@link RequestError} saying why there is none (`timeout` after `timeoutMs`, default
   * 10 s; `refused` by an ERROR for its seq; `expired` offline; `session_lost`; `closed`;
   * not sent: `not_sequenced` for `bestEffort`, `buffer_full`, `too_large`). The request is
   * a sequenced DATA (class `normal` by default, or `critical`): queued while disconnected,
   * resent after a resume like any message, answered once. A late answer is dropped.
   */
  request(msgId: number, body: Uint8Array | ArrayBuffer | string = new Uint8Array(0), options: RequestOptions = {}): Promise<RequestAnswer> {
    return new Promise<RequestAnswer>((resolve, reject) => {
      this.beginRequest(msgId, body, options, false, { kind: "caller", resolve: resolve as (v: RequestAnswer | ClockEstimate) => void, reject });
    });
  }

  /**
   * {@link request} without a promise: returns the request id at once; the outcome comes as
   * one `answer` or `requestFailed` event with that id (a game loop that polls events, the
   * Unity WebGL bridge). Throws {@link RequestError} when it cannot be sent
   * (`not_sequenced`, `buffer_full`, `too_large`, `closed`), RangeError for a bad argument.
   * Rust's `start_request`, C's `waygate_client_request`.
   */
  startRequest(msgId: number, body: Uint8Array | ArrayBuffer | string = new Uint8Array(0), options: RequestOptions = {}): number {
    return this.beginRequest(msgId, body, options, false, { kind: "event" });
  }

  /**
   * Takes a sample of the game server's clock: a critical request with an empty body to
   * `msgId` (the demo's TIME, 1010) whose answer body is the server's Unix time in ms
   * (u64 big-endian). Resolves with the estimate including this sample (the fastest of the
   * last 8 exchanges), also in {@link clockOffset} and `stats().clock`. Rejects as
   * {@link request}, and with `bad_answer` when the answer is not status 0 with 8 bytes.
   * Call it a few times at start, then now and then.
   */
  syncClock(msgId: number, timeoutMs: number = DEFAULT_REQUEST_TIMEOUT_MS): Promise<ClockEstimate> {
    return new Promise<ClockEstimate>((resolve, reject) => {
      this.beginRequest(msgId, new Uint8Array(0), { cls: "critical", timeoutMs }, true, {
        kind: "caller",
        resolve: resolve as (v: RequestAnswer | ClockEstimate) => void,
        reject,
      });
    });
  }

  /**
   * {@link syncClock} without a promise: returns the request id; the outcome comes as an
   * `answer` (the estimate is then updated) or `requestFailed` event. Throws as
   * {@link startRequest}.
   */
  startSyncClock(msgId: number, timeoutMs: number = DEFAULT_REQUEST_TIMEOUT_MS): number {
    return this.beginRequest(msgId, new Uint8Array(0), { cls: "critical", timeoutMs }, true, { kind: "event" });
  }

  /**
   * The game server's clock offset, ms: server time ≈ `Date.now() + clockOffset` (within
   * half the round trip of the sample it rests on: `stats().clock.rttMs`). Null before the
   * first clock sample was answered.
   */
  get clockOffset(): number | null {
    return this.clockSync.estimate()?.offsetMs ?? null;
  }

  /** Statistics: RTT, unacked count, last server seq, connects. */
  stats(): ClientStats {
    return {
      state: this.state,
      rtt: { ...this.rtt },
      unacked: this.unacked.length,
      lastServerSeq: this.cum,
      connects: this.connects,
      sessionId: this.session ? toHex(this.session.id) : null,
      channelDuplicates: this.channels.duplicates,
      channelUndecodable: this.channels.undecodable,
      clock: this.clockSync.estimate(),
      requestsPending: this.requests.size,
    };
  }

  /**
   * The last position of every channel this session is a member of, by channel name (a
   * copy). After a new session (outcome `new` or `restoreFailed`) the client is a member of
   * nothing: hand these to the game's backend for it to join with recovery (PROTOCOL.md §12.4).
   */
  channelPositions(): Map<string, ChannelPosition> {
    return this.channels.positions();
  }

  /**
   * Closes for good: sends CLOSE(normal) and closes the socket. The session lingers on the
   * server until its linger time runs out (§7.5), so the player can come back to it; use
   * `logout()` to end it.
   */
  close(reason = "client closed"): void {
    // Ends the client whatever the link: nothing to report (the session lingers either way).
    this.closeWith(CloseCode.normal, reason);
  }

  /**
   * Ends the session for good: sends CLOSE(logout) and closes the socket; the edge ends the
   * session at once (the player is offline) instead of letting it linger (§7.5). Returns
   * whether it went out on a live session's socket: false when the client had already
   * ended, or no session was up (reconnecting: the client ends and the session lingers out).
   */
  logout(reason = "logged out"): boolean {
    return this.closeWith(CloseCode.logout, reason);
  }

  /** Sends CLOSE(code) on a live session's socket, if there is one (the result), and ends. */
  private closeWith(code: number, reason: string): boolean {
    if (this._state === "closed") return false;
    const ws = this.ws;
    const live = this._state === "active" && ws !== null && ws.readyState === WS_OPEN;
    if (ws && ws.readyState === WS_OPEN) {
      // A logout before the WELCOME returns false (the session lingers out): an edge whose
      // WELCOME is on its way must not end the session on a CLOSE(logout).
      const sent = code === CloseCode.logout && !live ? CloseCode.normal : code;
      this.transmit({ type: "close", code: sent, message: reason.slice(0, 200) }, true);
    }
    this.dropSocket(1000, "closed");
    this.terminate(code, reason);
    return live;
  }

  /** Test hook: drops the socket as a network failure would (no CLOSE); the client resumes. */
  dropLink(): void {
    if (this.ws) this.linkLost(null, "dropped locally");
  }

  // -------------------------------------------------------------------------------------
  // Requests (§13)

  /**
   * Sends a request: its id in front of the body, as a sequenced DATA; the table waits for
   * its outcome. Returns the id; throws RequestError when it is not sent, RangeError for a
   * bad argument.
   */
  private beginRequest(
    msgId: number,
    body: Uint8Array | ArrayBuffer | string,
    options: RequestOptions,
    clock: boolean,
    reply: RequestReply,
  ): number {
    const cls = options.cls ?? "normal";
    const timeoutMs = options.timeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
    if (typeof timeoutMs !== "number" || !(timeoutMs >= 0) || !Number.isFinite(timeoutMs)) {
      throw new RangeError(`timeoutMs must be a number >= 0: ${timeoutMs}`);
    }
    if (this._state === "closed") throw new RequestError("closed", "not sent: the client is closed");
    if (cls !== "critical" && cls !== "normal") {
      throw new RequestError("not_sequenced", `not sent: a request must be critical or normal, not ${String(cls)}`);
    }
    const bytes = typeof body === "string" ? encoder.encode(body) : body instanceof Uint8Array ? body : new Uint8Array(body);
    const id = this.requests.nextId();
    const payload = encodeRequest(id, bytes);
    const sentUnixMs = Date.now();
    const sentAt = now();
    let seq: bigint | null;
    try {
      seq = this.send(msgId, payload, cls);
    } catch (e) {
      if (e instanceof SendError) throw new RequestError(e.reason, `not sent: ${e.message}`);
      throw e;
    }
    if (seq === null || seq <= 0n) throw new RequestError("not_sequenced", "not sent: the request got no client seq");
    const p: PendingRequest<RequestReply> = {
      id,
      seq,
      timer: null,
      clock: clock ? { sentUnixMs, sentAt } : null,
      reply,
    };
    // setTimeout fires at once for delays above 2^31 - 1 ms: cap (24.8 days).
    p.timer = setTimeout(() => {
      p.timer = null;
      if (this.requests.remove(id) === p) {
        this.finishRequest(p, new RequestError("timeout", `no answer within ${timeoutMs} ms`, { requestId: id }));
      }
    }, Math.min(timeoutMs, 0x7fff_ffff));
    this.requests.insert(p);
    return id;
  }

  /**
   * Hands a request's outcome (already out of the table) to whoever waits for it: its
   * promise, or the `answer` / `requestFailed` event. A clock sample updates the estimate
   * first.
   */
  private finishRequest(p: PendingRequest<RequestReply>, result: RequestAnswer | RequestError): void {
    if (p.timer !== null) clearTimeout(p.timer);
    p.timer = null;
    let estimate: ClockEstimate | null = null;
    if (p.clock !== null && !(result instanceof RequestError)) {
      const server = result.status === 0 ? decodeClock(result.body) : null;
      if (server !== null) {
        estimate = this.clockSync.observe(p.clock.sentUnixMs, now() - p.clock.sentAt, server);
      } else {
        result = new RequestError(
          "bad_answer",
          `not a clock answer (status ${result.status}, ${result.body.length} bytes)`,
          { requestId: p.id },
        );
      }
    }
    const reply = p.reply;
    if (reply.kind === "caller") {
      if (result instanceof RequestError) reply.reject(result);
      else reply.resolve(estimate ?? result);
      return;
    }
    if (result instanceof RequestError) {
      this.emit("requestFailed", {
        requestId: p.id,
        reason: result.reason,
        code: result.code,
        label: result.label,
        retryAfterMs: result.retryAfterMs,
        message: result.message,
      });
    } else {
      this.emit("answer", { requestId: p.id, status: result.status, body: result.body });
    }
  }

  /** Every request still waiting fails with `reason` (a new session, the end of the client). */
  private failAllRequests(reason: "session_lost" | "closed"): void {
    for (const p of this.requests.takeAll()) this.finishRequest(p, this.requestLost(p, reason));
  }

  private requestLost(p: PendingRequest<RequestReply>, reason: "session_lost" | "closed" | "expired"): RequestError {
    const message =
      reason === "session_lost"
        ? "the session it was sent in was replaced by a new one"
        : reason === "expired"
          ? "expired before it could be sent (maxOfflineAgeMs)"
          : "the client is closed";
    return new RequestError(reason, message, { requestId: p.id });
  }

  // -------------------------------------------------------------------------------------
  // Events

  private emit<K extends EventName>(event: K, payload: ClientEvents[K]): void {
    const set = this.listeners.get(event);
    if (!set) return;
    for (const fn of [...set]) {
      try {
        (fn as Listener<K>)(payload);
      } catch (e) {
        // A listener's bug must not break the session machine; surface it asynchronously.
        setTimeout(() => {
          throw e;
        }, 0);
      }
    }
  }

  /** Emits `stateChange` when `state` differs from the state last reported. */
  private reportState(): void {
    const to = this.state;
    const from = this.reported;
    if (to === from) return;
    this.reported = to;
    this.emit("stateChange", { from, to });
  }

  // -------------------------------------------------------------------------------------
  // Connection lifecycle

  private openSocket(): void {
    this.clearReconnect();
    const url = this.migrateTo ?? this.urls[this.urlIndex % this.urls.length];
    this.url = url;
    const gen = ++this.gen;
    this._state = "connecting";
    let ws: WebSocketLike;
    try {
      ws = this.opts.offerSubprotocol ? new this.WS(url, [SUBPROTOCOL]) : new this.WS(url);
    } catch (e) {
      // A malformed URL or a blocked port throws synchronously in browsers.
      this.ws = null;
      queueMicrotask(() => {
        if (gen === this.gen) this.attemptFailed(null, `cannot open ${url}: ${String(e)}`, 0);
      });
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    this.handshakeTimer = setTimeout(() => {
      if (gen !== this.gen) return;
      this.failLink(CloseCode.handshake_timeout, "no WELCOME within the handshake timeout");
    }, this.opts.handshakeTimeoutMs);
    ws.onopen = () => {
      if (gen !== this.gen) return;
      this._state = "handshaking";
      this.lastRx = now();
      this.helloPending = true;
      void this.sendHello(gen);
    };
    ws.onmessage = (ev) => {
      if (gen !== this.gen) return;
      this.onData(ev.data);
    };
    ws.onerror = () => {
      // Always followed by onclose (browsers give no detail on errors).
    };
    ws.onclose = (ev) => {
      if (gen !== this.gen) return;
      const when = this._state === "connecting" ? " before open" : this._state === "handshaking" ? " before WELCOME" : "";
      this.linkLost(codeFromWsStatus(ev.code), `websocket closed${when} (status ${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`);
    };
  }

  /**
   * Sends the HELLO of socket `gen`, the first frame on it. With a session, the resume part
   * carries the next nonce and a proof of the resume token (§7.3.1), computed asynchronously:
   * the HELLO goes out only if the socket is still the current one. Without `crypto.subtle`
   * (a page that is not a secure context) the client cannot resume: it logs in afresh.
   */
  private async sendHello(gen: number): Promise<void> {
    const session = this.session;
    let resume: ResumeRequest | null = null;
    if (session !== null) {
      if (resumeProofSupported()) {
        const nonce = ++session.nonce;
        const lastServerSeq = this.cum;
        try {
          const proof = await resumeProof(session.token, session.id, lastServerSeq, nonce);
          resume = { sessionId: session.id, proof, lastServerSeq, nonce };
        } catch (e) {
          this.warnNoResume(`computing the resume proof failed (${String(e)})`);
        }
      } else {
        this.warnNoResume("crypto.subtle is unavailable (the page is not a secure context: serve it over https or from localhost)");
      }
    }
    if (gen !== this.gen) return;
    this.helloPending = false;
    this.helloTokenEpoch = this.tokenEpoch;
    this.transmit({
      type: "hello",
      version: PROTOCOL_VERSION,
      token: this.resumeOnly && resume ? new Uint8Array(0) : this.token,
      resume,
    });
  }

  private warnNoResume(why: string): void {
    if (this.warnedNoResume) return;
    this.warnedNoResume = true;
    console.warn(`waygate: cannot resume sessions: ${why}; reconnects log in afresh with the auth token (a new session)`);
  }

  /** Forgets the current socket (its later events are ignored) and closes it. */
  private dropSocket(status: number, reason: string): void {
    this.waitingSince = null;
    this.helloPending = false;
    this.gen++;
    const ws = this.ws;
    this.ws = null;
    this.stopTimers();
    if (ws) {
      ws.onopen = ws.onmessage = ws.onclose = ws.onerror = null;
      try {
        ws.close(status, reason);
      } catch {
        // Already closing.
      }
    }
  }

  private stopTimers(): void {
    if (this.ticker !== null) clearInterval(this.ticker);
    if (this.handshakeTimer !== null) clearTimeout(this.handshakeTimer);
    if (this.ackTimer !== null) clearTimeout(this.ackTimer);
    this.ticker = this.handshakeTimer = this.ackTimer = null;
  }

  private clearReconnect(): void {
    if (this.reconnectTimer !== null) clearTimeout(this.reconnectTimer);
    this.reconnectTimer = null;
  }

  /** The link ended without a terminal code: reconnect (at once after an active link). */
  private linkLost(code: number | null, reason: string): void {
    const wasActive = this._state === "active";
    this.dropSocket(1000, "link lost");
    if (code === CloseCode.kicked || code === CloseCode.session_expired) {
      this.endSession(code, reason);
      return;
    }
    if (wasActive) {
      this.reconnectAfterActive(code, reason);
    } else {
      this.attemptFailed(code, reason, 0);
    }
  }

  /**
   * A link that had its WELCOME ended: reconnect at once, unless it (and the ones before
   * it) died within {@link QUICK_LOSS_MS} of their WELCOME — something the edge does to
   * every link at once (a message it closes on, resent on each resume) — then back off as
   * after failed attempts, so the client does not spin.
   */
  private reconnectAfterActive(code: number | null, reason: string): void {
    this.failures = 0;
    if (!this.linkEnded()) {
      this.scheduleReconnect(0, { code, reason, wasActive: true });
      return;
    }
    this.quickLosses++;
    const cap = this.backoffCap(this.quickLosses - 1);
    this.scheduleReconnect(Math.floor(this.opts.random() * (cap + 1)), { code, reason, wasActive: true });
  }

  /**
   * A link that had its WELCOME ended: whether it died within {@link QUICK_LOSS_MS} of it.
   * One that lived longer ends a run of quick losses.
   */
  private linkEnded(): boolean {
    if (now() - this.welcomedAt < QUICK_LOSS_MS) return true;
    this.quickLosses = 0;
    return false;
  }

  /** The reconnect delay's cap after `failures` failures: doubling up to the maximum. */
  private backoffCap(failures: number): number {
    return Math.min(this.opts.backoffMaxMs, this.opts.backoffMinMs * 2 ** Math.min(failures, 16));
  }

  /** Ends the link with our own CLOSE(code) (after WELCOME: see `transmit`), then reconnects. */
  private failLink(code: number, reason: string): void {
    const wasActive = this._state === "active";
    if (this.ws && this.ws.readyState === WS_OPEN) this.transmit({ type: "close", code, message: reason.slice(0, 200) });
    this.dropSocket(code < 1000 ? 4000 + code : 1000, reason.slice(0, 100));
    if (wasActive) {
      this.reconnectAfterActive(code, reason);
    } else {
      this.attemptFailed(code, reason, 0);
    }
  }

  /**
   * An attempt failed before WELCOME: `connectFailed` (unless it was a REJECT, already
   * reported as an `error`), then the next URL, exponential backoff: `retryAfterMs` plus the jitter.
   */
  private attemptFailed(code: number | null, reason: string, retryAfterMs: number, rejected = false): void {
    this.dropSocket(1000, "attempt failed");
    if (this._state === "closed") return;
    if (!rejected) {
      this.emit("connectFailed", { url: this.url, reason, attempt: this.failures + 1 });
      if ((this._state as Phase) === "closed") return; // A listener closed the client.
    }
    if (this.migrateTo !== null) {
      this.migrateTo = null; // The migrate target failed: back to our own list.
    } else {
      this.urlIndex = (this.urlIndex + 1) % this.urls.length;
    }
    this.failures++;
    if (this.giveUpAfterAttempts !== undefined && this.failures >= this.giveUpAfterAttempts) {
      this.terminate(CloseCode.unavailable, `${this.failures} connect attempts failed: giving up`);
      return;
    }
    const cap = this.backoffCap(this.failures);
    // The hint plus the jitter (clients refused together must not all come back together),
    // the jitter at most half the hint when there is one.
    const jitterCap = retryAfterMs > 0 ? Math.min(cap, Math.max(1, Math.floor(retryAfterMs / 2))) : cap;
    const jitter = Math.floor(this.opts.random() * (jitterCap + 1));
    this.scheduleReconnect(retryAfterMs + jitter, { code, reason, wasActive: false });
  }

  /** Reports the lost link and reconnects after `delayMs` (or leaves that to the caller: `noTimer`). */
  private scheduleReconnect(
    delayMs: number,
    why: { code: number | null; reason: string; wasActive: boolean },
    noTimer = false,
  ): void {
    if (this._state === "closed") return; // A listener of an earlier event closed the client.
    this._state = "waiting";
    this.armGiveUp();
    this.reportState();
    if (this._state !== "waiting") return; // A stateChange listener closed the client.
    this.emit("disconnected", {
      code: why.code,
      label: why.code === null ? "transport" : codeLabel(why.code),
      reason: why.reason,
      wasActive: why.wasActive,
      willReconnect: true,
      retryInMs: delayMs,
    });
    if (this._state !== "waiting" || noTimer) return; // A listener closed the client.
    this.clearReconnect();
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      if (this._state === "waiting") this.openSocket();
    }, delayMs);
  }

  /** The session is over (kicked, expired): terminal. */
  private endSession(code: number, message: string): void {
    this.session = null;
    const wasActive = this._state === "active" || this._state === "handshaking";
    this.dropSocket(1000, "session ended");
    this.emit("disconnected", {
      code,
      label: codeLabel(code),
      reason: message,
      wasActive,
      willReconnect: false,
      retryInMs: 0,
    });
    if (code === CloseCode.kicked) this.emit("kicked", { code, message });
    this.terminate(code, message);
  }

  private terminate(code: number, reason: string): void {
    if (this._state === "closed") return;
    this.clearReconnect();
    this.clearGiveUp();
    this.removeHooks();
    this.stopTimers();
    this._state = "closed";
    // Every request still waiting ends now, its outcome before the terminal events.
    this.failAllRequests("closed");
    this.reportState();
    this.emit("closed", { code, label: codeLabel(code), reason });
  }

  /** No session is up: from now on, give up after giveUpAfterMs unless a WELCOME comes (kept if already armed). */
  private armGiveUp(): void {
    const limit = this.giveUpAfterMs;
    if (limit === undefined || this.giveUpTimer !== null) return;
    this.giveUpTimer = setTimeout(() => {
      this.giveUpTimer = null;
      if (this._state === "active" || this._state === "closed") return;
      const reason = `no session for ${limit} ms: giving up`;
      this.dropSocket(1000, "giving up");
      this.terminate(CloseCode.unavailable, reason);
    }, limit);
  }

  private clearGiveUp(): void {
    if (this.giveUpTimer !== null) clearTimeout(this.giveUpTimer);
    this.giveUpTimer = null;
  }

  // -------------------------------------------------------------------------------------
  // Browser lifecycle hooks

  private installHooks(): void {
    if (!this.opts.lifecycleHooks || this.unhook !== null) return;
    type Target = { addEventListener(t: string, f: () => void): void; removeEventListener(t: string, f: () => void): void };
    const g = globalThis as unknown as Partial<Target> & { document?: Partial<Target> & { visibilityState?: string } };
    if (typeof g.addEventListener !== "function" || typeof g.removeEventListener !== "function") return;
    const win = g as Target;
    // visibilitychange fires at the document (and bubbles to the window).
    const doc = g.document;
    const visTarget: Target =
      doc && typeof doc.addEventListener === "function" && typeof doc.removeEventListener === "function" ? (doc as Target) : win;
    const onOnline = (): void => {
      if (this.paused) return; // The application resumes a paused client itself.
      if (this._state === "waiting" || this._state === "connecting") this.reconnectNow();
    };
    const onVisibility = (): void => {
      if (this.paused) return;
      if ((globalThis as { document?: { visibilityState?: string } }).document?.visibilityState !== "visible") return;
      if (this._state === "waiting") {
        this.reconnectNow();
      } else if (this._state === "active") {
        const quiet = this.heartbeatMs > 0 ? this.heartbeatMs : 10_000;
        if (now() - this.lastRx > quiet) this.reconnectNow();
      }
    };
    win.addEventListener("online", onOnline);
    visTarget.addEventListener("visibilitychange", onVisibility);
    this.unhook = () => {
      win.removeEventListener("online", onOnline);
      visTarget.removeEventListener("visibilitychange", onVisibility);
    };
  }

  private removeHooks(): void {
    const unhook = this.unhook;
    this.unhook = null;
    unhook?.();
  }

  // -------------------------------------------------------------------------------------
  // Sending

  /**
   * Sends a frame on the current link; false when there is none open, or the frame may not
   * go yet (nothing sent). `ending`: the last CLOSE of a client that ends, which may go
   * before WELCOME (the client will not resume).
   */
  private transmit(f: Frame, ending = false): boolean {
    const ws = this.ws;
    if (!ws || ws.readyState !== WS_OPEN) return false;
    if (this.helloPending && f.type !== "hello") return false; // HELLO is the first frame (§7.1).
    // Before WELCOME nothing but HELLO and PING (§7.1): a CLOSE crossing a resume's WELCOME
    // would spend the resume token this client still holds.
    if (this._state !== "active" && f.type !== "hello" && f.type !== "ping" && !ending) return false;
    ws.send(encodeFrame(f));
    const expectsAnswer = (f.type === "data" && f.seq > 0n) || f.type === "ping";
    // The heartbeat counts only frames the edge answers (§7.5): a client sending nothing but
    // best-effort DATA and ACKs still PINGs, or it would never learn its link died.
    if (expectsAnswer) this.lastTx = now();
    if (expectsAnswer && this._state === "active" && this.waitingSince === null) {
      this.waitingSince = now();
    }
    return true;
  }

  /** Sends DATA; false when no link was open (nothing sent). */
  private sendData(m: { cls: TrafficClass; msgId: number; seq: bigint; payload: Uint8Array }, piggyback: boolean): boolean {
    let ack: bigint | null = null;
    if (piggyback && (this.ackOwed || this.cum > this.ackSent)) {
      ack = this.cum;
      this.noteAckSent();
    }
    return this.transmit({ type: "data", cls: m.cls, msgId: m.msgId, seq: m.seq, ack, payload: m.payload });
  }

  private sendAck(): void {
    this.noteAckSent();
    this.transmit({ type: "ack", ack: this.cum });
  }

  private noteAckSent(): void {
    this.ackSent = this.cum;
    this.ackOwed = false;
    this.unackedDown = 0;
    if (this.ackTimer !== null) clearTimeout(this.ackTimer);
    this.ackTimer = null;
  }

  /** A sequenced message (new or duplicate) arrived: an ack is owed (§7.4.2). */
  private owe(): void {
    this.ackOwed = true;
    this.unackedDown++;
    if (this.unackedDown >= this.opts.ackEvery) {
      this.sendAck();
    } else if (this.ackTimer === null) {
      const gen = this.gen;
      this.ackTimer = setTimeout(() => {
        this.ackTimer = null;
        if (gen === this.gen && this._state === "active" && this.ackOwed) this.sendAck();
      }, this.opts.ackDelayMs);
    }
  }

  private onUpstreamAck(ack: bigint): void {
    if (ack > this.nextSeq - 1n) throw new ProtocolError(`ack ${ack} above the highest seq sent (${this.nextSeq - 1n})`);
    while (this.unacked.length > 0 && this.unacked[0].seq <= ack) this.unacked.shift();
  }

  // -------------------------------------------------------------------------------------
  // Receiving

  private onData(data: unknown): void {
    if (!(data instanceof ArrayBuffer)) {
      const code = typeof data === "string" ? CloseCode.text_message : CloseCode.protocol_error;
      this.violation(new ProtocolError("text WebSocket message", code));
      return;
    }
    this.lastRx = now();
    let frame: Frame;
    try {
      frame = decodeFrame(data, Math.max(this.serverMaxFrameSize, DEFAULT_MAX_FRAME_SIZE));
    } catch (e) {
      this.violation(e);
      return;
    }
    try {
      this.onFrame(frame);
    } catch (e) {
      this.violation(e);
    }
    this.calmDown(now());
    // Any frame proves the link alive; what is still unacked is outstanding from now.
    this.waitingSince = this._state === "active" && this.unacked.length > 0 ? now() : null;
  }

  /** Halves the liveness timeout after `LIVENESS_CALM_MS` of the link without it firing. */
  private calmDown(t: number): void {
    if (this.livenessBackoff === 0 || this._state !== "active" || this.calmSince === null) return;
    if (t - this.calmSince >= LIVENESS_CALM_MS) {
      this.livenessBackoff--;
      this.calmSince = t;
    }
  }

  private violation(e: unknown): void {
    const code = e instanceof ProtocolError ? e.code : CloseCode.protocol_error;
    const message = e instanceof Error ? e.message : String(e);
    this.emit("error", { kind: "protocol", code, message });
    if (this._state !== "closed") this.failLink(code, message);
  }

  private onFrame(f: Frame): void {
    const state = this._state;
    if (f.type === "close") {
      this.onClose(f.code, f.message);
      return;
    }
    if (f.type === "ping") {
      this.transmit({ type: "pong", timestamp: f.timestamp });
      return;
    }
    if (f.type === "pong") {
      this.onPong(f.timestamp);
      return;
    }
    if (state === "handshaking") {
      if (f.type === "welcome") return this.onWelcome(f);
      if (f.type === "reject") return this.onReject(f.code, f.retryAfterMs, f.message);
    } else if (state === "active") {
      switch (f.type) {
        case "data":
          return this.onDownData(f);
        case "ack":
          return this.onUpstreamAck(f.ack);
        case "migrate":
          return this.onMigrate(f.target, f.deadlineMs, f.sessionId, f.resumeToken);
        case "error":
          // §3.9: after a resume the edge sends again every ERROR it cannot know arrived;
          // one answer per message. Every best-effort refusal carries client_seq 0 and is
          // sent once: each one is reported.
          if (f.clientSeq !== 0n) {
            if (this.errored.has(f.clientSeq)) return;
            this.errored.add(f.clientSeq);
            if (this.errored.size > ERRORED_SEQS_KEPT) {
              const oldest = this.errored.values().next().value;
              if (oldest !== undefined) this.errored.delete(oldest);
            }
          }
          {
            // §13: an ERROR for a request's seq is that request's outcome, not an `error`.
            const p = this.requests.removeBySeq(f.clientSeq);
            if (p !== undefined) {
              const label = codeLabel(f.code);
              this.finishRequest(
                p,
                new RequestError("refused", `refused: ${label}`, { requestId: p.id, code: f.code, label, retryAfterMs: f.retryAfterMs }),
              );
              return;
            }
          }
          this.emit("error", {
            kind: "undelivered",
            code: f.code,
            label: codeLabel(f.code),
            msgId: f.msgId,
            clientSeq: f.clientSeq,
            retryAfterMs: f.retryAfterMs,
          });
          return;
      }
    }
    throw new ProtocolError(`unexpected ${f.type.toUpperCase()} frame in state ${state}`, CloseCode.unexpected_frame);
  }

  private onWelcome(w: Extract<Frame, { type: "welcome" }>): void {
    const first = this.session === null && this.cum === 0n && this.connects === 0;
    // §7.3.1: the nonce count goes on within a session; a new session id restarts it.
    const held = this.session;
    const nonce = held !== null && sameId(held.id, w.sessionId) ? held.nonce : 0n;
    this.session = { id: w.sessionId, token: w.resumeToken, nonce };
    this.calmSince = now();
    this.heartbeatMs = w.heartbeatIntervalMs;
    this.lastTx = now(); // the heartbeat interval runs from the WELCOME
    this.idleTimeoutMs = w.idleTimeoutMs;
    // §10.2: what this client sends is refused above the smaller of its own limit and the
    // WELCOME's; what it receives may be as large as the WELCOME says.
    this.serverMaxFrameSize = w.maxFrameSize > 0 ? w.maxFrameSize : DEFAULT_MAX_FRAME_SIZE;
    this.maxFrameSize = Math.min(this.serverMaxFrameSize, DEFAULT_MAX_FRAME_SIZE);
    let discarded = 0;
    let expired: { msgId: number; seq: bigint; ageMs: number }[] = [];
    // Requests that end with this WELCOME (expired, or voided by a new session).
    let ended: [PendingRequest<RequestReply>, RequestError][] = [];
    const restored = w.outcome === WelcomeOutcome.Restored || w.outcome === WelcomeOutcome.RestoredWithGap;
    if (restored || first) {
      if (restored) {
        // §7.4.4: continue after server_seq_base; drop what the server already has.
        this.skipTo(w.serverSeqBase);
        this.onUpstreamAck(w.clientSeqAck);
      }
      // On a resume, and before the very first session: what was queued while no session
      // was up goes out, unless too old. A request among the dropped fails (`expired`, its
      // only outcome: no `expired` event); the requests after them follow their new seqs.
      expired = this.expireStale();
      const failed = this.requests.onExpired(expired.map((e) => e.seq));
      if (failed.length > 0) {
        const gone = new Set(failed.map((p) => p.seq));
        expired = expired.filter((e) => !gone.has(e.seq));
        ended = failed.map((p) => [p, this.requestLost(p, "expired")]);
      }
    } else {
      // Sent in a session that is gone (or about to be discarded unsent): no answer will come.
      ended = this.requests.takeAll().map((p) => [p, this.requestLost(p, "session_lost")]);
      // A fresh session replacing an old one: both seq spaces restart at 1 and the old
      // session's unacked messages are void (the application resyncs).
      discarded = this.unacked.length;
      this.cum = 0n;
      this.above.clear();
      this.ackSent = 0n;
      this.nextSeq = 1n;
      this.unacked = [];
      this.errored.clear();
    }
    this._state = "active";
    this.failures = 0;
    this.welcomedAt = now();
    this.connects++;
    this.migrateTo = null;
    this.clearGiveUp();
    // Sticky fallback: the URL that worked is tried first on the next connect.
    const worked = this.urls.indexOf(this.url);
    if (worked >= 0) this.urlIndex = worked;
    if (this.handshakeTimer !== null) clearTimeout(this.handshakeTimer);
    this.handshakeTimer = null;
    // §7.3.3: a frame right after WELCOME confirms the new resume token.
    this.sendAck();
    const resent = this.unacked.length;
    for (const m of this.unacked) if (this.sendData(m, false)) m.transmitted = true;
    this.startTicker();

    // The session machine is settled; now the events. A listener may close the client or
    // drop the link: what is left of this WELCOME's events is then not emitted.
    const gen = this.gen;
    const still = (): boolean => gen === this.gen && this._state === "active";
    // The requests this WELCOME ended get their outcomes first (as in the Rust SDK), every
    // one of them, even if a listener closes the client meanwhile.
    for (const [p, e] of ended) this.finishRequest(p, e);
    const sessionId = toHex(w.sessionId);
    const outcome = OUTCOMES[w.outcome];
    this.reportState();
    if (!still()) return;
    this.emit("connected", { url: this.url, sessionId, outcome });
    for (const e of expired) {
      if (!still()) return;
      this.emit("expired", e);
    }
    if (!still()) return;
    switch (w.outcome) {
      case WelcomeOutcome.NewSession:
      case WelcomeOutcome.RestoreFailedNewSession:
        this.emit("newSession", { sessionId, restoreFailed: w.outcome === WelcomeOutcome.RestoreFailedNewSession, discarded });
        break;
      case WelcomeOutcome.Restored:
        this.emit("restored", { sessionId, resent });
        break;
      case WelcomeOutcome.RestoredWithGap:
        this.emit("restoredWithGap", { sessionId, serverSeqBase: w.serverSeqBase, resent });
        break;
    }
  }

  /**
   * `maxOfflineAgeMs` on a resume, before the resend: drops the messages that never went
   * out on any link (the tail of `unacked` after the last one transmitted) and are older
   * than the bound, and renumbers the rest of that tail so the seqs on the wire stay
   * contiguous (the server has seen none of them). Queued in order, the stale ones are a
   * prefix of that tail. Returns what was dropped, for the `expired` events.
   */
  private expireStale(): { msgId: number; seq: bigint; ageMs: number }[] {
    // Never sent (the server has not seen their seqs): dropped when older than
    // `maxOfflineAgeMs`, or when their DATA frame is above the max frame size the WELCOME
    // just announced (checked when sent against the client's own limit only: sent, it
    // would close the link at every resume). The ones left are renumbered.
    const bound = this.opts.maxOfflineAgeMs;
    let start = this.unacked.length;
    while (start > 0 && !this.unacked[start - 1].transmitted) start--;
    const t = now();
    const dropped: { msgId: number; seq: bigint; ageMs: number }[] = [];
    const kept: Unacked[] = [];
    for (let i = start; i < this.unacked.length; i++) {
      const m = this.unacked[i];
      const age = t - m.queuedAt;
      const tooOld = bound > 0 && age > bound;
      const tooLarge =
        m.payload.length + 27 > this.maxFrameSize &&
        encodeFrame({ type: "data", cls: m.cls, msgId: m.msgId, seq: m.seq, ack: MAX_U64, payload: m.payload }).length >
          this.maxFrameSize;
      if (tooOld || tooLarge) dropped.push({ msgId: m.msgId, seq: m.seq, ageMs: Math.floor(age) });
      else kept.push(m);
    }
    if (dropped.length === 0) return dropped;
    const firstSeq = this.unacked[start].seq;
    kept.forEach((m, k) => {
      m.seq = firstSeq + BigInt(k);
    });
    this.unacked = [...this.unacked.slice(0, start), ...kept];
    this.nextSeq = firstSeq + BigInt(kept.length);
    return dropped;
  }

  private skipTo(base: bigint): void {
    if (base <= this.cum) return;
    this.cum = base;
    for (const s of [...this.above]) if (s <= base) this.above.delete(s);
    while (this.above.delete(this.cum + 1n)) this.cum++;
  }

  private onReject(code: number, retryAfterMs: number, message: string): void {
    this.emit("error", { kind: "rejected", code, label: codeLabel(code), retryAfterMs, message });
    if (codeClass(code) === "auth" && code !== CloseCode.auth_rejected && this.session !== null && !this.resumeOnly) {
      // §7.1.1: a client whose token was refused (expired, or signed with a key since
      // rotated; not a ban) resumes with the resume part alone — unless the application
      // set a fresh token since that HELLO went out, which the next one carries.
      if (this.helloTokenEpoch === this.tokenEpoch) this.resumeOnly = true;
      this.attemptFailed(code, `rejected: ${message || codeLabel(code)}`, retryAfterMs, true);
      return;
    }
    if (code === CloseCode.resume_rejected) {
      this.session = null;
      if (this.resumeOnly || this.token.length === 0) {
        // Nothing left to log in with: the application must supply a new token.
        this.dropSocket(1000, "rejected");
        this.terminate(code, message || "resume rejected and no valid auth token");
        return;
      }
    }
    if (TERMINAL_REJECTS.has(code) || codeClass(code) === "auth") {
      this.dropSocket(1000, "rejected");
      this.terminate(code, message || codeLabel(code));
      return;
    }
    this.attemptFailed(code, `rejected: ${message || codeLabel(code)}`, retryAfterMs, true);
  }

  private onClose(code: number, message: string): void {
    // After WELCOME the code alone says whether the session lingers (§7.8).
    const ended = this._state === "active" ? !closeKeepsSession(code) : false;
    if (ended || code === CloseCode.kicked || code === CloseCode.session_expired) {
      this.endSession(code, message || codeLabel(code));
      return;
    }
    if (code === CloseCode.resume_rejected) this.session = null;
    // §3.8: stop sending and close our side without answering CLOSE.
    this.linkLost(code, `closed by the server: ${codeLabel(code)}${message ? ` (${message})` : ""}`);
  }

  private onDownData(d: Extract<Frame, { type: "data" }>): void {
    if (d.ack !== null) this.onUpstreamAck(d.ack);
    if (isSequenced(d.cls)) {
      const seq = d.seq;
      if (seq === 0n || seq > this.cum + RECV_WINDOW) throw new ProtocolError(`server seq ${seq} out of window (cumulative ${this.cum})`);
      if (seq <= this.cum || this.above.has(seq)) {
        this.owe(); // A duplicate is dropped but still owes an ack.
        return;
      }
      if (seq === this.cum + 1n) {
        this.cum = seq;
        while (this.above.delete(this.cum + 1n)) this.cum++;
      } else {
        this.above.add(seq);
      }
      this.owe();
    }
    if (d.msgId === ANSWER_MSG_ID) {
      // §13: an answer, never a message. One to no waiting request (timed out, unknown) or
      // too short to be an answer is dropped.
      const a = decodeAnswer(d.payload);
      const p = a === null ? undefined : this.requests.remove(a.id);
      if (a !== null && p !== undefined) this.finishRequest(p, { status: a.status, body: a.body });
      return;
    }
    if (d.msgId === CHANNEL_EVENT_MSG_ID) {
      // §12.2: a channel event, never a message. Undecodable ones are counted and dropped.
      const update = this.channels.acceptPayload(d.payload);
      if (update !== null) this.emit("channel", update);
      return;
    }
    // §3.4: another id of the edge's own range (a later version's) is acknowledged like any
    // DATA (done above) and is not a message.
    if (d.msgId >= RESERVED_MSG_IDS_START) return;
    this.emit("message", { msgId: d.msgId, cls: d.cls, seq: d.seq, payload: d.payload });
  }

  private onMigrate(target: string, deadlineMs: number, sessionId: Id, resumeToken: Id): void {
    // The session id stays (§7.7): so does the nonce count.
    const held = this.session;
    const nonce = held !== null && sameId(held.id, sessionId) ? held.nonce : 0n;
    this.session = { id: sessionId, token: resumeToken, nonce };
    // A browser can only follow ws/wss targets; any other (or empty) target means "any
    // edge from our own list".
    this.migrateTo = /^wss?:\/\//i.test(target) ? target : null;
    this.emit("migrating", { target, deadlineMs });
    if (this._state !== "active") return;
    this.transmit({ type: "close", code: CloseCode.going_away, message: "migrating" });
    this.dropSocket(1000, "migrating");
    this.failures = 0;
    this.linkEnded();
    this.scheduleReconnect(0, { code: CloseCode.going_away, reason: `migrating to ${target || "any edge"}`, wasActive: true });
  }

  private onPong(timestamp: bigint): void {
    const sent = Number(timestamp);
    const t = now() - this.epoch;
    if (!Number.isFinite(sent) || sent > t) return;
    const rtt = t - sent;
    const r = this.rtt;
    r.latestMs = rtt;
    r.minMs = r.minMs === null ? rtt : Math.min(r.minMs, rtt);
    r.smoothedMs = r.smoothedMs === null ? rtt : (r.smoothedMs * 7 + rtt) / 8;
    r.samples++;
  }

  // -------------------------------------------------------------------------------------
  // Timers: heartbeat and dead-link detection

  private startTicker(): void {
    if (this.ticker !== null) clearInterval(this.ticker);
    const liveness = this.opts.livenessMs > 0 ? this.opts.livenessMs : 1000;
    const period = Math.max(
      20,
      Math.min(1000, Math.floor((this.heartbeatMs || 1000) / 4), Math.floor(liveness / 4)),
    );
    const gen = this.gen;
    this.ticker = setInterval(() => {
      if (gen !== this.gen || this._state !== "active") return;
      const t = now();
      if (this.idleTimeoutMs > 0 && t - this.lastRx > this.idleTimeoutMs) {
        this.failLink(CloseCode.idle_timeout, "nothing received within the idle timeout");
        return;
      }
      this.calmDown(t);
      const overdue =
        this.opts.livenessMs > 0 &&
        this.waitingSince !== null &&
        t - this.waitingSince >= this.livenessTimeoutMs;
      if (overdue && !this.livenessSuspect) {
        // After a stall the timer may run before the socket's queued frames are read: give
        // them one tick (a frame resets `waitingSince`).
        this.livenessSuspect = true;
        return;
      }
      this.livenessSuspect = false;
      if (overdue) {
        this.waitingSince = null;
        this.livenessBackoff = Math.min(this.livenessBackoff + 1, LIVENESS_BACKOFF_MAX);
        this.calmSince = null;
        // The URL that went silent is tried last (a dead edge, a black-holed path).
        this.urlIndex = (this.urlIndex + 1) % this.urls.length;
        this.failLink(CloseCode.idle_timeout, "no answer within the liveness timeout");
        return;
      }
      if (this.heartbeatMs > 0 && t - this.lastTx >= this.heartbeatMs) {
        this.transmit({ type: "ping", timestamp: BigInt(Math.floor(t - this.epoch)) });
      }
    }, period);
  }
}

/** A link that dies within this long of its WELCOME backs the next reconnect off. */
const QUICK_LOSS_MS = 1000;

function now(): number {
  return typeof performance !== "undefined" ? performance.now() : Date.now();
}
