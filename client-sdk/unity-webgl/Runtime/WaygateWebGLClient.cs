// WaygateWebGLClient.cs: the C# side of the Unity WebGL bridge (Plugins/WaygateWebGL.jslib),
// which wraps the waygate JS SDK (@waygate/client) running in the page. A WebGL player
// cannot use the native library of Waygate.cs (no sockets in the browser): this file is the
// WebGL counterpart, with the same poll-driven shape and the same result codes.
//
//     var client = new WaygateWebGLClient(new WaygateWebGLOptions {
//         Urls = new[] { "wss://edge.example.com/" }, Token = tokenBase64Url });
//     client.Connect();
//     // every frame (Update()):
//     WebGLEvent ev;
//     while (client.Poll(out ev)) { /* switch (ev.Kind) ... */ }
//     client.Send(WebGLTrafficClass.Normal, 1000, body);
//     uint id;
//     client.Request(WebGLTrafficClass.Normal, 1011, body, 10000, out id);
//     // ... later, an Answer (ev.RequestId == id, ev.Status, ev.Payload) or a
//     // RequestFailed (ev.RequestId, ev.Failure, ev.Code, ev.RetryAfterMs) event.
//     // when done (OnDestroy()):
//     client.Dispose();            // closes the session and frees the handle
//
// Nothing calls back into C#: events wait in the JS side's bounded queue until Poll() takes
// them, on the main thread. When that queue overflows (Poll() not called for a long time),
// the events that did not fit are reported by an EventsDropped event where they were lost.
//
// The types are prefixed WebGL (namespace Waygate.WebGL) so this file can sit beside
// Waygate.cs in a project that also builds native players.
//
// In the Editor and in non-WebGL players the native calls throw PlatformNotSupportedException
// (WaygateWebGLClient.IsSupported is false there). Compiles with mcs (C# 6 level, no unsafe
// code).

using System;
using System.Collections.Generic;
using System.Globalization;
using System.Runtime.InteropServices;
using System.Text;

namespace Waygate.WebGL
{
    /// <summary>What a call returned: the C ABI's <c>waygate_result</c> values.</summary>
    public enum WebGLResult
    {
        /// <summary>Success.</summary>
        Ok = 0,
        /// <summary>No event is ready.</summary>
        NoEvent = 1,
        /// <summary>An unknown handle or traffic class, an option that does not parse, a frame too large.</summary>
        InvalidArgument = 2,
        /// <summary>Not valid now: sending or polling before Connect(), connecting twice.</summary>
        InvalidState = 3,
        /// <summary>The client has ended (closed, kicked, expired, token refused, gave up).</summary>
        Closed = 4,
        /// <summary>Too many sent-but-unacked messages: keep polling and send again later.</summary>
        BufferFull = 5,
        /// <summary>A best-effort message was dropped because no link is up.</summary>
        Dropped = 6,
        /// <summary>The JS SDK is not on the page, or another failure outside the bridge.</summary>
        Internal = 7,
        /// <summary>A JS exception was caught at the boundary: a bug in the bridge.</summary>
        Panic = 8,
        /// <summary>What was asked for does not exist.</summary>
        NotFound = 9,
    }

    /// <summary>Traffic classes: the C ABI's <c>WAYGATE_CLASS_*</c>.</summary>
    public enum WebGLTrafficClass : byte
    {
        /// <summary>Never dropped; sequenced, acked and resent after a resume.</summary>
        Critical = 0,
        /// <summary>Sequenced, acked and resent after a resume; may be slowed under overload.</summary>
        Normal = 1,
        /// <summary>Not sequenced, never resent, dropped first.</summary>
        BestEffort = 2,
    }

    /// <summary>The connection state: the JS SDK's <c>client.state</c> ("idle", "connecting", ...).</summary>
    public enum WebGLConnectionState
    {
        /// <summary>Created, Connect() not called yet.</summary>
        Idle = 0,
        /// <summary>The first session is not up yet.</summary>
        Connecting = 1,
        /// <summary>A session is up.</summary>
        Connected = 2,
        /// <summary>A session was up and the link dropped: trying to resume.</summary>
        Reconnecting = 3,
        /// <summary>Terminal.</summary>
        Closed = 4,
        /// <summary>Paused by Pause(): no link until ReconnectNow().</summary>
        Paused = 5,
    }

    /// <summary>How a HELLO was answered ("new_session", "restored", ...); the WELCOME outcome codes.</summary>
    public enum WebGLSessionOutcome
    {
        /// <summary>Not a <c>connected</c> event.</summary>
        None = -1,
        /// <summary>A fresh session.</summary>
        NewSession = 0,
        /// <summary>The session resumed with nothing lost.</summary>
        Restored = 1,
        /// <summary>Resumed, but downstream messages were evicted: resync your game state.</summary>
        RestoredWithGap = 2,
        /// <summary>The resume was refused and a new session started: resync your game state.</summary>
        RestoreFailedNewSession = 3,
    }

