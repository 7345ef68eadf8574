// The demo page's script: connect, echo, join a room, say something, show what arrives.
import { WaygateClient } from "../dist/index.js";

const $ = (id) => document.getElementById(id);
const decoder = new TextDecoder();
const NAMES = { 1001: "ECHO_REPLY", 1101: "JOINED", 2001: "ROOM_EVENT" };
let client = null;

function log(line) {
  const el = $("log");
  el.textContent += `${new Date().toISOString().slice(11, 23)}  ${line}\n`;
  el.scrollTop = el.scrollHeight;
}

function setEnabled(connected) {
  for (const id of ["send-echo", "join", "send-say", "close"]) $(id).disabled = !connected;
  $("connect").disabled = connected;
}

$("connect").onclick = () => {
  try {
    client = new WaygateClient({ urls: [$("url").value.trim()], token: $("token").value.trim() });
  } catch (e) {
    log(`cannot create the client: ${e.message}`);
    return;
  }
  window.client = client;
  client.on("connected", (e) => {
    $("status").textContent = `connected (${e.outcome})`;
    log(`connected to ${e.url}: ${e.outcome}, session ${e.sessionId}`);
  });
  client.on("restoredWithGap", (e) => log(`restored with a gap up to seq ${e.serverSeqBase}: resync your state`));
  client.on("newSession", (e) => e.restoreFailed && log(`resume failed: new session (${e.discarded} unsent messages discarded)`));
  client.on("disconnected", (e) =>{
    $("status").textContent = e.willReconnect ? "reconnecting..." : "disconnected";
    log(`disconnected (${e.label}: ${e.reason})${e.willReconnect ? `, retrying in ${e.retryInMs} ms` : ""}`);
  });
  client.on("kicked", (e) => log(`kicked: ${e.message}`));
  client.on("migrating", (e) => log(`migrating to ${e.target || "any edge"}`));
  client.on("error", (e) => log(`error: ${JSON.stringify(e, (_, v) => (typeof v === "bigint" ? String(v) : v))}`));
  client.on("closed", (e) => {
    $("status").textContent = `closed (${e.label})`;
    setEnabled(false);
  });
  client.on("message", (m) => log(`<- ${NAMES[m.msgId] ?? m.msgId} #${m.seq}: ${decoder.decode(m.payload)}`));
  client.connect();
  setEnabled(true);
  setInterval(() => {
    if (client && client.state === "connected") {
      const { rtt, unacked } = client.stats();
      $("status").textContent = `connected, rtt ${rtt.smoothedMs === null ? "?" : rtt.smoothedMs.toFixed(1)} ms, ${unacked} unacked`;
    }
  }, 1000);
};

$("close").onclick = () => client?.close();
$("send-echo").onclick = () => log(`-> ECHO seq ${client.send(1000, $("echo").value)}`);
$("join").onclick = () => log(`-> JOIN_ROOM seq ${client.send(1100, $("room").value, "critical")}`);
$("send-say").onclick = () => log(`-> ROOM_SAY seq ${client.send(2000, `${$("room").value}|${$("say").value}`, "critical")}`);
