// Waygate.cs: the C# binding of the waygate client (P/Invoke over the C ABI in
// client-sdk/capi/include/waygate.h). One file, no dependencies beyond mscorlib and System:
// drop it into a Unity project (Assets/Scripts/...) next to the native library
// (README.md in this directory says where each platform's library goes).
//
// The API is poll-driven, like the C ABI: no callback ever comes from a foreign thread.
// The game calls Tick() and Poll() from its main thread (Unity: Update()) and handles the
// events there:
//
//     var client = new WaygateClient(new WaygateOptions {
//         Endpoints = "kcp://127.0.0.1:7100,tcp://127.0.0.1:7000", Token = tokenBytes });
//     client.Connect();
//     // every frame:
//     client.Tick();
//     WaygateEvent ev;
//     while (client.Poll(out ev)) { /* handle ev */ }
//     client.Send(TrafficClass.Normal, 1000, body);
//     uint id = client.Request(TrafficClass.Normal, 1011, question, 5000);
//     // later: an Answer (ev.Status, ev.Payload) or RequestFailed event with ev.RequestId == id
//     // when done:
//     client.Dispose();            // closes the session and frees the native handle
//
// A client is used from one thread at a time (the C ABI's rule); distinct clients are
// independent. Compiles with mcs (C# 6/7 level: no Span, no nullable reference types, no
// unsafe code), so Unity needs no "Allow unsafe code".
//
// Layouts: the Native* structs below mirror the header field by field with
// LayoutKind.Sequential and natural alignment, which matches the C layout on every ABI
// where a uint64_t inside a struct is 8-aligned: x86_64 (Linux, macOS, Windows), arm64
// (Android, iOS, macOS), armv7 (AAPCS), Windows x86. It does NOT match 32-bit x86 Linux
// (i386 System V aligns uint64_t to 4 in structs), which Unity does not target.

using System;
using System.Diagnostics;
using System.Runtime.InteropServices;
using System.Text;

namespace Waygate
{
    /// <summary>What a call returned: mirrors <c>waygate_result</c>.</summary>
    public enum WaygateResult
    {
        /// <summary>Success.</summary>
        Ok = 0,
        /// <summary>No event is ready yet: poll again later.</summary>
        NoEvent = 1,
        /// <summary>A NULL pointer, bad UTF-8, an unknown traffic class, or an option that does not parse.</summary>
        InvalidArgument = 2,
        /// <summary>Not valid now: sending or polling before Connect(), connecting twice.</summary>
        InvalidState = 3,
        /// <summary>The client has ended (closed, kicked, expired, token refused).</summary>
        Closed = 4,
        /// <summary>Too many sent-but-unacked messages: keep polling and send again later.</summary>
        BufferFull = 5,
        /// <summary>A best-effort message was dropped because no link is up.</summary>
        Dropped = 6,
        /// <summary>An internal failure (e.g. the client's thread could not be started).</summary>
        Internal = 7,
        /// <summary>A panic was caught in the library: a bug in waygate. The client may be unusable.</summary>
        Panic = 8,
        /// <summary>What was asked for does not exist (e.g. a channel the session is not a member of).</summary>
        NotFound = 9,
    }

    /// <summary>What happened: mirrors <c>waygate_event_kind</c>.</summary>
    public enum WaygateEventKind
    {
        /// <summary>No event.</summary>
        None = 0,
        /// <summary>A session is up (every WELCOME): Outcome says how (new, restored, restored with a gap, or a new session after a failed restore). Text: the endpoint URL; SessionId. (Kinds 2-4 are retired.)</summary>
        Connected = 1,
        /// <summary>A message from the server: TrafficClass, MsgId, Seq, Payload.</summary>
        Message = 5,
        /// <summary>The link dropped; the client reconnects and resumes by itself. Code, Text.</summary>
        Disconnected = 6,
        /// <summary>The server refused a connect; the next attempt waits RetryAfterMs. Code, Text.</summary>
        Rejected = 7,
        /// <summary>The server moves this client to another edge. Text: the target ("" = configured list).</summary>
        Migrating = 8,
        /// <summary>One sent message was not delivered. Code, Text, MsgId, Seq (client seq), RetryAfterMs.</summary>
        Error = 9,
        /// <summary>Terminal: another login of the same player took over. Code, Text.</summary>
        Kicked = 10,
        /// <summary>Terminal: closed locally, session expired, or the token was refused. Code, Text.</summary>
        Closed = 11,
        /// <summary>A channel publication. Text: the channel; ChannelEpoch, ChannelOffset, Payload.</summary>
        ChannelPublication = 12,
        /// <summary>The session joined a channel. Text, ChannelEpoch, ChannelOffset.</summary>
        ChannelJoined = 13,
        /// <summary>The session left a channel. Text, ChannelEpoch, ChannelOffset.</summary>
        ChannelLeft = 14,
        /// <summary>What was missed on a channel is lost: reload its state. Text, ChannelEpoch, ChannelOffset.</summary>
        ChannelHistoryLost = 15,
        /// <summary>One connect attempt failed. Text: "&lt;endpoint&gt;: &lt;reason&gt;"; Seq: the round.</summary>
        ConnectFailed = 16,
        /// <summary>A message sent while no session was up waited longer than MaxOfflineAgeMs: dropped, never sent. MsgId, Seq, AgeMs.</summary>
        Expired = 17,
        /// <summary>The answer to a request (Request, SyncClock): RequestId; Status (= Code): 0 success, else the game server's own code; Payload: its body. (Since 0.2.)</summary>
        Answer = 18,
        /// <summary>A request has no answer: RequestId; Text: why ("timeout", "refused", "expired", "session_lost", "closed", "bad_answer"); Code and RetryAfterMs: the refusal's code and hint when refused, else 0. Exactly one Answer or RequestFailed per request. (Since 0.2.)</summary>
        RequestFailed = 19,
        /// <summary>Seq status events (ConnectFailed, Rejected, Disconnected, Migrating) were dropped here because the caller was not polling: past 256 events waiting beside the 4,096 the handle holds, status events are counted instead of kept (every other kind is always kept). (Since 0.2.)</summary>
        EventsDropped = 20,
    }