    /// <summary>What happened: the JS SDK's event names (<see cref="WebGLEvent.KindName"/>).</summary>
    public enum WebGLEventKind
    {
        /// <summary>An event this file does not know (a newer bridge): see KindName and Json.</summary>
        Unknown = 0,
        /// <summary>"stateChange": From, To.</summary>
        StateChange,
        /// <summary>"connected" (every WELCOME): Url, SessionId, Outcome.</summary>
        Connected,
        /// <summary>"newSession": SessionId, RestoreFailed, Discarded (unacked messages of the old session).</summary>
        NewSession,
        /// <summary>"restored": SessionId, Resent.</summary>
        Restored,
        /// <summary>"restoredWithGap": SessionId, ServerSeqBase, Resent. Resync your game state.</summary>
        RestoredWithGap,
        /// <summary>"expired": a message queued offline for longer than MaxOfflineAgeMs was dropped. MsgId, Seq, AgeMs.</summary>
        Expired,
        /// <summary>"connectFailed": Url, Reason, Attempt.</summary>
        ConnectFailed,
        /// <summary>"disconnected": Code, Label, Reason, WasActive, WillReconnect, RetryInMs.</summary>
        Disconnected,
        /// <summary>"kicked" (terminal): Code, Message.</summary>
        Kicked,
        /// <summary>"migrating": Target, DeadlineMs.</summary>
        Migrating,
        /// <summary>"message": MsgId, TrafficClass, Seq (0 for best-effort), Payload.</summary>
        Message,
        /// <summary>"channel": ChannelKind ("publication", "joined", "left", "historyLost"), Channel, Epoch, Offset, Payload.</summary>
        Channel,
        /// <summary>"error": ErrorKind ("undelivered", "rejected", "protocol"), Code, Label, MsgId, ClientSeq, RetryAfterMs, Message.</summary>
        Error,
        /// <summary>"closed" (terminal): Code, Label, Reason.</summary>
        Closed,
        /// <summary>"eventsDropped": Count events did not fit in the queue here (TotalDropped so far).</summary>
        EventsDropped,
        /// <summary>"answer": the answer to a request (Request, SyncClock): RequestId, Status (0 or the game server's code), Payload. The C ABI's WAYGATE_EVENT_ANSWER.</summary>
        Answer,
        /// <summary>"requestFailed": a request has no answer: RequestId, Failure (Reason has its name), and Code, Label, RetryAfterMs when refused. The C ABI's WAYGATE_EVENT_REQUEST_FAILED.</summary>
        RequestFailed,
    }

    /// <summary>Why a request has no answer (<see cref="WebGLEvent.Failure"/>; the name is in <see cref="WebGLEvent.Reason"/>).</summary>
    public enum WebGLRequestFailure
    {
        /// <summary>Not a requestFailed event.</summary>
        None = 0,
        /// <summary>"timeout": no answer within the timeout (a later answer is dropped).</summary>
        Timeout,
        /// <summary>"refused": the edge or the game server refused it (Code, Label, RetryAfterMs).</summary>
        Refused,
        /// <summary>"expired": queued offline longer than MaxOfflineAgeMs: never sent.</summary>
        Expired,
        /// <summary>"session_lost": the session it was sent in was replaced by a new one: it may or may not have reached the game server.</summary>
        SessionLost,
        /// <summary>"closed": the client ended first.</summary>
        Closed,
        /// <summary>"bad_answer": a clock sample answered with something else than status 0 and 8 bytes of Unix ms.</summary>
        BadAnswer,
        /// <summary>A reason this file does not know (a newer bridge): see Reason.</summary>
        Other,
    }

    /// <summary>A failed call: the result code and the bridge's explanation.</summary>
    public class WebGLException : Exception
    {
        /// <summary>The result code of the failed call.</summary>
        public WebGLResult Result { get; private set; }

        /// <summary>The bridge's text for the failure (WaygateWebGL_LastError), "" if none.</summary>
        public string Detail { get; private set; }

        /// <summary>A failure of <paramref name="operation"/>.</summary>
        public WebGLException(string operation, WebGLResult result, string detail)
            : base(operation + ": " + result + (string.IsNullOrEmpty(detail) ? "" : ": " + detail))
        {
            Result = result;
            Detail = detail ?? "";
        }
    }

    /// <summary>
    /// How to connect: the JS SDK's options. Only Urls and Token are required; a null field
    /// takes the SDK's default.
    /// </summary>
    public sealed class WaygateWebGLOptions
    {
        /// <summary>Edge WebSocket URLs (ws:// or wss://), tried in order.</summary>
        public string[] Urls;
        /// <summary>The auth token from the login service as base64url text (or set TokenBytes).</summary>
        public string Token;
        /// <summary>The auth token as bytes (used when Token is null).</summary>
        public byte[] TokenBytes;
        /// <summary>First reconnect delay cap, ms (default 100).</summary>
        public int? BackoffMinMs;
        /// <summary>Largest reconnect delay cap, ms (default 5000).</summary>
        public int? BackoffMaxMs;
        /// <summary>Socket open to WELCOME, ms (default 10000).</summary>
        public int? HandshakeTimeoutMs;
        /// <summary>Delay of a standalone ACK, ms (default 20).</summary>
        public int? AckDelayMs;
        /// <summary>ACK at once after this many messages (default 16).</summary>
        public int? AckEvery;
        /// <summary>Most unacked messages kept for resending (default 4096); beyond it Send returns BufferFull.</summary>
        public int? MaxUnacked;
        /// <summary>A link with a message or PING unanswered this long is dead, ms (default 1000; 0 = off).</summary>
        public int? LivenessMs;
        /// <summary>Give up after this long without a session, ms: Closed with code 403 (default 0: never).</summary>
        public int? GiveUpAfterMs;
        /// <summary>Messages queued offline longer than this are dropped on a resume (an Expired event), ms (default 0: no bound).</summary>
        public int? MaxOfflineAgeMs;
        /// <summary>The browser's online/visibilitychange hooks (default true).</summary>
        public bool? LifecycleHooks;
        /// <summary>Offer the waygate.v1 subprotocol (default true).</summary>
        public bool? OfferSubprotocol;
        /// <summary>Events kept waiting for Poll() (default 4096, at least 2); beyond it they are counted and reported by EventsDropped.</summary>
        public int? MaxQueuedEvents;

