// Echo.cs: the waygate C# binding in a game-loop style (tick + poll, no callbacks); the
// program of client-sdk/capi/examples/echo.c, with the same arguments and exit codes, plus a
// request and a clock sample at the end (two more output lines, which echo.c does not print).
//
// Connects to an edge, sends N echo requests (msg id 1000, the demo player service) and
// drops the link half way (DropLink, a drill for a network failure). The client reconnects
// and resumes by itself; this program checks that every reply (msg id 1001, payload
// "<backend>|<player>|echo-<i>") arrives exactly once and in order. Then it sends one
// request (PROTOCOL.md §13: ASK, msg id 1011, body "why"), whose answer must be status 0 with
// body "<backend>|<player>|why", and takes one sample of the game server's clock (TIME, msg
// id 1010), and prints the answer and the clock offset estimate.
//
//   usage: mono Echo.exe ENDPOINTS TOKEN PLAYER [CA_PEM_FILE|-] [N]
//     ENDPOINTS   comma-separated URLs, e.g. "tcp://127.0.0.1:7000"
//     TOKEN       the auth token as base64url text (`waygate token --player alice`)
//     PLAYER      the player id inside the token (replies name it)
//     CA_PEM_FILE CA to trust for tls/wss/quic endpoints ("-" or absent: none)
//     N           number of echo requests (default 20)
//
// Exits 0 when every check passed, 1 with a message on stderr otherwise (2: bad usage).
//
// Build: mcs -out:Echo.exe ../Waygate.cs Echo.cs
// Run:   LD_LIBRARY_PATH=/path/to/dir/of/libwaygate_client_capi.so mono Echo.exe ...

using System;
using System.Diagnostics;
using System.IO;
using System.Text;
using System.Threading;
using Waygate;

namespace WaygateExamples
{
    sealed class FailException : Exception
    {
        public FailException(string message) : base(message) { }
    }

    sealed class Echo
    {
        const uint EchoId = 1000;
        const uint EchoReply = 1001;
        const uint TimeId = 1010;   // the demo's TIME request: its clock
        const uint AskId = 1011;    // the demo's ASK request: "<backend>|<player>|<body>"
        const uint RequestTimeoutMs = 5000;  // a RequestFailed "timeout" event past it

        static readonly Stopwatch Clock = Stopwatch.StartNew();

        static ulong NowMs()
        {
            return (ulong)Clock.ElapsedMilliseconds;
        }

        static FailException Fail(string message)
        {
            return new FailException(message);
        }

        WaygateClient client;
        string player;
        int n;              // requests
        int nextReply;      // index of the reply expected next
        ulong lastSeq;      // server seq of the last reply
        int connected, restored, disconnected;
        bool closed;
        string backend = "";
        uint askId, clockId;        // request ids (0: not sent)
        WaygateEvent askAnswer;     // the ASK's Answer event, once it came
        bool clockAnswered;

        /// Decodes unpadded (or padded) base64url (standard base64 accepted too); null on bad input.
        static byte[] B64UrlDecode(string s, int cap)
        {
            uint acc = 0;
            int bits = 0;
            var outBytes = new MemoryStream();
            foreach (char ch in s)
            {
                if (ch == '=') break;
                int v;
                if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
                else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
                else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
                else if (ch == '-' || ch == '+') v = 62;
                else if (ch == '_' || ch == '/') v = 63;
                else return null;
                acc = (acc << 6) | (uint)v;
                bits += 6;
                if (bits >= 8)
                {
                    bits -= 8;
                    if (outBytes.Length == cap) return null;
                    outBytes.WriteByte((byte)(acc >> bits));
                }
            }
            return outBytes.ToArray();
        }

        void OnMessage(WaygateEvent ev)
        {
            if (ev.MsgId != EchoReply)
            {
                Console.WriteLine("echo: ignoring message {0}", ev.MsgId);
                return;
            }
            if (ev.Payload.Length >= 512) throw Fail(string.Format("reply too long ({0} bytes)", ev.Payload.Length));
            string text = ev.PayloadText();
            if (nextReply >= n) throw Fail(string.Format("extra reply after all {0}: \"{1}\"", n, text));
            int bar = text.IndexOf('|');
            if (bar < 0) throw Fail(string.Format("malformed reply \"{0}\"", text));
            string want = string.Format("{0}|echo-{1}", player, nextReply);
            if (text.Substring(bar + 1) != want)
                throw Fail(string.Format("reply {0} out of order or duplicated: got \"{1}\", want \"<backend>|{2}\"",
                    nextReply, text, want));
            if (ev.Seq <= lastSeq) throw Fail(string.Format("server seq went from {0} to {1}", lastSeq, ev.Seq));
            lastSeq = ev.Seq;
            backend = text.Substring(0, bar);
            if (backend.Length > 63) backend = backend.Substring(0, 63);
            nextReply++;
        }

