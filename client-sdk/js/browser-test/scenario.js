// The in-page half of the Chromium test: drives a WaygateClient against a real edge and
// records what it receives, so the driver (run.mjs) and the Rust test can check
// 0 lost / 0 duplicated / in order across server-side drops. Once every reply and room
// event is in, it joins the channel `world` (CHANNEL_JOIN) and says something there (CHAT),
// expecting JOINED and then its own publication right after the joined position
// (PROTOCOL.md §11.3, §12).
import { WaygateClient } from "../dist/index.js";

const ECHO = 1000;
const ECHO_REPLY = 1001;
const JOIN_ROOM = 1100;
const JOINED = 1101;
const ROOM_SAY = 2000;
const ROOM_EVENT = 2001;
const CHANNEL_JOIN = 1200;
const CHAT = 1202;
const CHANNEL = "world";
const CHAT_TEXT = "hello from the browser";

const decoder = new TextDecoder();
const s = {
  started: false,
  joined: false,
  sentEcho: 0,
  sentSay: 0,
  echo: [], // indexes from ECHO_REPLY payloads, in arrival order
  echoBadPayload: [],
  room: [], // room counters n from ROOM_EVENT, in arrival order
  roomBadPayload: [],
  serverSeqs: [], // seqs of sequenced messages, in arrival order
  events: { connected: 0, newSession: 0, restored: 0, restoredWithGap: 0, disconnectedActive: 0, disconnected: 0, kicked: 0, closed: 0, migrating: 0 },
  errors: [],
  resent: 0,
  log: [],
  closedAt: null,
  connectsAtClose: null,
  // The channel step (after the stream): CHANNEL_JOIN then CHAT on `world`.
  channel: {
    started: false,
    joined: null, // { channel, epoch, offset } of the JOINED for `world`
    publication: null, // { channel, epoch, offset, body } of the CHAT's publication
    expectedBody: null,
    problems: [],
    events: [], // every channel event, in arrival order
  },
};
let client = null;

/** A channel update in JSON-friendly form (offsets are small here: numbers). */
function channelRecord(u) {
  return { kind: u.kind, channel: u.channel, epoch: u.epoch, offset: Number(u.offset), body: decoder.decode(u.body) };
}

/** The publication is the CHAT's: same epoch as JOINED, the next offset, `<player>|<text>`. */
function publicationFollowsJoined() {
  const c = s.channel;
  return (
    c.joined !== null &&
    c.publication !== null &&
    c.publication.epoch === c.joined.epoch &&
    c.publication.offset === c.joined.offset + 1 &&
    c.publication.body === c.expectedBody
  );
}

function channelOk() {
  return publicationFollowsJoined() && s.channel.problems.length === 0;
}

function log(line) {
  s.log.push(`${Math.round(performance.now())} ${line}`);
  if (s.log.length > 200) s.log.shift();
}