        /// <summary>The options JSON WaygateWebGL_Create takes.</summary>
        public string ToJson()
        {
            if (Urls == null || Urls.Length == 0) throw new ArgumentException("Urls is required");
            var sb = new StringBuilder("{\"urls\":[");
            for (int i = 0; i < Urls.Length; i++)
            {
                if (i > 0) sb.Append(',');
                Json.Quote(sb, Urls[i] ?? "");
            }
            sb.Append("],\"token\":");
            Json.Quote(sb, Token ?? (TokenBytes != null ? Base64Url.Encode(TokenBytes) : ""));
            Num(sb, "backoffMinMs", BackoffMinMs);
            Num(sb, "backoffMaxMs", BackoffMaxMs);
            Num(sb, "handshakeTimeoutMs", HandshakeTimeoutMs);
            Num(sb, "ackDelayMs", AckDelayMs);
            Num(sb, "ackEvery", AckEvery);
            Num(sb, "maxUnacked", MaxUnacked);
            Num(sb, "livenessMs", LivenessMs);
            Num(sb, "giveUpAfterMs", GiveUpAfterMs);
            Num(sb, "maxOfflineAgeMs", MaxOfflineAgeMs);
            Num(sb, "maxQueuedEvents", MaxQueuedEvents);
            Flag(sb, "lifecycleHooks", LifecycleHooks);
            Flag(sb, "offerSubprotocol", OfferSubprotocol);
            return sb.Append('}').ToString();
        }

        static void Num(StringBuilder sb, string key, int? v)
        {
            if (v.HasValue) sb.Append(",\"").Append(key).Append("\":").Append(v.Value.ToString(CultureInfo.InvariantCulture));
        }

        static void Flag(StringBuilder sb, string key, bool? v)
        {
            if (v.HasValue) sb.Append(",\"").Append(key).Append("\":").Append(v.Value ? "true" : "false");
        }
    }

    /// <summary>
    /// One event, parsed from the bridge's flat JSON. The typed properties read the fields of
    /// their kinds (see <see cref="WebGLEventKind"/>) and are 0 / null / false elsewhere;
    /// <see cref="GetString"/> and friends read any field; <see cref="Json"/> is the raw text.
    /// </summary>
    public sealed class WebGLEvent
    {
        static readonly byte[] Empty = new byte[0];
        readonly Dictionary<string, string> _strings;
        readonly Dictionary<string, string> _scalars;

        /// <summary>What happened.</summary>
        public WebGLEventKind Kind { get; private set; }
        /// <summary>The JS SDK's event name ("message", "restoredWithGap", ...).</summary>
        public string KindName { get; private set; }
        /// <summary>The event as the bridge wrote it.</summary>
        public string Json { get; private set; }

        /// <summary>connected: the outcome; None for other kinds.</summary>
        public WebGLSessionOutcome Outcome { get; private set; }
        /// <summary>stateChange: the previous state.</summary>
        public WebGLConnectionState From { get; private set; }
        /// <summary>stateChange: the new state.</summary>
        public WebGLConnectionState To { get; private set; }
        /// <summary>message, channel, answer: the body (base64-decoded); empty otherwise.</summary>
        public byte[] Payload { get; private set; }

        /// <summary>Parses one event's JSON (as WaygateWebGL_Poll writes it).</summary>
        public static WebGLEvent Parse(string json)
        {
            return new WebGLEvent(json);
        }

        WebGLEvent(string json)
        {
            Json = json;
            WebGL.Json.ParseFlat(json, out _strings, out _scalars);
            KindName = GetString("kind") ?? "";
            Kind = KindOf(KindName);
            Outcome = Kind == WebGLEventKind.Connected ? OutcomeOf(GetString("outcome")) : WebGLSessionOutcome.None;
            From = StateOf(GetString("from"));
            To = StateOf(GetString("to"));
            string p = GetString("payload");
            Payload = string.IsNullOrEmpty(p) ? Empty : Convert.FromBase64String(p);
        }

        /// <summary>The endpoint URL (connected, connectFailed).</summary>
        public string Url { get { return GetString("url"); } }
        /// <summary>The session id in hex (connected, newSession, restored, restoredWithGap).</summary>
        public string SessionId { get { return GetString("sessionId"); } }
        /// <summary>Why, for people (connectFailed, disconnected, closed); requestFailed: the reason's name ("timeout", "refused", ...).</summary>
        public string Reason { get { return GetString("reason"); } }
        /// <summary>answer, requestFailed: the request's id (what Request / SyncClock returned).</summary>
        public uint RequestId { get { return (uint)GetUInt64("requestId"); } }
        /// <summary>answer: the status, 0 for success or the game server's own code.</summary>
        public int Status { get { return (int)GetInt64("status"); } }
        /// <summary>requestFailed: why the request has no answer; None for other kinds.</summary>
        public WebGLRequestFailure Failure { get { return Kind == WebGLEventKind.RequestFailed ? FailureOf(GetString("reason")) : WebGLRequestFailure.None; } }
        /// <summary>The close or error code's name (disconnected, error, closed).</summary>
        public string Label { get { return GetString("label"); } }
        /// <summary>The server's text (kicked, error of kind rejected or protocol).</summary>
        public string Message { get { return GetString("message"); } }
        /// <summary>migrating: the target ("" = any edge from the list).</summary>
        public string Target { get { return GetString("target"); } }
        /// <summary>channel: the channel name.</summary>
        public string Channel { get { return GetString("channel"); } }
        /// <summary>channel: "publication", "joined", "left" or "historyLost".</summary>
        public string ChannelKind { get { return GetString("channelKind"); } }
        /// <summary>error: "undelivered", "rejected" or "protocol".</summary>
        public string ErrorKind { get { return GetString("errorKind"); } }
        /// <summary>Close or error code (PROTOCOL.md close-code table; requestFailed: the refusal's code when refused); 0 if none.</summary>
        public int Code { get { return (int)GetInt64("code"); } }
        /// <summary>message, expired, error: the message id.</summary>
        public uint MsgId { get { return (uint)GetUInt64("msgId"); } }
        /// <summary>message: server seq (0 for best-effort); expired: the client seq it had.</summary>
        public ulong Seq { get { return GetUInt64("seq"); } }
        /// <summary>error (undelivered): the client seq of the message.</summary>
        public ulong ClientSeq { get { return GetUInt64("clientSeq"); } }
        /// <summary>message: the traffic class.</summary>
        public WebGLTrafficClass TrafficClass { get { return (WebGLTrafficClass)GetInt64("trafficClass"); } }
        /// <summary>restoredWithGap: messages up to this server seq were evicted.</summary>
        public ulong ServerSeqBase { get { return GetUInt64("serverSeqBase"); } }
        /// <summary>channel: the epoch.</summary>
        public ulong Epoch { get { return GetUInt64("epoch"); } }
        /// <summary>channel: the offset (0 for a best-effort publication).</summary>
        public ulong Offset { get { return GetUInt64("offset"); } }
        /// <summary>expired: how old the message was, ms.</summary>
        public long AgeMs { get { return GetInt64("ageMs"); } }
        /// <summary>disconnected: the delay before the next attempt, ms.</summary>
        public long RetryInMs { get { return GetInt64("retryInMs"); } }
        /// <summary>error, requestFailed (refused): the server's retry hint, ms.</summary>
        public long RetryAfterMs { get { return GetInt64("retryAfterMs"); } }
        /// <summary>migrating: the deadline, ms.</summary>
        public long DeadlineMs { get { return GetInt64("deadlineMs"); } }
        /// <summary>connectFailed: failed attempts since the last session (1 = the first).</summary>
        public int Attempt { get { return (int)GetInt64("attempt"); } }
        /// <summary>newSession: unacked messages of the old session that were discarded.</summary>
        public int Discarded { get { return (int)GetInt64("discarded"); } }
        /// <summary>restored, restoredWithGap: messages resent.</summary>
        public int Resent { get { return (int)GetInt64("resent"); } }
        /// <summary>eventsDropped: events lost here.</summary>
        public long Count { get { return GetInt64("count"); } }
        /// <summary>eventsDropped: events lost so far on this client.</summary>
        public long TotalDropped { get { return GetInt64("totalDropped"); } }
        /// <summary>newSession: a resume was refused (resync).</summary>
        public bool RestoreFailed { get { return GetBool("restoreFailed"); } }
        /// <summary>disconnected: a session was up on that link.</summary>
        public bool WasActive { get { return GetBool("wasActive"); } }
        /// <summary>disconnected: the client reconnects by itself.</summary>
        public bool WillReconnect { get { return GetBool("willReconnect"); } }