        /// An Answer event: one of the two requests this program sends.
        void OnAnswer(WaygateEvent ev)
        {
            if (ev.RequestId != 0 && ev.RequestId == askId)
            {
                if (askAnswer != null) throw Fail(string.Format("request {0} answered twice", ev.RequestId));
                askAnswer = ev;
            }
            else if (ev.RequestId != 0 && ev.RequestId == clockId)
            {
                if (clockAnswered) throw Fail(string.Format("clock request {0} answered twice", ev.RequestId));
                if (ev.Status != 0) throw Fail(string.Format("clock request answered with status {0}", ev.Status));
                clockAnswered = true;
            }
            else
            {
                throw Fail(string.Format("answer to an unknown request {0}", ev.RequestId));
            }
        }

        /// Handles every event that is ready (one frame of a game loop).
        void Pump()
        {
            client.Tick(NowMs());
            WaygateEvent ev;
            // Poll throws WaygateException ("poll: <result>: <last error>") on a failure.
            while (client.Poll(out ev))
            {
                switch (ev.Kind)
                {
                    case WaygateEventKind.Connected:
                        if (ev.Outcome == WaygateOutcome.NewSession)
                        {
                            connected++;
                            Console.WriteLine("echo: connected over {0}", ev.Text);
                        }
                        else if (ev.Outcome == WaygateOutcome.Restored)
                        {
                            restored++;
                            Console.WriteLine("echo: session restored over {0}", ev.Text);
                        }
                        else
                        {
                            throw Fail(string.Format("resume lost messages ({0})", ev.Outcome));
                        }
                        if (client.State != WaygateState.Connected)
                            throw Fail(string.Format("state {0} after a session came up", client.State));
                        break;
                    case WaygateEventKind.Message:
                        OnMessage(ev);
                        break;
                    case WaygateEventKind.Disconnected:
                        disconnected++;
                        Console.WriteLine("echo: link down ({0}); the client resumes by itself", ev.Text);
                        break;
                    case WaygateEventKind.Rejected:
                        Console.WriteLine("echo: connect refused ({0}), retry after {1} ms", ev.Text, ev.RetryAfterMs);
                        break;
                    case WaygateEventKind.Migrating:
                        Console.WriteLine("echo: migrating to {0}", ev.Text);
                        break;
                    case WaygateEventKind.Error:
                        throw Fail(string.Format("message {0} (seq {1}) not delivered: {2}", ev.MsgId, ev.Seq, ev.Text));
                    case WaygateEventKind.Answer:
                        OnAnswer(ev);
                        break;
                    case WaygateEventKind.RequestFailed:
                        throw Fail(string.Format("request {0} ({1}) failed: {2} (code {3}, retry after {4} ms)",
                            ev.RequestId, ev.RequestId == askId ? "ask" : ev.RequestId == clockId ? "clock" : "unknown",
                            ev.Text, ev.Code, ev.RetryAfterMs));
                    case WaygateEventKind.Kicked:
                    case WaygateEventKind.Closed:
                        closed = true;
                        Console.WriteLine("echo: {0} ({1})", WaygateClient.KindName(ev.Kind), ev.Text);
                        break;
                    default:
                        break;
                }
            }
            if (client.IsClosed) closed = true;
        }

        /// Runs the loop until cond holds, for at most ms milliseconds.
        void WaitUntil(Func<bool> cond, ulong ms, string what)
        {
            ulong deadline = NowMs() + ms;
            for (;;)
            {
                Pump();
                if (cond()) break;
                if (closed) throw Fail("client closed while waiting for " + what);
                if (NowMs() > deadline) throw Fail("timed out waiting for " + what);
                Thread.Sleep(1);
            }
        }