    /// <summary>How a session came up (<c>waygate_outcome</c>); the names are the same in every SDK.</summary>
    public enum WaygateOutcome
    {
        /// <summary>new_session: a fresh session.</summary>
        NewSession = 0,
        /// <summary>restored: resumed, nothing lost.</summary>
        Restored = 1,
        /// <summary>restored_with_gap: resumed, but downstream messages were lost: resync game state.</summary>
        RestoredWithGap = 2,
        /// <summary>restore_failed_new_session: the resume failed and a new session started: resync game state.</summary>
        RestoreFailedNewSession = 3,
    }

    /// <summary>Where a client is (<c>waygate_state</c>); the names are the same in every SDK.</summary>
    public enum WaygateState
    {
        /// <summary>idle: Connect not called yet.</summary>
        Idle = 0,
        /// <summary>connecting: no session has been up yet.</summary>
        Connecting = 1,
        /// <summary>connected: a session is up.</summary>
        Connected = 2,
        /// <summary>reconnecting: the link dropped; connecting again to resume.</summary>
        Reconnecting = 3,
        /// <summary>closed: ended for good.</summary>
        Closed = 4,
        /// <summary>paused: Pause was called; no link until ReconnectNow.</summary>
        Paused = 5,
    }

    /// <summary>Traffic classes: the header's <c>WAYGATE_CLASS_*</c>.</summary>
    public enum TrafficClass : byte
    {
        /// <summary>Never dropped; sequenced, acked and resent after a resume.</summary>
        Critical = 0,
        /// <summary>Sequenced, acked and resent after a resume; may be slowed under overload.</summary>
        Normal = 1,
        /// <summary>Not sequenced, never resent, dropped first.</summary>
        BestEffort = 2,
    }

    /// <summary>A failed call: the result code and the library's own explanation.</summary>
    public class WaygateException : Exception
    {
        /// <summary>The result code of the failed call.</summary>
        public WaygateResult Result { get; private set; }

        /// <summary>The library's text for the failure (<c>waygate_last_error()</c>), "" if none.</summary>
        public string Detail { get; private set; }

        public WaygateException(string operation, WaygateResult result, string detail)
            : base(Format(operation, result, detail))
        {
            Result = result;
            Detail = detail ?? "";
        }

        static string Format(string operation, WaygateResult result, string detail)
        {
            var sb = new StringBuilder();
            sb.Append(operation).Append(": ").Append(WaygateClient.ResultString(result));
            if (!string.IsNullOrEmpty(detail)) sb.Append(": ").Append(detail);
            return sb.ToString();
        }

        /// <summary>Throws for anything but Ok, with <c>waygate_last_error()</c> read at once.</summary>
        public static void Check(string operation, WaygateResult result)
        {
            if (result != WaygateResult.Ok)
                throw new WaygateException(operation, result, WaygateClient.LastError);
        }
    }

    /// <summary>Live numbers of a client: mirrors <c>waygate_stats</c> (all 0 before the first connect).</summary>
    [StructLayout(LayoutKind.Sequential)]
    public struct WaygateStats
    {
        /// <summary>Latest PING/PONG round-trip time in microseconds (0: no sample yet).</summary>
        public ulong RttLatestUs;
        /// <summary>Smoothed round-trip time in microseconds.</summary>
        public ulong RttSmoothedUs;
        /// <summary>Smallest round-trip time seen, in microseconds.</summary>
        public ulong RttMinUs;
        /// <summary>Number of round-trip samples.</summary>
        public ulong RttSamples;
        /// <summary>Sent messages not yet acked by the server.</summary>
        public ulong Unacked;
        /// <summary>Highest server seq received without a gap.</summary>
        public ulong LastServerSeq;
        /// <summary>Successful connects and resumes.</summary>
        public ulong Connects;
    }

    /// <summary>
    /// One event, copied out of the native <c>waygate_event</c>: it stays valid for as long as
    /// you keep it (the native payload and text pointers die with the next poll; these copies
    /// do not). Which fields are set depends on <see cref="Kind"/>.
    /// </summary>
    public sealed class WaygateEvent
    {
        static readonly byte[] Empty = new byte[0];