        /// <summary>True for kicked and closed: no event follows.</summary>
        public bool IsTerminal { get { return Kind == WebGLEventKind.Kicked || Kind == WebGLEventKind.Closed; } }

        /// <summary>The payload as UTF-8 text.</summary>
        public string PayloadText()
        {
            return Encoding.UTF8.GetString(Payload);
        }

        /// <summary>A string field, or null.</summary>
        public string GetString(string key)
        {
            string v;
            return _strings.TryGetValue(key, out v) ? v : null;
        }

        /// <summary>Whether the field is present and not null.</summary>
        public bool Has(string key)
        {
            return _strings.ContainsKey(key) || _scalars.ContainsKey(key);
        }

        /// <summary>An unsigned integer field (exact over u64), or 0.</summary>
        public ulong GetUInt64(string key)
        {
            string v;
            ulong n;
            if (_scalars.TryGetValue(key, out v) && ulong.TryParse(v, NumberStyles.None, CultureInfo.InvariantCulture, out n)) return n;
            return 0;
        }

        /// <summary>An integer field (a fraction is cut off), or 0.</summary>
        public long GetInt64(string key)
        {
            string v;
            long n;
            if (!_scalars.TryGetValue(key, out v)) return 0;
            if (long.TryParse(v, NumberStyles.AllowLeadingSign, CultureInfo.InvariantCulture, out n)) return n;
            return (long)GetDouble(key);
        }

        /// <summary>A number field, or 0.</summary>
        public double GetDouble(string key)
        {
            string v;
            double d;
            if (_scalars.TryGetValue(key, out v) && double.TryParse(v, NumberStyles.Float, CultureInfo.InvariantCulture, out d)) return d;
            return 0;
        }

        /// <summary>A boolean field, or false.</summary>
        public bool GetBool(string key)
        {
            string v;
            return _scalars.TryGetValue(key, out v) && v == "true";
        }

        /// <summary>The kind and the raw JSON.</summary>
        public override string ToString()
        {
            return Json;
        }

        static WebGLEventKind KindOf(string name)
        {
            switch (name)
            {
                case "stateChange": return WebGLEventKind.StateChange;
                case "connected": return WebGLEventKind.Connected;
                case "newSession": return WebGLEventKind.NewSession;
                case "restored": return WebGLEventKind.Restored;
                case "restoredWithGap": return WebGLEventKind.RestoredWithGap;
                case "expired": return WebGLEventKind.Expired;
                case "connectFailed": return WebGLEventKind.ConnectFailed;
                case "disconnected": return WebGLEventKind.Disconnected;
                case "kicked": return WebGLEventKind.Kicked;
                case "migrating": return WebGLEventKind.Migrating;
                case "message": return WebGLEventKind.Message;
                case "channel": return WebGLEventKind.Channel;
                case "error": return WebGLEventKind.Error;
                case "closed": return WebGLEventKind.Closed;
                case "eventsDropped": return WebGLEventKind.EventsDropped;
                case "answer": return WebGLEventKind.Answer;
                case "requestFailed": return WebGLEventKind.RequestFailed;
                default: return WebGLEventKind.Unknown;
            }
        }

        /// <summary>A request failure reason ("timeout", "refused", ...) as the enum; Other if unknown.</summary>
        public static WebGLRequestFailure FailureOf(string name)
        {
            switch (name)
            {
                case "timeout": return WebGLRequestFailure.Timeout;
                case "refused": return WebGLRequestFailure.Refused;
                case "expired": return WebGLRequestFailure.Expired;
                case "session_lost": return WebGLRequestFailure.SessionLost;
                case "closed": return WebGLRequestFailure.Closed;
                case "bad_answer": return WebGLRequestFailure.BadAnswer;
                default: return WebGLRequestFailure.Other;
            }
        }