        int Run(string[] args)
        {
            player = args[2];
            int parsed;
            n = args.Length > 4 && int.TryParse(args[4], out parsed) ? parsed : (args.Length > 4 ? 0 : 20);
            if (n < 2 || n > 100000) throw Fail("N must be between 2 and 100000");

            byte[] token = B64UrlDecode(args[1], 1024);
            if (token == null || token.Length == 0) throw Fail("TOKEN is not base64url");
            string ca = null;
            if (args.Length > 3 && args[3] != "-")
            {
                try
                {
                    ca = File.ReadAllText(args[3], Encoding.UTF8);
                }
                catch (Exception)
                {
                    throw Fail("cannot open " + args[3]);
                }
            }

            var options = new WaygateOptions
            {
                Endpoints = args[0],
                Token = token,
                CaPem = ca,
                BackoffMinMs = 50,
            };
            try
            {
                client = new WaygateClient(options);
            }
            catch (WaygateException e)
            {
                throw Fail("waygate_client_new: " + e.Detail);
            }
            using (client)
            {
                Console.WriteLine("echo: waygate {0}, {1} requests to {2}", WaygateClient.Version, n, args[0]);

                try
                {
                    client.Connect();
                }
                catch (WaygateException e)
                {
                    throw Fail("connect: " + WaygateClient.ResultString(e.Result));
                }
                WaitUntil(() => connected >= 1, 10000, "connected");

                for (int i = 0; i < n; i++)
                {
                    WaygateResult r;
                    if (i == n / 2)
                    {
                        r = client.DropLink();
                        if (r != WaygateResult.Ok) throw Fail("drop_link: " + WaygateClient.ResultString(r));
                        Console.WriteLine("echo: dropped the link after {0} requests ({1} replies so far)", i, nextReply);
                    }
                    byte[] body = Encoding.UTF8.GetBytes("echo-" + i);
                    ulong seq;
                    r = client.Send(TrafficClass.Normal, EchoId, body, out seq);
                    if (r != WaygateResult.Ok)
                        throw Fail(string.Format("send {0}: {1}: {2}", i, WaygateClient.ResultString(r), WaygateClient.LastError));
                    if (seq != (ulong)i + 1) throw Fail(string.Format("send {0} got client seq {1}", i, seq));
                    Pump();
                }
                WaitUntil(() => nextReply == n && restored >= 1, 20000, "every reply and the resume");

                // Any duplicate arriving late fails in OnMessage.
                ulong settle = NowMs() + 300;
                while (NowMs() < settle)
                {
                    Pump();
                    Thread.Sleep(5);
                }

                // A request and a clock sample: each returns its id at once; its Answer (or
                // RequestFailed) event comes later through Poll.
                long offsetMs;
                ulong rttUs;
                if (client.TryGetClockOffset(out offsetMs, out rttUs))
                    throw Fail(string.Format("a clock offset ({0} ms) before any clock sample", offsetMs));
                // Request and SyncClock throw WaygateException ("request: <result>: <last error>")
                // when they cannot start.
                askId = client.Request(TrafficClass.Normal, AskId, Encoding.UTF8.GetBytes("why"), RequestTimeoutMs);
                clockId = client.SyncClock(TimeId, RequestTimeoutMs);
                if (askId == clockId) throw Fail(string.Format("two requests got the same id {0}", askId));
                WaitUntil(() => askAnswer != null && clockAnswered, 10000, "the request's answer and the clock sample");
                string answer = askAnswer.PayloadText();
                string wantAnswer = string.Format("{0}|{1}|why", backend, player);
                if (askAnswer.Status != 0 || answer != wantAnswer)
                    throw Fail(string.Format("request answered with status {0} and \"{1}\", want status 0 and \"{2}\"",
                        askAnswer.Status, answer, wantAnswer));
                Console.WriteLine("echo: request answered: {0}", answer);
                if (!client.TryGetClockOffset(out offsetMs, out rttUs))
                    throw Fail("no clock offset after the clock sample was answered");
                Console.WriteLine("echo: clock offset {0} ms (rtt {1} us)", offsetMs, rttUs);

                WaygateStats st = client.Stats;
                client.Close();
                WaitUntil(() => closed, 5000, "closed");
                // `using` frees the native client here (waygate_client_free).

                Console.WriteLine("echo: OK: {0} replies exactly once and in order from {1}; {2} link drop(s), "
                    + "{3} resume(s), {4} connects, rtt {5} us over {6} samples",
                    n, backend, disconnected, restored, st.Connects, st.RttSmoothedUs, st.RttSamples);
            }
            return 0;
        }

        static int Main(string[] args)
        {
            if (args.Length < 3)
            {
                Console.Error.WriteLine("usage: Echo.exe ENDPOINTS TOKEN PLAYER [CA_PEM_FILE|-] [N]");
                return 2;
            }
            try
            {
                return new Echo().Run(args);
            }
            catch (FailException e)
            {
                Console.Out.Flush();
                Console.Error.WriteLine("echo: FAIL: " + e.Message);
                return 1;
            }
            catch (DllNotFoundException e)
            {
                Console.Error.WriteLine("echo: FAIL: cannot load the native library waygate_client_capi ({0}): "
                    + "put libwaygate_client_capi.so on LD_LIBRARY_PATH (or next to Echo.exe)", e.Message);
                return 1;
            }
            catch (WaygateException e)
            {
                // From Poll: "poll: <result>: <last error>", as echo.c prints it; from Request
                // and SyncClock: "request: ..." / "sync_clock: ...".
                Console.Out.Flush();
                Console.Error.WriteLine("echo: FAIL: " + e.Message);
                return 1;
            }
        }
    }
}