        /// <summary>What happened.</summary>
        public WaygateEventKind Kind { get; private set; }
        /// <summary>The traffic class of a message.</summary>
        public TrafficClass TrafficClass { get; private set; }
        /// <summary>Close or error code (PROTOCOL.md close-code table), else 0.</summary>
        public ushort Code { get; private set; }
        /// <summary>Message id of a message or of an undelivered message, else 0.</summary>
        public uint MsgId { get; private set; }
        /// <summary>Retry hint in milliseconds (rejected, error), else 0.</summary>
        public uint RetryAfterMs { get; private set; }
        /// <summary>Server seq of a message (0 for best-effort); client seq of an undelivered message; the round of a failed connect; how many were dropped (EventsDropped).</summary>
        public ulong Seq { get; private set; }
        /// <summary>Message or publication body (an empty array when none; never null).</summary>
        public byte[] Payload { get; private set; }
        /// <summary>Endpoint URL, migration target, code name, channel, or connect failure ("" if none; never null).</summary>
        public string Text { get; private set; }
        /// <summary>Session id (connected, restored, restored-with-gap, new-session), else 16 zeros.</summary>
        public byte[] SessionId { get; private set; }
        /// <summary>Channel events: the channel's epoch, else 0.</summary>
        public ulong ChannelEpoch { get; private set; }
        /// <summary>Channel events: the offset, else 0.</summary>
        public ulong ChannelOffset { get; private set; }
        /// <summary>Connected: how the session came up.</summary>
        public WaygateOutcome Outcome { get; private set; }
        /// <summary>Answer, RequestFailed: the request (the id Request or SyncClock returned), else 0.</summary>
        public uint RequestId { get; private set; }
        /// <summary>Expired: how long the message had waited, in milliseconds.</summary>
        public ulong AgeMs { get; private set; }

        /// <summary>Answer: the game server's status (0 success, else its own code); the same number as Code.</summary>
        public ushort Status
        {
            get { return Code; }
        }

        /// <summary>The endpoint URL of Connected, the target of Migrating; else null.</summary>
        public string Endpoint
        {
            get
            {
                switch (Kind)
                {
                    case WaygateEventKind.Connected:
                    case WaygateEventKind.Migrating:
                        return Text;
                    default:
                        return null;
                }
            }
        }

        /// <summary>The code's name (Disconnected, Rejected, Error, Kicked, Closed), "&lt;endpoint&gt;: &lt;reason&gt;" (ConnectFailed) or why a request failed (RequestFailed: "timeout", "refused"...); else null.</summary>
        public string Reason
        {
            get
            {
                switch (Kind)
                {
                    case WaygateEventKind.Disconnected:
                    case WaygateEventKind.Rejected:
                    case WaygateEventKind.Error:
                    case WaygateEventKind.Kicked:
                    case WaygateEventKind.Closed:
                    case WaygateEventKind.ConnectFailed:
                    case WaygateEventKind.RequestFailed:
                        return Text;
                    default:
                        return null;
                }
            }
        }

        /// <summary>The channel name of a channel event, else null.</summary>
        public string Channel
        {
            get
            {
                switch (Kind)
                {
                    case WaygateEventKind.ChannelPublication:
                    case WaygateEventKind.ChannelJoined:
                    case WaygateEventKind.ChannelLeft:
                    case WaygateEventKind.ChannelHistoryLost:
                        return Text;
                    default:
                        return null;
                }
            }
        }

        /// <summary>The payload as UTF-8 text (for text protocols and logs).</summary>
        public string PayloadText()
        {
            return Encoding.UTF8.GetString(Payload);
        }

        /// <summary>True for Kicked and Closed: no more events follow and nothing can be sent.</summary>
        public bool IsTerminal
        {
            get { return Kind == WaygateEventKind.Kicked || Kind == WaygateEventKind.Closed; }
        }

        public override string ToString()
        {
            return WaygateClient.KindName(Kind) + (Text.Length > 0 ? " (" + Text + ")" : "");
        }

        internal static WaygateEvent FromNative(ref Native.waygate_event e)
        {
            var ev = new WaygateEvent();
            ev.Kind = (WaygateEventKind)e.kind;
            ev.TrafficClass = (TrafficClass)e.traffic_class;
            ev.Code = e.code;
            ev.MsgId = e.msg_id;
            ev.RetryAfterMs = e.retry_after_ms;
            ev.Seq = e.seq;
            long len = (long)e.payload_len.ToUInt64();
            if (e.payload != IntPtr.Zero && len > 0)
            {
                if (len > int.MaxValue) throw new WaygateException("poll", WaygateResult.Internal, "payload larger than 2 GiB");
                var payload = new byte[len];
                Marshal.Copy(e.payload, payload, 0, (int)len);
                ev.Payload = payload;
            }
            else
            {
                ev.Payload = Empty;
            }
            ev.Text = Native.Utf8ToString(e.text);
            var sid = new byte[16];
            // The 16 bytes in memory order, whatever the platform's endianness.
            Buffer.BlockCopy(BitConverter.GetBytes(e.session_id_0), 0, sid, 0, 4);
            Buffer.BlockCopy(BitConverter.GetBytes(e.session_id_1), 0, sid, 4, 4);
            Buffer.BlockCopy(BitConverter.GetBytes(e.session_id_2), 0, sid, 8, 4);
            Buffer.BlockCopy(BitConverter.GetBytes(e.session_id_3), 0, sid, 12, 4);
            ev.SessionId = sid;
            ev.ChannelEpoch = e.channel_epoch;
            ev.ChannelOffset = e.channel_offset;
            ev.Outcome = (WaygateOutcome)e.outcome;
            ev.RequestId = e.request_id;
            ev.AgeMs = e.age_ms;
            return ev;
        }
    }