        /// <summary>A session outcome name ("new_session", ...) as the enum; None if unknown.</summary>
        public static WebGLSessionOutcome OutcomeOf(string name)
        {
            switch (name)
            {
                case "new_session": return WebGLSessionOutcome.NewSession;
                case "restored": return WebGLSessionOutcome.Restored;
                case "restored_with_gap": return WebGLSessionOutcome.RestoredWithGap;
                case "restore_failed_new_session": return WebGLSessionOutcome.RestoreFailedNewSession;
                default: return WebGLSessionOutcome.None;
            }
        }

        /// <summary>A connection state name ("idle", ...) as the enum (Idle if unknown).</summary>
        public static WebGLConnectionState StateOf(string name)
        {
            switch (name)
            {
                case "connecting": return WebGLConnectionState.Connecting;
                case "connected": return WebGLConnectionState.Connected;
                case "reconnecting": return WebGLConnectionState.Reconnecting;
                case "closed": return WebGLConnectionState.Closed;
                case "paused": return WebGLConnectionState.Paused;
                default: return WebGLConnectionState.Idle;
            }
        }
    }

    /// <summary>A client: one handle of the bridge. Use it from the main thread.</summary>
    public sealed class WaygateWebGLClient : IDisposable
    {
        int _handle;
        IntPtr _buf;
        int _bufLen;
        bool _closed;

        /// <summary>True in a WebGL player build, where the bridge exists.</summary>
        public static bool IsSupported
        {
            get
            {
#if UNITY_WEBGL && !UNITY_EDITOR
                return true;
#else
                return false;
#endif
            }
        }

        /// <summary>Creates a client (not connected yet). Throws <see cref="WebGLException"/> when an option is refused or the JS SDK is not on the page.</summary>
        public WaygateWebGLClient(WaygateWebGLOptions options)
        {
            if (options == null) throw new ArgumentNullException("options");
            int h = Native.WaygateWebGL_Create(options.ToJson());
            if (h <= 0) throw new WebGLException("create", WebGLResult.InvalidArgument, LastError);
            _handle = h;
            _bufLen = 4096;
            _buf = Marshal.AllocHGlobal(_bufLen);
        }

        /// <summary>The bridge's handle.</summary>
        public int Handle { get { return _handle; } }

        /// <summary>True once the client has ended and every event was taken.</summary>
        public bool IsClosed { get { return _closed; } }

        /// <summary>Why the last failed call failed ("" if none).</summary>
        public static string LastError
        {
            get
            {
                IntPtr buf = Marshal.AllocHGlobal(512);
                try
                {
                    int n = Native.WaygateWebGL_LastError(buf, 512);
                    if (n > 512)
                    {
                        Marshal.FreeHGlobal(buf);
                        buf = Marshal.AllocHGlobal(n);
                        n = Native.WaygateWebGL_LastError(buf, n);
                    }
                    return Utf8(buf, n);
                }
                finally
                {
                    Marshal.FreeHGlobal(buf);
                }
            }
        }

        /// <summary>Starts connecting; reconnects and resumes by itself from now on.</summary>
        public void Connect()
        {
            Check("connect", (WebGLResult)Native.WaygateWebGL_Connect(Live()));
        }

        /// <summary>The connection state.</summary>
        public WebGLConnectionState State
        {
            get
            {
                int s = Native.WaygateWebGL_State(Live());
                if (s < 0) throw new WebGLException("state", (WebGLResult)(-s), LastError);
                return (WebGLConnectionState)s;
            }
        }

        /// <summary>Events waiting to be polled.</summary>
        public int PendingEvents
        {
            get { return Math.Max(0, Native.WaygateWebGL_Pending(Live())); }
        }

        /// <summary>
        /// Takes the next event: true with <paramref name="ev"/> set, false when none is ready
        /// (or the client has ended and every event was taken: IsClosed). Throws
        /// <see cref="WebGLException"/> before Connect() or on a disposed client.
        /// </summary>
        public bool Poll(out WebGLEvent ev)
        {
            ev = null;
            int h = Live();
            for (int attempt = 0; attempt < 3; attempt++)
            {
                int n = Native.WaygateWebGL_Poll(h, _buf, _bufLen);
                if (n == 0) return false;
                if (n < 0)
                {
                    if (n == -(int)WebGLResult.Closed)
                    {
                        _closed = true;
                        return false;
                    }
                    throw new WebGLException("poll", (WebGLResult)(-n), LastError);
                }
                if (n < _bufLen)
                {
                    ev = WebGLEvent.Parse(Utf8(_buf, n));
                    return true;
                }
                // Too small: n bytes are needed. Grow and take it.
                Marshal.FreeHGlobal(_buf);
                _buf = IntPtr.Zero;
                _bufLen = Math.Max(n, _bufLen * 2);
                _buf = Marshal.AllocHGlobal(_bufLen);
            }
            throw new WebGLException("poll", WebGLResult.Internal, "the event kept growing");
        }

        /// <summary>Sends a message; Ok, BufferFull, Dropped (best-effort with no link), Closed...</summary>
        public WebGLResult Send(WebGLTrafficClass trafficClass, uint msgId, byte[] payload)
        {
            ulong seq;
            return Send(trafficClass, msgId, payload, 0, payload == null ? 0 : payload.Length, out seq);
        }

        /// <summary>Sends a message; <paramref name="seq"/> is its client seq (0 for best-effort).</summary>
        public WebGLResult Send(WebGLTrafficClass trafficClass, uint msgId, byte[] payload, out ulong seq)
        {
            return Send(trafficClass, msgId, payload, 0, payload == null ? 0 : payload.Length, out seq);
        }

        /// <summary>Sends UTF-8 text.</summary>
        public WebGLResult Send(WebGLTrafficClass trafficClass, uint msgId, string text)
        {
            return Send(trafficClass, msgId, Encoding.UTF8.GetBytes(text ?? ""));
        }