window.startScenario = (cfg) => {
  if (s.started) throw new Error("already started");
  s.started = true;
  const { url, token, player, room, echoCount, sayCount, intervalMs } = cfg;
  client = new WaygateClient({ urls: [url], token, backoffMinMs: 50, backoffMaxMs: 1000 });
  window.client = client;
  client.on("connected", (e) => {
    s.events.connected++;
    log(`connected ${e.outcome} ${e.sessionId}`);
  });
  client.on("newSession", () => s.events.newSession++);
  client.on("restored", (e) => {
    s.events.restored++;
    s.resent += e.resent;
  });
  client.on("restoredWithGap", () => s.events.restoredWithGap++);
  client.on("disconnected", (e) => {
    s.events.disconnected++;
    if (e.wasActive) s.events.disconnectedActive++;
    log(`disconnected ${e.label} ${e.reason} reconnect=${e.willReconnect} in ${e.retryInMs}`);
  });
  client.on("kicked", (e) => {
    s.events.kicked++;
    log(`kicked ${e.code} ${e.message}`);
  });
  client.on("closed", (e) => {
    s.events.closed++;
    s.closedAt = performance.now();
    s.connectsAtClose = client.stats().connects;
    log(`closed ${e.label} ${e.reason}`);
  });
  client.on("migrating", () => s.events.migrating++);
  client.on("error", (e) => {
    if (e.kind === "undelivered" && (e.msgId === CHANNEL_JOIN || e.msgId === CHAT)) {
      s.channel.problems.push(`msg ${e.msgId} refused: ${e.code} ${e.label}`);
    }
    s.errors.push({ ...e, clientSeq: e.clientSeq === undefined ? undefined : String(e.clientSeq) });
    log(`error ${JSON.stringify({ ...e, clientSeq: String(e.clientSeq) })}`);
  });
  client.on("channel", (u) => {
    const c = s.channel;
    const r = channelRecord(u);
    c.events.push(r);
    log(`channel ${r.kind} ${r.channel} ${r.epoch}/${r.offset} ${r.body}`);
    if (u.channel !== CHANNEL) {
      c.problems.push(`event on an unexpected channel: ${JSON.stringify(r)}`);
    } else if (u.kind === "joined" && c.joined === null) {
      c.joined = { channel: r.channel, epoch: r.epoch, offset: r.offset };
      client.send(CHAT, `${CHANNEL}|${CHAT_TEXT}`, "normal");
    } else if (u.kind === "publication" && c.joined !== null && c.publication === null) {
      c.publication = { channel: r.channel, epoch: r.epoch, offset: r.offset, body: r.body };
      if (!publicationFollowsJoined()) c.problems.push(`publication ${JSON.stringify(r)} does not follow JOINED ${JSON.stringify(c.joined)}`);
    } else {
      c.problems.push(`unexpected channel event: ${JSON.stringify(r)}`);
    }
  });
  client.on("message", (m) => {
    if (m.seq !== 0n) s.serverSeqs.push(Number(m.seq));
    const text = decoder.decode(m.payload);
    if (m.msgId === ECHO_REPLY) {
      // "<backend id>|<player>|echo-<i>"
      const parts = text.split("|");
      const i = parts[2]?.startsWith("echo-") ? Number(parts[2].slice(5)) : NaN;
      if (parts[1] !== player || !Number.isInteger(i)) s.echoBadPayload.push(text);
      else s.echo.push(i);
    } else if (m.msgId === ROOM_EVENT) {
      // "<instance>|<room>|<n>|<player>|say-<k>"
      const parts = text.split("|");
      const n = Number(parts[2]);
      if (parts[1] !== room || parts[3] !== player || parts[4] !== `say-${n - 1}`) s.roomBadPayload.push(text);
      else s.room.push(n);
    }
    if (m.msgId === ECHO_REPLY || m.msgId === ROOM_EVENT) {
      maybeStartChannel();
    } else if (m.msgId === JOINED) {
      if (!s.joined) {
        s.joined = true;
        log("joined");
        startStream();
      }
    }
  });

  // After the whole stream, so channel events (sequenced DATA too) take the server seqs
  // after the replies' and room events'.
  function maybeStartChannel() {
    if (s.channel.started || s.echo.length < echoCount || s.room.length < sayCount) return;
    s.channel.started = true;
    s.channel.expectedBody = `${player}|${CHAT_TEXT}`;
    log(`channel join ${CHANNEL}`);
    client.send(CHANNEL_JOIN, CHANNEL, "critical");
  }

  function startStream() {
    const timer = setInterval(() => {
      if (s.sentEcho >= echoCount && s.sentSay >= sayCount) {
        clearInterval(timer);
        return;
      }
      if (s.sentEcho < echoCount) {
        client.send(ECHO, `echo-${s.sentEcho}`, "normal");
        s.sentEcho++;
      }
      if (s.sentSay < sayCount && s.sentEcho % 2 === 0) {
        client.send(ROOM_SAY, `${room}|say-${s.sentSay}`, "critical");
        s.sentSay++;
      }
    }, intervalMs);
  }

  client.connect();
  client.send(JOIN_ROOM, room, "critical");
};

window.scenarioState = () => {
  const st = client ? client.stats() : null;
  return {
    joined: s.joined,
    sentEcho: s.sentEcho,
    sentSay: s.sentSay,
    echo: s.echo.length,
    room: s.room.length,
    events: { ...s.events },
    state: st ? st.state : "none",
    unacked: st ? st.unacked : 0,
    lastServerSeq: st ? Number(st.lastServerSeq) : 0,
    rttSamples: st ? st.rtt.samples : 0,
    channelStarted: s.channel.started,
    channelDone: s.channel.publication !== null || s.channel.problems.length > 0,
  };
};

window.scenarioResult = () => {
  const st = client.stats();
  return {
    ...window.scenarioState(),
    echoReceived: s.echo,
    roomReceived: s.room,
    serverSeqs: s.serverSeqs,
    echoBadPayload: s.echoBadPayload,
    roomBadPayload: s.roomBadPayload,
    errors: s.errors,
    resent: s.resent,
    rtt: st.rtt,
    connects: st.connects,
    connectsAtClose: s.connectsAtClose,
    msSinceClosed: s.closedAt === null ? null : performance.now() - s.closedAt,
    channel: {
      ...s.channel,
      ok: channelOk(),
      positions: Object.fromEntries([...client.channelPositions()].map(([k, p]) => [k, { epoch: p.epoch, offset: Number(p.offset) }])),
      duplicates: st.channelDuplicates,
      undecodable: st.channelUndecodable,
    },
    log: s.log,
  };
};

document.getElementById("log").textContent = "ready";
window.scenarioReady = true;