    /// <summary>
    /// How to connect: the managed side of <c>waygate_options</c>. Numbers left at 0 take the
    /// library's defaults. Everything is copied when the client is created.
    /// </summary>
    public sealed class WaygateOptions
    {
        /// <summary>Required. Endpoint URLs in order of preference, comma-separated (tcp, tls, ws, wss, quic, kcp).</summary>
        public string Endpoints;
        /// <summary>Required. The auth token bytes from the login service (decoded, not base64).</summary>
        public byte[] Token;
        /// <summary>PEM text of the CA certificates to trust for tls, wss and quic (null: the system's roots).</summary>
        public string CaPem;
        /// <summary>How long a UDP endpoint (kcp, quic) may take to connect (default 2000 ms).</summary>
        public uint UdpTimeoutMs;
        /// <summary>Deadline of a transport handshake (default 10000 ms).</summary>
        public uint HandshakeTimeoutMs;
        /// <summary>A link that receives nothing for this long is dead (default 30000 ms).</summary>
        public uint IdleTimeoutMs;
        /// <summary>First reconnect delay cap, doubled per failed round (default 100 ms).</summary>
        public uint BackoffMinMs;
        /// <summary>Largest reconnect delay (default 5000 ms).</summary>
        public uint BackoffMaxMs;
        /// <summary>Most sent-but-unacked messages kept for resending (default and most 4096, the edge's window).</summary>
        public uint MaxUnacked;
        /// <summary>The 32-byte session key handed out beside a connect token (null: plain KCP).</summary>
        public byte[] SessionKey;
        /// <summary>Give up when no session has been up for this long (0: retry for ever).</summary>
        public uint GiveUpAfterMs;
        /// <summary>Messages sent while no session is up and waiting longer than this are dropped (an Expired event each) instead of sent when one comes up (0: no bound).</summary>
        public uint MaxOfflineAgeMs;
        /// <summary>Network simulator, for testing a game under a bad network (never in production): ms added to every frame each way.</summary>
        public uint SimLatencyMs;
        /// <summary>Simulator: up to this many more ms per frame, at random.</summary>
        public uint SimJitterMs;
        /// <summary>Simulator: frames lost per thousand (best-effort dropped; the others arrive 200 ms late, as retransmitted).</summary>
        public uint SimLossPermille;
        /// <summary>Simulator: seed of its random choices.</summary>
        public uint SimSeed;
        /// <summary>Give up after this many failed connect rounds in a row (0: no cap).</summary>
        public uint GiveUpAfterAttempts;
    }

    /// <summary>The native client pointer: freed by <c>waygate_client_free</c> exactly once.</summary>
    public sealed class WaygateClientHandle : SafeHandle
    {
        public WaygateClientHandle() : base(IntPtr.Zero, true) { }

        internal WaygateClientHandle(IntPtr ptr) : base(IntPtr.Zero, true)
        {
            SetHandle(ptr);
        }

        public override bool IsInvalid
        {
            get { return handle == IntPtr.Zero; }
        }

        protected override bool ReleaseHandle()
        {
            // Closes the session if still open (up to a second for the CLOSE to go out) and
            // stops the client's thread. Prefer Dispose() from the game thread over leaving
            // this to the finalizer thread.
            Native.waygate_client_free(handle);
            return true;
        }
    }

    /// <summary>
    /// A waygate client. Create it, Connect(), then from the game's main thread every frame
    /// call Tick() and Poll() until it returns false. Dispose() closes and frees it.
    /// Use one instance from one thread at a time.
    /// </summary>
    public sealed class WaygateClient : IDisposable
    {
        static readonly Stopwatch Clock = Stopwatch.StartNew();

        readonly WaygateClientHandle _handle;
        bool _closed;

        /// <summary>Creates a client (it does not connect yet). Throws WaygateException for invalid options.</summary>
        public WaygateClient(WaygateOptions options)
        {
            if (options == null) throw new ArgumentNullException("options");
            var o = new Native.waygate_options();
            WaygateException.Check("waygate_options_init",
                Native.waygate_options_init(ref o, (UIntPtr)(uint)Marshal.SizeOf(typeof(Native.waygate_options))));
            IntPtr endpoints = IntPtr.Zero, token = IntPtr.Zero, ca = IntPtr.Zero, key = IntPtr.Zero;
            try
            {
                endpoints = Native.StringToUtf8(options.Endpoints);
                token = Native.BytesToHGlobal(options.Token);
                ca = Native.StringToUtf8(options.CaPem);
                if (options.SessionKey != null)
                {
                    if (options.SessionKey.Length != 32)
                        throw new ArgumentException("SessionKey must be 32 bytes", "options");
                    key = Native.BytesToHGlobal(options.SessionKey);
                }
                o.endpoints = endpoints;
                o.token = token;
                o.token_len = (UIntPtr)(uint)(options.Token == null ? 0 : options.Token.Length);
                o.ca_pem = ca;
                o.udp_timeout_ms = options.UdpTimeoutMs;
                o.handshake_timeout_ms = options.HandshakeTimeoutMs;
                o.idle_timeout_ms = options.IdleTimeoutMs;
                o.backoff_min_ms = options.BackoffMinMs;
                o.backoff_max_ms = options.BackoffMaxMs;
                o.max_unacked = options.MaxUnacked;
                o.session_key = key;
                o.give_up_after_ms = options.GiveUpAfterMs;
                o.max_offline_age_ms = options.MaxOfflineAgeMs;
                o.sim_latency_ms = options.SimLatencyMs;
                o.sim_jitter_ms = options.SimJitterMs;
                o.sim_loss_permille = options.SimLossPermille;
                o.sim_seed = options.SimSeed;
                o.give_up_after_attempts = options.GiveUpAfterAttempts;
                IntPtr ptr = Native.waygate_client_new(ref o);
                if (ptr == IntPtr.Zero)
                    throw new WaygateException("waygate_client_new", WaygateResult.InvalidArgument, LastError);
                _handle = new WaygateClientHandle(ptr);
            }
            finally
            {
                // The library copied everything it needs.
                Native.Free(endpoints);
                Native.Free(token);
                Native.Free(ca);
                Native.Free(key);
            }
        }