        /// <summary>Sends <paramref name="count"/> bytes of <paramref name="payload"/> from <paramref name="offset"/> (copied).</summary>
        public WebGLResult Send(WebGLTrafficClass trafficClass, uint msgId, byte[] payload, int offset, int count, out ulong seq)
        {
            seq = 0;
            if (count < 0 || offset < 0 || (payload == null ? count != 0 : offset > payload.Length - count))
                throw new ArgumentOutOfRangeException("count", "offset/count outside the payload");
            int h = Live();
            GCHandle pin = default(GCHandle);
            try
            {
                IntPtr ptr = IntPtr.Zero;
                if (count > 0)
                {
                    pin = GCHandle.Alloc(payload, GCHandleType.Pinned);
                    ptr = IntPtr.Add(pin.AddrOfPinnedObject(), offset);
                }
                var r = (WebGLResult)Native.WaygateWebGL_Send(h, (int)trafficClass, msgId, ptr, count);
                if (r == WebGLResult.Ok) seq = (ulong)Native.WaygateWebGL_LastSeq(h);
                return r;
            }
            finally
            {
                if (pin.IsAllocated) pin.Free();
            }
        }

        /// <summary>The default request timeout, ms.</summary>
        public const uint DefaultRequestTimeoutMs = 10000;

        /// <summary>
        /// Sends a request (PROTOCOL.md §13) of class Critical or Normal to <paramref name="msgId"/>
        /// with <paramref name="body"/> and returns at once: Ok with <paramref name="requestId"/>
        /// set, BufferFull, InvalidArgument (BestEffort, a body too large), InvalidState before
        /// Connect(), Closed. Its outcome comes as one Answer or RequestFailed event with that
        /// id (timeout after <paramref name="timeoutMs"/>).
        /// </summary>
        public WebGLResult Request(WebGLTrafficClass trafficClass, uint msgId, byte[] body, uint timeoutMs, out uint requestId)
        {
            return Request(trafficClass, msgId, body, 0, body == null ? 0 : body.Length, timeoutMs, out requestId);
        }

        /// <summary>Sends a request with the default timeout (10 s); see the other overloads.</summary>
        public WebGLResult Request(WebGLTrafficClass trafficClass, uint msgId, byte[] body, out uint requestId)
        {
            return Request(trafficClass, msgId, body, DefaultRequestTimeoutMs, out requestId);
        }

        /// <summary>Sends a request whose body is UTF-8 text.</summary>
        public WebGLResult Request(WebGLTrafficClass trafficClass, uint msgId, string body, uint timeoutMs, out uint requestId)
        {
            return Request(trafficClass, msgId, Encoding.UTF8.GetBytes(body ?? ""), timeoutMs, out requestId);
        }

        /// <summary>Sends a request whose body is <paramref name="count"/> bytes of <paramref name="body"/> from <paramref name="offset"/> (copied).</summary>
        public WebGLResult Request(WebGLTrafficClass trafficClass, uint msgId, byte[] body, int offset, int count, uint timeoutMs, out uint requestId)
        {
            requestId = 0;
            if (count < 0 || offset < 0 || (body == null ? count != 0 : offset > body.Length - count))
                throw new ArgumentOutOfRangeException("count", "offset/count outside the body");
            int h = Live();
            GCHandle pin = default(GCHandle);
            try
            {
                IntPtr ptr = IntPtr.Zero;
                if (count > 0)
                {
                    pin = GCHandle.Alloc(body, GCHandleType.Pinned);
                    ptr = IntPtr.Add(pin.AddrOfPinnedObject(), offset);
                }
                return Started(Native.WaygateWebGL_Request(h, (int)trafficClass, msgId, ptr, count, timeoutMs), out requestId);
            }
            finally
            {
                if (pin.IsAllocated) pin.Free();
            }
        }

        /// <summary>
        /// Takes a sample of the game server's clock: a request to <paramref name="msgId"/> (the
        /// demo's TIME, 1010) answered with its Unix time in ms. Returns as Request; when the
        /// Answer event with <paramref name="requestId"/> comes, ClockOffsetMs has the updated
        /// estimate. Call it a few times at start, then now and then.
        /// </summary>
        public WebGLResult SyncClock(uint msgId, uint timeoutMs, out uint requestId)
        {
            return Started(Native.WaygateWebGL_SyncClock(Live(), msgId, timeoutMs), out requestId);
        }

        /// <summary>Takes a clock sample with the default timeout (10 s).</summary>
        public WebGLResult SyncClock(uint msgId, out uint requestId)
        {
            return SyncClock(msgId, DefaultRequestTimeoutMs, out requestId);
        }

        /// <summary>
        /// The game server's clock offset, ms (server time = local Unix time + offset; the
        /// fastest of the last 8 samples, within half its round trip: StatsJson's clockRttMs),
        /// or null before the first clock sample was answered.
        /// </summary>
        public double? ClockOffsetMs
        {
            get
            {
                double offset = Native.WaygateWebGL_ClockOffset(Live());
                if (double.IsNaN(offset)) return null;
                return offset;
            }
        }

        /// <summary>As ClockOffsetMs, in the shape of Waygate.cs' TryGetClockOffset: false before the first clock sample.</summary>
        public bool TryGetClockOffset(out double offsetMs)
        {
            double? offset = ClockOffsetMs;
            offsetMs = offset.HasValue ? offset.Value : 0;
            return offset.HasValue;
        }

        /// <summary>The game server's time now, Unix ms, or null before the first clock sample.</summary>
        public double? ServerTimeMs
        {
            get
            {
                double? offset = ClockOffsetMs;
                if (!offset.HasValue) return null;
                return (DateTime.UtcNow - new DateTime(1970, 1, 1, 0, 0, 0, DateTimeKind.Utc)).TotalMilliseconds + offset.Value;
            }
        }

        static WebGLResult Started(int r, out uint requestId)
        {
            requestId = r > 0 ? (uint)r : 0;
            if (r > 0) return WebGLResult.Ok;
            return r == 0 ? WebGLResult.Internal : (WebGLResult)(-r);
        }

        /// <summary>Drops the link as a network failure would (a drill): the client resumes.</summary>
        public WebGLResult DropLink()
        {
            return (WebGLResult)Native.WaygateWebGL_DropLink(Live());
        }

