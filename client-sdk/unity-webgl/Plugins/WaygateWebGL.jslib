// WaygateWebGL.jslib: the Unity WebGL bridge to the waygate JS SDK (@waygate/client).
//
// A handle-based, poll-driven API mirroring the C ABI (client-sdk/capi/include/waygate.h):
// C# creates a client from an options JSON and gets an int handle, sends with a result code
// (the waygate_result values), and polls events from Update() on the main thread. Nothing
// ever calls into C#: the SDK's events are turned into UTF-8 JSON strings and buffered per
// handle in a bounded queue; when it overflows, the events that did not fit are counted and
// reported by an `eventsDropped` event at the place they were lost (never silently).
//
// The SDK itself is not in this file: it is expected on the page as the global `Waygate`
// (client-sdk/js `dist/global.js`, see ../README.md). Create fails with a clear error when
// it is missing.
//
// Emscripten stringifies every function below into the build's JS, so they must not close
// over anything in this file: shared state lives in `$WG` and the helpers are `$WG_*`
// library items (listed as __deps of every function at the bottom). Written as ES5 (var,
// function, no arrows, template strings or BigInt literals) for the older Emscripten
// toolchains Unity ships, with quoted keys and bracket access for everything that crosses to
// the SDK or into JSON, so that a Closure-compiled build keeps those names.
//
// Result codes (waygate_result): 0 OK, 1 NO_EVENT, 2 INVALID_ARGUMENT, 3 INVALID_STATE,
// 4 CLOSED, 5 BUFFER_FULL, 6 DROPPED, 7 INTERNAL, 8 PANIC (a JS exception caught at the
// boundary: a bug), 9 NOT_FOUND. Functions that return a length or a handle return a
// negative result code on failure. WaygateWebGL_LastError says why the last call failed.
//
// Connection state codes (WaygateWebGL_State): 0 idle, 1 connecting, 2 connected,
// 3 reconnecting, 4 closed, 5 paused (the JS SDK's `client.state` names; the C ABI's
// WAYGATE_STATE_* numbers).
//
// Requests (PROTOCOL.md §13): WaygateWebGL_Request / WaygateWebGL_SyncClock return the
// request id at once (> 0; a negative result code when it was not sent); its one outcome
// comes through the poll queue as an `answer` (requestId, status, payload) or a
// `requestFailed` (requestId, reason, code, label, retryAfterMs, message) event, the C ABI's
// WAYGATE_EVENT_ANSWER and WAYGATE_EVENT_REQUEST_FAILED. Those are never dropped from a full
// queue (each request has exactly one). WaygateWebGL_ClockOffset: the clock estimate.