        /// <summary>The native handle (for code that calls the C ABI directly).</summary>
        public WaygateClientHandle Handle
        {
            get { return _handle; }
        }

        /// <summary>True once a poll returned Closed: no more events will come.</summary>
        public bool IsClosed
        {
            get { return _closed; }
        }

        /// <summary>Starts connecting in the background (a Connected event tells when the session is up).</summary>
        public void Connect()
        {
            WaygateException.Check("connect", Call(h => Native.waygate_client_connect(h)));
        }

        /// <summary>Lets the client advance its timers to nowMs (any monotonic clock in ms). Cheap; optional with this library.</summary>
        public WaygateResult Tick(ulong nowMs)
        {
            bool added = false;
            try
            {
                _handle.DangerousAddRef(ref added);
                return Native.waygate_client_tick(_handle.DangerousGetHandle(), nowMs);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
        }

        /// <summary>Tick with this process's monotonic clock.</summary>
        public WaygateResult Tick()
        {
            return Tick((ulong)Clock.ElapsedMilliseconds);
        }

        /// <summary>
        /// Takes the next event without blocking: true with <paramref name="ev"/> set; false
        /// when none is ready, or when the client has ended (then <see cref="IsClosed"/> is
        /// true). Throws WaygateException on misuse (e.g. before Connect()).
        /// </summary>
        public bool Poll(out WaygateEvent ev)
        {
            return Take("poll", -1, out ev);
        }

        /// <summary>As Poll, but blocks up to timeoutMs for an event (tools and tests; a game loop polls).</summary>
        public bool WaitEvent(uint timeoutMs, out WaygateEvent ev)
        {
            return Take("wait_event", timeoutMs, out ev);
        }

        bool Take(string op, long timeoutMs, out WaygateEvent ev)
        {
            ev = null;
            var e = new Native.waygate_event();
            e.struct_size = (UIntPtr)(uint)Native.EventSize;
            WaygateResult r;
            bool added = false;
            try
            {
                _handle.DangerousAddRef(ref added);
                IntPtr h = _handle.DangerousGetHandle();
                r = timeoutMs < 0
                    ? Native.waygate_client_poll_event(h, ref e)
                    : Native.waygate_client_wait_event(h, (uint)timeoutMs, ref e);
                switch (r)
                {
                    case WaygateResult.Ok:
                        // Copy now: the native payload and text die with the next poll.
                        ev = WaygateEvent.FromNative(ref e);
                        return true;
                    case WaygateResult.NoEvent:
                        return false;
                    case WaygateResult.Closed:
                        _closed = true;
                        return false;
                }
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
            throw new WaygateException(op, r, LastError);
        }

        /// <summary>Sends a message (payload copied; null = empty).</summary>
        public WaygateResult Send(TrafficClass trafficClass, uint msgId, byte[] payload)
        {
            ulong seq;
            return Send(trafficClass, msgId, payload, 0, payload == null ? 0 : payload.Length, out seq);
        }

        /// <summary>Sends a message; on Ok, <paramref name="seq"/> is its client seq (0 for best-effort).</summary>
        public WaygateResult Send(TrafficClass trafficClass, uint msgId, byte[] payload, out ulong seq)
        {
            return Send(trafficClass, msgId, payload, 0, payload == null ? 0 : payload.Length, out seq);
        }

        /// <summary>
        /// Sends <paramref name="count"/> bytes of <paramref name="payload"/> from
        /// <paramref name="offset"/> (copied by the library). Returns Ok, BufferFull (keep
        /// polling and retry), Dropped (best-effort while no link is up), Closed, or another
        /// failure (then <see cref="LastError"/> says why).
        /// </summary>
        public WaygateResult Send(TrafficClass trafficClass, uint msgId, byte[] payload, int offset, int count, out ulong seq)
        {
            seq = 0;
            if (count < 0 || offset < 0 || (payload == null ? count != 0 : offset > payload.Length - count))
                throw new ArgumentOutOfRangeException("count", "offset/count outside the payload");
            GCHandle pin = default(GCHandle);
            bool added = false;
            try
            {
                IntPtr ptr = IntPtr.Zero;
                if (count > 0)
                {
                    pin = GCHandle.Alloc(payload, GCHandleType.Pinned);
                    ptr = IntPtr.Add(pin.AddrOfPinnedObject(), offset);
                }
                _handle.DangerousAddRef(ref added);
                return Native.waygate_client_send(_handle.DangerousGetHandle(), (byte)trafficClass, msgId,
                    ptr, (UIntPtr)(uint)count, out seq);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
                if (pin.IsAllocated) pin.Free();
            }
        }

        /// <summary>
        /// Sends a request (PROTOCOL.md §13) of <paramref name="trafficClass"/> (Critical or
        /// Normal) to <paramref name="msgId"/> with <paramref name="body"/> (copied; null =
        /// empty) and returns its id at once. Its outcome comes later as exactly one event with
        /// that <see cref="WaygateEvent.RequestId"/>: Answer (Status and Payload) or
        /// RequestFailed (Text: timeout after <paramref name="timeoutMs"/>, refused, expired
        /// offline, session lost, closed). Throws WaygateException when the request cannot
        /// start: BufferFull (keep polling and retry), InvalidArgument (BestEffort), Closed...
        /// </summary>
        public uint Request(TrafficClass trafficClass, uint msgId, byte[] body, uint timeoutMs)
        {
            return Request(trafficClass, msgId, body, 0, body == null ? 0 : body.Length, timeoutMs);
        }

        /// <summary>As Request(trafficClass, msgId, body, timeoutMs), with <paramref name="count"/> bytes of <paramref name="body"/> from <paramref name="offset"/>.</summary>
        public uint Request(TrafficClass trafficClass, uint msgId, byte[] body, int offset, int count, uint timeoutMs)
        {
            if (count < 0 || offset < 0 || (body == null ? count != 0 : offset > body.Length - count))
                throw new ArgumentOutOfRangeException("count", "offset/count outside the body");
            GCHandle pin = default(GCHandle);
            bool added = false;
            WaygateResult r;
            uint id;
            try
            {
                IntPtr ptr = IntPtr.Zero;
                if (count > 0)
                {
                    pin = GCHandle.Alloc(body, GCHandleType.Pinned);
                    ptr = IntPtr.Add(pin.AddrOfPinnedObject(), offset);
                }
                _handle.DangerousAddRef(ref added);
                r = Native.waygate_client_request(_handle.DangerousGetHandle(), (byte)trafficClass, msgId,
                    ptr, (UIntPtr)(uint)count, timeoutMs, out id);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
                if (pin.IsAllocated) pin.Free();
            }
            WaygateException.Check("request", r);
            return id;
        }

        /// <summary>
        /// Takes a sample of the game server's clock: a request to <paramref name="msgId"/>
        /// answered with its Unix time in ms as a big-endian u64 (the demo's TIME, 1010), and
        /// returns its id at once. When its Answer event comes, TryGetClockOffset has the
        /// updated estimate (a RequestFailed event if it fails). Throws WaygateException as
        /// Request does.
        /// </summary>
        public uint SyncClock(uint msgId, uint timeoutMs)
        {
            uint id = 0;
            WaygateException.Check("sync_clock", Call(h => Native.waygate_client_sync_clock(h, msgId, timeoutMs, out id)));
            return id;
        }

        /// <summary>
        /// The game server's clock offset estimate (server time = local Unix time +
        /// <paramref name="offsetMs"/>) and the round trip of the sample it rests on, in
        /// microseconds (the estimate is within half of it). False (both 0) before the first
        /// clock sample (SyncClock) was answered.
        /// </summary>
        public bool TryGetClockOffset(out long offsetMs, out ulong rttUs)
        {
            bool added = false;
            WaygateResult r;
            try
            {
                _handle.DangerousAddRef(ref added);
                r = Native.waygate_client_clock_offset(_handle.DangerousGetHandle(), out offsetMs, out rttUs);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
            if (r == WaygateResult.NotFound)
            {
                offsetMs = 0;
                rttUs = 0;
                return false;
            }
            WaygateException.Check("clock_offset", r);
            return true;
        }

        /// <summary>Drops the link as a network failure would (a drill): the client reconnects and resumes.</summary>
        public WaygateResult DropLink()
        {
            return Call(h => Native.waygate_client_drop_link(h));
        }

        /// <summary>Reconnects now (app back from background, network changed); the session resumes.</summary>
        public WaygateResult ReconnectNow()
        {
            return Call(h => Native.waygate_client_reconnect_now(h));
        }

        /// <summary>Pauses the client (OnApplicationPause(true)): drops the link, the session lingers on the server, no reconnect until ReconnectNow (OnApplicationPause(false)).</summary>
        public WaygateResult Pause()
        {
            return Call(h => Native.waygate_client_pause(h));
        }

        /// <summary>Replaces the auth token for the next login (copied). InvalidState before Connect(). With a session key (sealed KCP), whose key must match the token, use SetCredentials.</summary>
        public WaygateResult SetToken(byte[] token)
        {
            using (var t = new PinnedBytes(token))
            {
                return Call(h => Native.waygate_client_set_token(h, t.Ptr, t.Len));
            }
        }

        /// <summary>Replaces the connect token and the session key handed out beside it (32 bytes, or null for plain KCP from now on), both copied: sealed KCP checks the token before any resume, so a KCP-only client reconnects after its token expired only with a fresh token and its key (PROTOCOL.md §8.2.4). InvalidState before Connect().</summary>
        public WaygateResult SetCredentials(byte[] token, byte[] sessionKey)
        {
            if (sessionKey != null && sessionKey.Length != 32) throw new ArgumentException("sessionKey must be 32 bytes", "sessionKey");
            using (var t = new PinnedBytes(token))
            using (var k = new PinnedBytes(sessionKey))
            {
                return Call(h => Native.waygate_client_set_credentials(h, t.Ptr, t.Len, k.Ptr));
            }
        }

        /// <summary>A byte array pinned for one native call (NULL and length 0 when null or empty).</summary>
        private struct PinnedBytes : IDisposable
        {
            private GCHandle pin;
            public readonly IntPtr Ptr;
            public readonly UIntPtr Len;

            public PinnedBytes(byte[] bytes)
            {
                int len = bytes == null ? 0 : bytes.Length;
                pin = len > 0 ? GCHandle.Alloc(bytes, GCHandleType.Pinned) : default(GCHandle);
                Ptr = len > 0 ? pin.AddrOfPinnedObject() : IntPtr.Zero;
                Len = (UIntPtr)(uint)len;
            }

            public void Dispose()
            {
                if (pin.IsAllocated) pin.Free();
            }
        }

        /// <summary>Closes the session: a Closed event follows, then Poll returns false with IsClosed set. The edge keeps the session lingering (PROTOCOL.md §7.5); Logout() ends it.</summary>
        public WaygateResult Close()
        {
            return Call(h => Native.waygate_client_close(h));
        }

        /// <summary>As Close(), but sends CLOSE logout: the edge ends the session at once instead of letting it linger (PROTOCOL.md §7.5). InvalidState: no session was up on a link (it lingers out); Closed: the client had already ended.</summary>
        public WaygateResult Logout()
        {
            return Call(h => Native.waygate_client_logout(h));
        }

        /// <summary>Where the client is now (for a "connecting / reconnecting" screen; ConnectFailed events say why an attempt failed).</summary>
        public WaygateState State
        {
            get
            {
                if (_handle.IsClosed || _handle.IsInvalid) return WaygateState.Closed;
                bool added = false;
                try
                {
                    _handle.DangerousAddRef(ref added);
                    return (WaygateState)Native.waygate_client_state(_handle.DangerousGetHandle());
                }
                finally
                {
                    if (added) _handle.DangerousRelease();
                }
            }
        }

        /// <summary>Live statistics.</summary>
        public WaygateStats Stats
        {
            get
            {
                var s = new WaygateStats();
                WaygateException.Check("stats", CallStats(ref s));
                return s;
            }
        }

        WaygateResult CallStats(ref WaygateStats s)
        {
            bool added = false;
            try
            {
                _handle.DangerousAddRef(ref added);
                return Native.waygate_client_stats(_handle.DangerousGetHandle(), ref s);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
        }

        /// <summary>The last position of a channel this session holds; false when it is not a member.</summary>
        public bool TryGetChannelPosition(string channel, out ulong epoch, out ulong offset)
        {
            if (channel == null) throw new ArgumentNullException("channel");
            byte[] name = Native.NulTerminated(channel);
            bool added = false;
            WaygateResult r;
            try
            {
                _handle.DangerousAddRef(ref added);
                r = Native.waygate_client_channel_position(_handle.DangerousGetHandle(), name, out epoch, out offset);
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
            if (r == WaygateResult.NotFound)
            {
                epoch = 0;
                offset = 0;
                return false;
            }
            WaygateException.Check("channel_position", r);
            return true;
        }

        /// <summary>Closes the session if still open and frees the native client (may take up to ~1 s for the CLOSE to go out).</summary>
        public void Dispose()
        {
            _handle.Dispose();
        }

        delegate WaygateResult HandleCall(IntPtr handle);

        WaygateResult Call(HandleCall f)
        {
            bool added = false;
            try
            {
                // Throws ObjectDisposedException once disposed; keeps the handle alive meanwhile.
                _handle.DangerousAddRef(ref added);
                return f(_handle.DangerousGetHandle());
            }
            finally
            {
                if (added) _handle.DangerousRelease();
            }
        }

        /// <summary>Why the last failed call on this thread failed ("" if none). Read it right after the call.</summary>
        public static string LastError
        {
            get { return Native.Utf8ToString(Native.waygate_last_error()); }
        }

        /// <summary>The native library's version, e.g. "0.1.0".</summary>
        public static string Version
        {
            get { return Native.Utf8ToString(Native.waygate_version()); }
        }

        /// <summary>The library's English description of a result code.</summary>
        public static string ResultString(WaygateResult result)
        {
            return Native.Utf8ToString(Native.waygate_result_str((int)result));
        }

        /// <summary>The library's name of an event kind ("connected", "message", "answer", ...).</summary>
        public static string KindName(WaygateEventKind kind)
        {
            return Native.Utf8ToString(Native.waygate_event_kind_str((int)kind));
        }

        /// <summary>The state's name, as in every SDK ("idle", "connecting", "connected", "reconnecting", "closed").</summary>
        public static string StateName(WaygateState state)
        {
            return Native.Utf8ToString(Native.waygate_state_str((int)state));
        }

        /// <summary>The outcome's name, as in every SDK and PROTOCOL.md ("new_session", "restored", "restored_with_gap", "restore_failed_new_session").</summary>
        public static string OutcomeName(WaygateOutcome outcome)
        {
            return Native.Utf8ToString(Native.waygate_outcome_str((int)outcome));
        }
    }

    /// <summary>
    /// The raw C ABI: one extern per function of waygate.h, and structs laid out as there.
    /// Public for callers who want it; the safe API above is what games should use.
    /// </summary>
    public static class Native
    {
#if (UNITY_IOS || UNITY_TVOS) && !UNITY_EDITOR
        /// <summary>Statically linked into the player (iOS: libwaygate_client_capi.a).</summary>
        public const string Library = "__Internal";
#else
        /// <summary>libwaygate_client_capi.so / waygate_client_capi.dll / libwaygate_client_capi.dylib.</summary>
        public const string Library = "waygate_client_capi";
#endif

        /// <summary>WAYGATE_VERSION_MAJOR of the header this binding mirrors.</summary>
        public const int VersionMajor = 0;
        /// <summary>WAYGATE_VERSION_MINOR of the header this binding mirrors.</summary>
        public const int VersionMinor = 2;
        /// <summary>WAYGATE_VERSION_PATCH of the header this binding mirrors.</summary>
        public const int VersionPatch = 0;

        public const byte WAYGATE_CLASS_CRITICAL = 0;
        public const byte WAYGATE_CLASS_NORMAL = 1;
        public const byte WAYGATE_CLASS_BEST_EFFORT = 2;

        /// <summary>struct waygate_options (blittable).</summary>
        [StructLayout(LayoutKind.Sequential)]
        public struct waygate_options
        {
            public UIntPtr struct_size;      // size_t
            public IntPtr endpoints;         // const char *
            public IntPtr token;             // const uint8_t *
            public UIntPtr token_len;        // size_t
            public IntPtr ca_pem;            // const char *
            public uint udp_timeout_ms;
            public uint handshake_timeout_ms;
            public uint idle_timeout_ms;
            public uint backoff_min_ms;
            public uint backoff_max_ms;
            public uint max_unacked;
            public IntPtr session_key;       // const uint8_t * (32 bytes)
            public uint give_up_after_ms;
            public uint max_offline_age_ms;  // since 0.2
            public uint sim_latency_ms;      // since 0.2: the network simulator
            public uint sim_jitter_ms;
            public uint sim_loss_permille;
            public uint sim_seed;
            public uint give_up_after_attempts; // since 0.2
        }

        /// <summary>struct waygate_event (blittable: no marshalling copies, no GC allocation per poll).</summary>
        [StructLayout(LayoutKind.Sequential)]
        public struct waygate_event
        {
            public UIntPtr struct_size;      // size_t
            public int kind;                 // enum waygate_event_kind (a C enum: int)
            public byte traffic_class;       // uint8_t
            public ushort code;              // uint16_t
            public uint msg_id;
            public uint retry_after_ms;
            public ulong seq;
            public IntPtr payload;           // const uint8_t *
            public UIntPtr payload_len;      // size_t
            public IntPtr text;              // const char *
            // uint8_t session_id[16], as four 4-byte words in memory order: keeps the struct
            // blittable without unsafe fixed buffers. The C array starts 4-aligned on both
            // LP64 (offset 56) and ILP32 (offset 44), so the words sit exactly on it.
            public uint session_id_0;
            public uint session_id_1;
            public uint session_id_2;
            public uint session_id_3;
            public ulong channel_epoch;
            public ulong channel_offset;
            public int outcome;              // enum waygate_outcome (since 0.2)
            public uint request_id;          // since 0.2
            public ulong age_ms;             // since 0.2
        }

        internal static readonly int EventSize = Marshal.SizeOf(typeof(waygate_event));

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_client_new(ref waygate_options options);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_connect(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_tick(IntPtr client, ulong now_ms);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_poll_event(IntPtr client, ref waygate_event out_event);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_wait_event(IntPtr client, uint timeout_ms, ref waygate_event out_event);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_send(IntPtr client, byte traffic_class, uint msg_id,
            IntPtr payload, UIntPtr len, out ulong seq_out);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_request(IntPtr client, byte traffic_class, uint msg_id,
            IntPtr body, UIntPtr len, uint timeout_ms, out uint request_id_out);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_sync_clock(IntPtr client, uint msg_id, uint timeout_ms,
            out uint request_id_out);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_clock_offset(IntPtr client, out long offset_ms, out ulong rtt_us);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_drop_link(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_reconnect_now(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_pause(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_set_token(IntPtr client, IntPtr token, UIntPtr token_len);
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_set_credentials(IntPtr client, IntPtr token, UIntPtr token_len, IntPtr session_key);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_close(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_logout(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_stats(IntPtr client, ref WaygateStats out_stats);

        /// <summary><paramref name="channel"/>: NUL-terminated UTF-8 (see <see cref="NulTerminated"/>).</summary>
        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_client_channel_position(IntPtr client, byte[] channel,
            out ulong out_epoch, out ulong out_offset);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern void waygate_client_free(IntPtr client);

        // The functions below that return a char * return static or library-owned strings:
        // declared IntPtr so the marshaller never tries to free them.

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_last_error();

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_version();

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_event_kind_str(int kind);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern int waygate_client_state(IntPtr client);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_state_str(int state);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_outcome_str(int outcome);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern WaygateResult waygate_options_init(ref waygate_options out_options, UIntPtr size);

        [DllImport(Library, CallingConvention = CallingConvention.Cdecl)]
        public static extern IntPtr waygate_result_str(int code);

        /// <summary>Decodes a NUL-terminated UTF-8 string ("" for NULL).</summary>
        public static string Utf8ToString(IntPtr p)
        {
            if (p == IntPtr.Zero) return "";
            int len = 0;
            while (Marshal.ReadByte(p, len) != 0) len++;
            if (len == 0) return "";
            var bytes = new byte[len];
            Marshal.Copy(p, bytes, 0, len);
            return Encoding.UTF8.GetString(bytes);
        }

        /// <summary>s as NUL-terminated UTF-8 bytes.</summary>
        public static byte[] NulTerminated(string s)
        {
            int n = Encoding.UTF8.GetByteCount(s);
            var bytes = new byte[n + 1];
            Encoding.UTF8.GetBytes(s, 0, s.Length, bytes, 0);
            return bytes;
        }

        /// <summary>Copies s as NUL-terminated UTF-8 into unmanaged memory (IntPtr.Zero for null); release with Free.</summary>
        public static IntPtr StringToUtf8(string s)
        {
            return s == null ? IntPtr.Zero : BytesToHGlobal(NulTerminated(s));
        }

        /// <summary>Copies bytes into unmanaged memory (IntPtr.Zero for null or empty); release with Free.</summary>
        public static IntPtr BytesToHGlobal(byte[] bytes)
        {
            if (bytes == null || bytes.Length == 0) return IntPtr.Zero;
            IntPtr p = Marshal.AllocHGlobal(bytes.Length);
            Marshal.Copy(bytes, 0, p, bytes.Length);
            return p;
        }

        /// <summary>Frees what StringToUtf8 / BytesToHGlobal allocated (Zero ignored).</summary>
        public static void Free(IntPtr p)
        {
            if (p != IntPtr.Zero) Marshal.FreeHGlobal(p);
        }
    }
}