        /// <summary>Drops the link even if it looks alive and reconnects at once; the session resumes.</summary>
        public WebGLResult ReconnectNow()
        {
            return (WebGLResult)Native.WaygateWebGL_ReconnectNow(Live());
        }

        /// <summary>Pauses the client (OnApplicationPause(true)): the link closes, the session lingers, no socket until ReconnectNow().</summary>
        public WebGLResult Pause()
        {
            return (WebGLResult)Native.WaygateWebGL_Pause(Live());
        }

        /// <summary>Replaces the auth token (bytes) for the next HELLO.</summary>
        public WebGLResult SetToken(byte[] token)
        {
            int h = Live();
            int len = token == null ? 0 : token.Length;
            GCHandle pin = default(GCHandle);
            try
            {
                IntPtr ptr = IntPtr.Zero;
                if (len > 0)
                {
                    pin = GCHandle.Alloc(token, GCHandleType.Pinned);
                    ptr = pin.AddrOfPinnedObject();
                }
                return (WebGLResult)Native.WaygateWebGL_SetToken(h, ptr, len);
            }
            finally
            {
                if (pin.IsAllocated) pin.Free();
            }
        }

        /// <summary>Replaces the auth token (base64url text, as the login service hands it out).</summary>
        public WebGLResult SetToken(string base64Url)
        {
            return SetToken(Base64Url.Decode(base64Url ?? ""));
        }

        /// <summary>Closes the session: a Closed event follows, then Poll() returns false with IsClosed.</summary>
        public WebGLResult Close()
        {
            return (WebGLResult)Native.WaygateWebGL_Close(Live());
        }

        /// <summary>Ends the session for good (CLOSE logout): the edge ends it at once instead of letting it linger (PROTOCOL.md §7.5); a Closed event (code 2) follows. InvalidState: no session was up on a socket, or the client had ended (the session lingers out).</summary>
        public WebGLResult Logout()
        {
            return (WebGLResult)Native.WaygateWebGL_Logout(Live());
        }

        /// <summary>
        /// Live statistics as a flat JSON object: state, rttLatestMs, rttSmoothedMs, rttMinMs,
        /// rttSamples, unacked, lastServerSeq, connects, sessionId, queuedEvents, droppedEvents,
        /// requestsPending, clockOffsetMs, clockRttMs, clockSamples (read it with WebGLEvent.Parse(json).GetDouble("rttSmoothedMs") and the like).
        /// </summary>
        public string StatsJson()
        {
            int h = Live();
            for (int attempt = 0; attempt < 3; attempt++)
            {
                int n = Native.WaygateWebGL_Stats(h, _buf, _bufLen);
                if (n < 0) throw new WebGLException("stats", (WebGLResult)(-n), LastError);
                if (n < _bufLen) return Utf8(_buf, n);
                Marshal.FreeHGlobal(_buf);
                _buf = IntPtr.Zero;
                _bufLen = Math.Max(n, _bufLen * 2);
                _buf = Marshal.AllocHGlobal(_bufLen);
            }
            throw new WebGLException("stats", WebGLResult.Internal, "the stats kept growing");
        }

        /// <summary>Closes the session if still open and frees the handle. Call it from OnDestroy().</summary>
        public void Dispose()
        {
            if (_handle > 0)
            {
                Native.WaygateWebGL_Free(_handle);
                _handle = 0;
            }
            if (_buf != IntPtr.Zero)
            {
                Marshal.FreeHGlobal(_buf);
                _buf = IntPtr.Zero;
            }
        }

        int Live()
        {
            if (_handle <= 0) throw new ObjectDisposedException("WaygateWebGLClient");
            return _handle;
        }

        static void Check(string op, WebGLResult r)
        {
            if (r != WebGLResult.Ok) throw new WebGLException(op, r, LastError);
        }

        static string Utf8(IntPtr p, int n)
        {
            if (n <= 0) return "";
            var bytes = new byte[n];
            Marshal.Copy(p, bytes, 0, n);
            return Encoding.UTF8.GetString(bytes);
        }
    }

    /// <summary>base64url (RFC 4648 §5, unpadded) for tokens.</summary>
    public static class Base64Url
    {
        /// <summary>Bytes as base64url text without padding.</summary>
        public static string Encode(byte[] bytes)
        {
            return Convert.ToBase64String(bytes).TrimEnd('=').Replace('+', '-').Replace('/', '_');
        }

        /// <summary>base64url text (padded or not) as bytes.</summary>
        public static byte[] Decode(string text)
        {
            string s = text.Trim().Replace('-', '+').Replace('_', '/');
            switch (s.Length % 4)
            {
                case 2: s += "=="; break;
                case 3: s += "="; break;
            }
            return Convert.FromBase64String(s);
        }
    }

    /// <summary>The little JSON this bridge needs: flat objects of strings, numbers, booleans and nulls.</summary>
    static class Json
    {
        /// <summary>Appends <paramref name="s"/> as a JSON string literal.</summary>
        public static void Quote(StringBuilder sb, string s)
        {
            sb.Append('"');
            foreach (char c in s)
            {
                switch (c)
                {
                    case '"': sb.Append("\\\""); break;
                    case '\\': sb.Append("\\\\"); break;
                    case '\n': sb.Append("\\n"); break;
                    case '\r': sb.Append("\\r"); break;
                    case '\t': sb.Append("\\t"); break;
                    default:
                        if (c < 0x20) sb.Append("\\u").Append(((int)c).ToString("x4", CultureInfo.InvariantCulture));
                        else sb.Append(c);
                        break;
                }
            }
            sb.Append('"');
        }