var WaygateWebGLLibrary = {
  // Shared state: clients by handle (records built by WaygateWebGL_Create), the next handle,
  // and the text of the last failure. Emscripten may write this object with quoted keys, so
  // it is only ever read with brackets (Closure renames dotted names, never quoted ones).
  $WG: { clients: {}, next: 1, lastError: "" },

  // Records why a call failed; returns `code`.
  $WG_fail: function (code, message) {
    WG["lastError"] = String(message);
    return code;
  },

  // The client record of `handle`, or null (after setting the error).
  $WG_get: function (handle) {
    var rec = WG["clients"][handle];
    if (!rec) {
      WG["lastError"] = "unknown waygate handle " + handle;
      return null;
    }
    return rec;
  },

  // The SDK namespace on the page (`window.Waygate`), or null.
  $WG_sdk: function () {
    var g = typeof globalThis !== "undefined" ? globalThis : typeof window !== "undefined" ? window : self;
    var sdk = g["Waygate"];
    return sdk && typeof sdk["WaygateClient"] === "function" ? sdk : null;
  },

  // Base64 (standard alphabet, padded) of a Uint8Array.
  $WG_base64: function (bytes) {
    var s = "";
    for (var i = 0; i < bytes.length; i += 0x8000) {
      s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(s);
  },

  // A flat object as JSON text: strings, numbers, booleans, null and BigInts (written as
  // exact integer literals: seqs and offsets are u64).
  $WG_json: function (fields) {
    var parts = [];
    for (var k in fields) {
      if (!Object.prototype.hasOwnProperty.call(fields, k)) continue;
      var v = fields[k];
      var t = typeof v;
      var s;
      if (v === null || v === undefined) s = "null";
      else if (t === "bigint") s = v.toString();
      else if (t === "number") s = isFinite(v) ? String(v) : "null";
      else if (t === "boolean") s = v ? "true" : "false";
      else s = JSON.stringify(String(v));
      parts.push(JSON.stringify(k) + ":" + s);
    }
    return "{" + parts.join(",") + "}";
  },

  // One SDK event as the flat object C# gets: `kind` is the SDK's event name; a nested
  // `kind` (channel, error) becomes `channelKind` / `errorKind`; bytes (payload, body)
  // become `payload` in base64; a traffic class becomes `trafficClass` 0/1/2 (WAYGATE_CLASS_*).
  $WG_flatten: function (name, ev) {
    var out = { "kind": name };
    for (var k in ev) {
      if (!Object.prototype.hasOwnProperty.call(ev, k)) continue;
      var v = ev[k];
      if (k === "kind") out[name === "channel" ? "channelKind" : "errorKind"] = v;
      else if (v instanceof Uint8Array) out["payload"] = WG_base64(v);
      else if (k === "cls") out["trafficClass"] = v === "critical" ? 0 : v === "normal" ? 1 : 2;
      else out[k] = v;
    }
    return out;
  },

  // Queues one event's JSON on `rec`. At most `limit` events wait; beyond that they are
  // dropped and counted, and an `eventsDropped` event takes their place once there is room
  // (or once the queue has drained). Terminal events (`closed`, `kicked`, the change to the
  // `closed` state) are always kept, after the pending `eventsDropped`.
  $WG_push: function (rec, json, keep) {
    if (rec.pendingDropped > 0 && (keep || rec.queue.length + 1 < rec.limit)) WG_flushDropped(rec);
    if (!keep && rec.queue.length >= rec.limit) {
      rec.pendingDropped++;
      rec.droppedTotal++;
      return;
    }
    rec.queue.push(json);
  },

  $WG_flushDropped: function (rec) {
    rec.queue.push(WG_json({ "kind": "eventsDropped", "count": rec.pendingDropped, "totalDropped": rec.droppedTotal }));
    rec.pendingDropped = 0;
  },

  // Writes `str` as NUL-terminated UTF-8 at `ptr` (`len` bytes there). Returns the bytes
  // written without the NUL (below `len`), or, when it does not fit, the bytes needed with
  // the NUL (above `len`; nothing written). A NULL `ptr` is a size query: the bytes needed.
  $WG_write: function (str, ptr, len) {
    var need = lengthBytesUTF8(str) + 1;
    if (!ptr || need > len) return need;
    stringToUTF8(str, ptr, len);
    return need - 1;
  },

  // A copy of `len` bytes at `ptr` (the heap may move on the next allocation).
  $WG_bytes: function (ptr, len) {
    if (!len) return new Uint8Array(0);
    return HEAPU8.slice(ptr, ptr + len);
  },

  $WG_states: ["idle", "connecting", "connected", "reconnecting", "closed", "paused"],

  // Starts a request on `rec` with `start(client)` (the SDK's startRequest or
  // startSyncClock): its id, or a negative result code with the reason.
  $WG_startRequest: function (rec, start) {
    if (rec.ended) return -WG_fail(4, "the client is closed");
    if (!rec.connected) return -WG_fail(3, "call WaygateWebGL_Connect first");
    try {
      var id = start(rec.client);
      if (typeof id !== "number" || !(id > 0)) return -WG_fail(8, "bug in the waygate bridge: request id " + id);
      return id;
    } catch (e) {
      var reason = e && e["reason"];
      var message = e && e.message ? e.message : String(e);
      if (reason === "buffer_full") return -WG_fail(5, message);
      if (reason === "closed") return -WG_fail(4, message);
      if (reason === "not_sequenced" || reason === "too_large" || (e && e.name === "RangeError")) return -WG_fail(2, message);
      return -WG_fail(8, "bug in the waygate bridge: " + (e && e.stack ? e.stack : e));
    }
  },

  // ---------------------------------------------------------------------------------------
  // The API (C# declares these with [DllImport("__Internal")]).

  // Creates a client from options JSON (UTF-8): the JS SDK's ClientOptions that fit in JSON
  // (`urls`: an array or a comma-separated string; `token`: base64url text; backoffMinMs,
  // backoffMaxMs, handshakeTimeoutMs, ackDelayMs, ackEvery, maxUnacked, livenessMs,
  // giveUpAfterMs (0 = never, like C's give_up_after_ms), maxOfflineAgeMs, lifecycleHooks,
  // offerSubprotocol), plus the bridge's `maxQueuedEvents` (default 4096). Unknown keys are
  // refused. Returns the handle (>= 1), or 0 (see WaygateWebGL_LastError).
  WaygateWebGL_Create: function (optionsPtr) {
    try {
      var text = optionsPtr ? UTF8ToString(optionsPtr) : "";
      var o;
      try {
        o = JSON.parse(text);
      } catch (e) {
        WG_fail(2, "options are not JSON: " + e.message);
        return 0;
      }
      if (o === null || typeof o !== "object" || Array.isArray(o)) {
        WG_fail(2, "options must be a JSON object");
        return 0;
      }
      var sdk = WG_sdk();
      if (!sdk) {
        WG_fail(7, "the waygate JS SDK is not on the page: load @waygate/client's dist/global.js (window.Waygate) before creating a client");
        return 0;
      }
      var numbers = ["backoffMinMs", "backoffMaxMs", "handshakeTimeoutMs", "ackDelayMs", "ackEvery", "maxUnacked", "livenessMs", "giveUpAfterMs", "maxOfflineAgeMs"];
      var flags = ["lifecycleHooks", "offerSubprotocol"];
      var opts = {};
      var limit = 4096;
      for (var k in o) {
        if (!Object.prototype.hasOwnProperty.call(o, k)) continue;
        var v = o[k];
        if (k === "urls") {
          var urls = typeof v === "string" ? v.split(",") : v;
          if (!Array.isArray(urls)) {
            WG_fail(2, "urls must be an array of strings or a comma-separated string");
            return 0;
          }
          var list = [];
          for (var i = 0; i < urls.length; i++) {
            if (typeof urls[i] !== "string") {
              WG_fail(2, "urls must be strings");
              return 0;
            }
            var u = urls[i].trim();
            if (u) list.push(u);
          }
          opts["urls"] = list;
        } else if (k === "token") {
          if (typeof v !== "string") {
            WG_fail(2, "token must be base64url text");
            return 0;
          }
          opts["token"] = v;
        } else if (k === "maxQueuedEvents") {
          if (typeof v !== "number" || !(v >= 2) || Math.floor(v) !== v) {
            WG_fail(2, "maxQueuedEvents must be an integer >= 2");
            return 0;
          }
          limit = v;
        } else if (numbers.indexOf(k) >= 0) {
          if (typeof v !== "number" || !isFinite(v) || v < 0) {
            WG_fail(2, k + " must be a number >= 0");
            return 0;
          }
          if (k === "giveUpAfterMs" && v === 0) continue; // 0: never give up (C's default)
          opts[k] = v;
        } else if (flags.indexOf(k) >= 0) {
          if (typeof v !== "boolean") {
            WG_fail(2, k + " must be true or false");
            return 0;
          }
          opts[k] = v;
        } else {
          WG_fail(2, "unknown option " + JSON.stringify(k));
          return 0;
        }
      }
      if (!opts["urls"] || opts["urls"].length === 0) {
        WG_fail(2, "urls is required");
        return 0;
      }
      if (!("token" in opts)) opts["token"] = "";
      var client;
      try {
        client = new sdk["WaygateClient"](opts);
      } catch (e) {
        WG_fail(2, e && e.message ? e.message : String(e));
        return 0;
      }
      var rec = {
        client: client,
        queue: [],
        limit: limit,
        pendingDropped: 0,
        droppedTotal: 0,
        connected: false,
        ended: false,
        lastSeq: 0,
      };
      var names = ["stateChange", "connected", "newSession", "restored", "restoredWithGap", "expired", "connectFailed", "disconnected", "kicked", "migrating", "message", "channel", "error", "closed", "answer", "requestFailed"];
      var listen = function (name) {
        client["on"](name, function (ev) {
          if (name === "closed") rec.ended = true;
          // Terminal events, and every request's one outcome, are never dropped.
          var keep = name === "closed" || name === "kicked" || name === "answer" || name === "requestFailed" || (name === "stateChange" && ev["to"] === "closed");
          WG_push(rec, WG_json(WG_flatten(name, ev)), keep);
        });
      };
      for (var n = 0; n < names.length; n++) listen(names[n]);
      var handle = WG["next"]++;
      WG["clients"][handle] = rec;
      return handle;
    } catch (e) {
      WG_fail(8, "bug in the waygate bridge: " + (e && e.stack ? e.stack : e));
      return 0;
    }
  },

  // Starts connecting. INVALID_STATE when called twice, CLOSED after the client ended.
  WaygateWebGL_Connect: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (rec.connected) return WG_fail(3, "WaygateWebGL_Connect was already called");
    try {
      rec.connected = true;
      rec.client["connect"]();
      return 0;
    } catch (e) {
      return WG_fail(8, "bug in the waygate bridge: " + e);
    }
  },

  // Sends `len` bytes at `ptr` (copied) as message `msgId` of class `cls` (0 critical,
  // 1 normal, 2 best-effort). OK; BUFFER_FULL; DROPPED (best-effort while no link is up);
  // INVALID_ARGUMENT (class, frame too large); INVALID_STATE before Connect; CLOSED.
  // The message's client seq: WaygateWebGL_LastSeq.
  WaygateWebGL_Send: function (handle, cls, msgId, ptr, len) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (!rec.connected) return WG_fail(3, "call WaygateWebGL_Connect first");
    var name = cls === 0 ? "critical" : cls === 1 ? "normal" : cls === 2 ? "bestEffort" : null;
    if (name === null) return WG_fail(2, "unknown traffic class " + cls);
    if (len < 0 || (len > 0 && !ptr)) return WG_fail(2, "bad payload pointer or length");
    try {
      var seq = rec.client["send"](msgId >>> 0, WG_bytes(ptr, len), name);
      if (seq === null) return WG_fail(6, "best-effort message dropped: no link is up");
      rec.lastSeq = Number(seq);
      return 0;
    } catch (e) {
      var reason = e && e["reason"];
      if (reason === "buffer_full") return WG_fail(5, e.message);
      if (reason === "closed") return WG_fail(4, e.message);
      if (reason === "too_large" || (e && e.name === "RangeError")) return WG_fail(2, e.message);
      return WG_fail(8, "bug in the waygate bridge: " + e);
    }
  },

  // Sends a request (PROTOCOL.md §13) of class `cls` (0 critical, 1 normal) to `msgId` with
  // `len` bytes at `ptr` (copied) as its body, failing with `timeout` after `timeoutMs`
  // (unsigned; 0 fails at once). Returns the request id (> 0); its outcome comes as one
  // `answer` or `requestFailed` event with that id. On failure a negative result code:
  // -5 BUFFER_FULL; -2 INVALID_ARGUMENT (best-effort or unknown class, body too large for a
  // frame, bad pointer); -3 INVALID_STATE before Connect; -4 CLOSED; -2 for an unknown handle.
  WaygateWebGL_Request: function (handle, cls, msgId, ptr, len, timeoutMs) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    if (rec.ended) return -WG_fail(4, "the client is closed");
    if (!rec.connected) return -WG_fail(3, "call WaygateWebGL_Connect first");
    if (cls !== 0 && cls !== 1) {
      return -WG_fail(2, cls === 2 ? "a request must be critical (0) or normal (1), not best-effort" : "unknown traffic class " + cls);
    }
    if (len < 0 || (len > 0 && !ptr)) return -WG_fail(2, "bad body pointer or length");
    var body = WG_bytes(ptr, len);
    return WG_startRequest(rec, function (client) {
      return client["startRequest"](msgId >>> 0, body, { "cls": cls === 0 ? "critical" : "normal", "timeoutMs": timeoutMs >>> 0 });
    });
  },

  // Takes a sample of the game server's clock: a critical request with an empty body to
  // `msgId` (the demo's TIME, 1010), answered with the server's Unix ms (u64 big-endian).
  // Returns the request id, or a negative result code as WaygateWebGL_Request. When its
  // `answer` event comes, WaygateWebGL_ClockOffset has the updated estimate; an answer that
  // is not a clock is a `requestFailed` with reason `bad_answer`.
  WaygateWebGL_SyncClock: function (handle, msgId, timeoutMs) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    return WG_startRequest(rec, function (client) {
      return client["startSyncClock"](msgId >>> 0, timeoutMs >>> 0);
    });
  },

  // The game server's clock offset estimate, ms (server time = local Unix time + offset;
  // a double, possibly fractional), or NaN before the first clock sample was answered (and
  // for an unknown handle). The round trip it rests on: WaygateWebGL_Stats' clockRttMs.
  WaygateWebGL_ClockOffset: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return NaN;
    var offset = rec.client["clockOffset"];
    return typeof offset === "number" ? offset : NaN;
  },

  // The client seq of the last message WaygateWebGL_Send accepted on this handle (0 for
  // best-effort; exact below 2^53). -2 for an unknown handle.
  WaygateWebGL_LastSeq: function (handle) {
    var rec = WG_get(handle);
    return rec ? rec.lastSeq : -2;
  },

  // Takes the next event as NUL-terminated UTF-8 JSON into `buf` (`len` bytes). Returns
  // 0 when no event is ready; n with 0 < n < len: an event of n bytes was written;
  // n > len: the buffer is too small, nothing was taken, call again with at least n bytes;
  // -3 (INVALID_STATE) before Connect; -4 (CLOSED) once the client ended and every event
  // was taken; -2 for an unknown handle.
  WaygateWebGL_Poll: function (handle, buf, len) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    if (rec.queue.length === 0 && rec.pendingDropped > 0) WG_flushDropped(rec);
    if (rec.queue.length === 0) {
      if (rec.ended) return -WG_fail(4, "the client is closed");
      if (!rec.connected) return -WG_fail(3, "call WaygateWebGL_Connect first");
      return 0;
    }
    var cap = buf ? len : 0; // no buffer: a size query
    var n = WG_write(rec.queue[0], buf, cap);
    if (n < cap) rec.queue.shift();
    return n;
  },

  // Events waiting in the handle's queue (a pending `eventsDropped` counts as one).
  WaygateWebGL_Pending: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    return rec.queue.length + (rec.pendingDropped > 0 ? 1 : 0);
  },

  // The connection state code: 0 idle, 1 connecting, 2 connected, 3 reconnecting,
  // 4 closed, 5 paused; -2 for an unknown handle.
  WaygateWebGL_State: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    var i = WG_states.indexOf(rec.client["state"]);
    return i >= 0 ? i : -8;
  },

  // Drops the link as a network failure would (a drill): the client resumes at once.
  WaygateWebGL_DropLink: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (!rec.connected) return WG_fail(3, "call WaygateWebGL_Connect first");
    rec.client["dropLink"]();
    return 0;
  },

  // Drops the current link even if it looks alive and reconnects at once (the session
  // resumes): for "back from the background" or a network change.
  WaygateWebGL_ReconnectNow: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (!rec.connected) return WG_fail(3, "call WaygateWebGL_Connect first");
    rec.client["reconnectNow"]();
    return 0;
  },

  // Pauses the client (OnApplicationPause(true)): the link closes, the session lingers on
  // the edge, no socket until WaygateWebGL_ReconnectNow.
  WaygateWebGL_Pause: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (!rec.connected) return WG_fail(3, "call WaygateWebGL_Connect first");
    rec.client["pause"]();
    return 0;
  },

  // Replaces the auth token (raw bytes, `len` at `ptr`, copied) for the next HELLO.
  WaygateWebGL_SetToken: function (handle, ptr, len) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    if (len < 0 || (len > 0 && !ptr)) return WG_fail(2, "bad token pointer or length");
    if (rec.ended) return WG_fail(4, "the client is closed");
    if (!rec.connected) return WG_fail(3, "set the token in the options before WaygateWebGL_Connect");
    rec.client["setToken"](WG_bytes(ptr, len));
    return 0;
  },

  // Closes the session (CLOSE normal): a `closed` event follows, then polls return -4.
  // Closing twice, or before Connect, is fine.
  WaygateWebGL_Close: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    rec.client["close"]();
    return 0;
  },

  // Ends the session for good (CLOSE logout, PROTOCOL.md §7.5): the edge ends it at once
  // instead of letting it linger; a `closed` event (code 2) follows, as for Close. 3 (invalid
  // state): no session was up on a socket, or the client had ended (it lingers out).
  WaygateWebGL_Logout: function (handle) {
    var rec = WG_get(handle);
    if (!rec) return 2;
    return rec.client["logout"]() ? 0 : 3;
  },

  // Releases the handle (closing the session if it is still open): it must not be used
  // again. Unknown handles are ignored.
  WaygateWebGL_Free: function (handle) {
    var rec = WG["clients"][handle];
    if (!rec) return;
    delete WG["clients"][handle];
    try {
      rec.client["close"]();
    } catch (e) {
      // Already closed.
    }
    rec.queue = [];
  },

  // Live statistics as JSON into `buf`, with WaygateWebGL_Poll's length convention: state,
  // rttLatestMs, rttSmoothedMs, rttMinMs (null before a sample), rttSamples, unacked,
  // lastServerSeq, connects, sessionId (hex or null), queuedEvents, droppedEvents,
  // requestsPending, clockOffsetMs, clockRttMs (null before a clock sample), clockSamples.
  WaygateWebGL_Stats: function (handle, buf, len) {
    var rec = WG_get(handle);
    if (!rec) return -2;
    var s = rec.client["stats"]();
    var rtt = s["rtt"];
    var clock = s["clock"] || null;
    return WG_write(
      WG_json({
        "state": s["state"],
        "rttLatestMs": rtt["latestMs"],
        "rttSmoothedMs": rtt["smoothedMs"],
        "rttMinMs": rtt["minMs"],
        "rttSamples": rtt["samples"],
        "unacked": s["unacked"],
        "lastServerSeq": s["lastServerSeq"],
        "connects": s["connects"],
        "sessionId": s["sessionId"],
        "queuedEvents": rec.queue.length,
        "droppedEvents": rec.droppedTotal,
        "requestsPending": s["requestsPending"],
        "clockOffsetMs": clock ? clock["offsetMs"] : null,
        "clockRttMs": clock ? clock["rttMs"] : null,
        "clockSamples": clock ? clock["samples"] : 0,
      }),
      buf,
      len
    );
  },

  // Why the last failed call failed ("" if none), with WaygateWebGL_Poll's length
  // convention (an empty message returns 0).
  WaygateWebGL_LastError: function (buf, len) {
    return WG_write(WG["lastError"], buf, len);
  },
};

// Every item may use every helper: list the $ items as dependencies of all the others.
(function () {
  var lib = WaygateWebGLLibrary;
  var keys = Object.keys(lib);
  var helpers = keys.filter(function (k) {
    return k.charAt(0) === "$";
  });
  keys.forEach(function (k) {
    lib[k + "__deps"] = helpers.filter(function (h) {
      return h !== k;
    });
  });
})();

mergeInto(LibraryManager.library, WaygateWebGLLibrary);