        /// <summary>
        /// Parses a flat object: string values into <paramref name="strings"/>, numbers and
        /// booleans (their JSON text) into <paramref name="scalars"/>; nulls are left out.
        /// </summary>
        public static void ParseFlat(string json, out Dictionary<string, string> strings, out Dictionary<string, string> scalars)
        {
            strings = new Dictionary<string, string>();
            scalars = new Dictionary<string, string>();
            int i = 0;
            Ws(json, ref i);
            Expect(json, ref i, '{');
            Ws(json, ref i);
            if (Peek(json, i) == '}') return;
            while (true)
            {
                Ws(json, ref i);
                string key = Str(json, ref i);
                Ws(json, ref i);
                Expect(json, ref i, ':');
                Ws(json, ref i);
                char c = Peek(json, i);
                if (c == '"')
                {
                    strings[key] = Str(json, ref i);
                }
                else
                {
                    int start = i;
                    while (i < json.Length && (char.IsLetterOrDigit(json[i]) || json[i] == '-' || json[i] == '+' || json[i] == '.')) i++;
                    string raw = json.Substring(start, i - start);
                    if (raw.Length == 0) throw new FormatException("bad JSON value at " + start + ": " + json);
                    if (raw != "null") scalars[key] = raw;
                }
                Ws(json, ref i);
                c = Peek(json, i);
                i++;
                if (c == '}') return;
                if (c != ',') throw new FormatException("expected , or } at " + (i - 1) + ": " + json);
            }
        }

        static char Peek(string s, int i)
        {
            if (i >= s.Length) throw new FormatException("JSON ends early: " + s);
            return s[i];
        }

        static void Ws(string s, ref int i)
        {
            while (i < s.Length && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
        }

        static void Expect(string s, ref int i, char c)
        {
            if (Peek(s, i) != c) throw new FormatException("expected " + c + " at " + i + ": " + s);
            i++;
        }

        static string Str(string s, ref int i)
        {
            Expect(s, ref i, '"');
            var sb = new StringBuilder();
            while (true)
            {
                char c = Peek(s, i++);
                if (c == '"') return sb.ToString();
                if (c != '\\')
                {
                    sb.Append(c);
                    continue;
                }
                char e = Peek(s, i++);
                switch (e)
                {
                    case '"': sb.Append('"'); break;
                    case '\\': sb.Append('\\'); break;
                    case '/': sb.Append('/'); break;
                    case 'b': sb.Append('\b'); break;
                    case 'f': sb.Append('\f'); break;
                    case 'n': sb.Append('\n'); break;
                    case 'r': sb.Append('\r'); break;
                    case 't': sb.Append('\t'); break;
                    case 'u':
                        if (i + 4 > s.Length) throw new FormatException("bad \\u escape: " + s);
                        sb.Append((char)int.Parse(s.Substring(i, 4), NumberStyles.HexNumber, CultureInfo.InvariantCulture));
                        i += 4;
                        break;
                    default: throw new FormatException("bad escape \\" + e + ": " + s);
                }
            }
        }
    }

    /// <summary>The bridge's functions (Plugins/WaygateWebGL.jslib).</summary>
    static class Native
    {
#if UNITY_WEBGL && !UNITY_EDITOR
        [DllImport("__Internal")] public static extern int WaygateWebGL_Create(string optionsJson);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Connect(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Send(int handle, int trafficClass, uint msgId, IntPtr payload, int len);
        [DllImport("__Internal")] public static extern double WaygateWebGL_LastSeq(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Request(int handle, int trafficClass, uint msgId, IntPtr body, int len, uint timeoutMs);
        [DllImport("__Internal")] public static extern int WaygateWebGL_SyncClock(int handle, uint msgId, uint timeoutMs);
        [DllImport("__Internal")] public static extern double WaygateWebGL_ClockOffset(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Poll(int handle, IntPtr buf, int len);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Pending(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_State(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_DropLink(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_ReconnectNow(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Pause(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_SetToken(int handle, IntPtr token, int len);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Close(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Logout(int handle);
        [DllImport("__Internal")] public static extern void WaygateWebGL_Free(int handle);
        [DllImport("__Internal")] public static extern int WaygateWebGL_Stats(int handle, IntPtr buf, int len);
        [DllImport("__Internal")] public static extern int WaygateWebGL_LastError(IntPtr buf, int len);
#else
        static Exception NotHere()
        {
            return new PlatformNotSupportedException("the waygate WebGL bridge exists only in a WebGL player build (use Waygate.cs elsewhere)");
        }

        public static int WaygateWebGL_Create(string optionsJson) { throw NotHere(); }
        public static int WaygateWebGL_Connect(int handle) { throw NotHere(); }
        public static int WaygateWebGL_Send(int handle, int trafficClass, uint msgId, IntPtr payload, int len) { throw NotHere(); }
        public static double WaygateWebGL_LastSeq(int handle) { throw NotHere(); }
        public static int WaygateWebGL_Request(int handle, int trafficClass, uint msgId, IntPtr body, int len, uint timeoutMs) { throw NotHere(); }
        public static int WaygateWebGL_SyncClock(int handle, uint msgId, uint timeoutMs) { throw NotHere(); }
        public static double WaygateWebGL_ClockOffset(int handle) { throw NotHere(); }
        public static int WaygateWebGL_Poll(int handle, IntPtr buf, int len) { throw NotHere(); }
        public static int WaygateWebGL_Pending(int handle) { throw NotHere(); }
        public static int WaygateWebGL_State(int handle) { throw NotHere(); }
        public static int WaygateWebGL_DropLink(int handle) { throw NotHere(); }
        public static int WaygateWebGL_ReconnectNow(int handle) { throw NotHere(); }
        public static int WaygateWebGL_Pause(int handle) { throw NotHere(); }
        public static int WaygateWebGL_SetToken(int handle, IntPtr token, int len) { throw NotHere(); }
        public static int WaygateWebGL_Close(int handle) { throw NotHere(); }
        public static int WaygateWebGL_Logout(int handle) { throw NotHere(); }
        public static void WaygateWebGL_Free(int handle) { }
        public static int WaygateWebGL_Stats(int handle, IntPtr buf, int len) { throw NotHere(); }
        public static int WaygateWebGL_LastError(IntPtr buf, int len) { return 0; }
#endif
    }
}
