// A check of the managed half of the bridge without Unity (Unity skips folders ending in
// "~"): compiled with Runtime/WaygateWebGLClient.cs by mcs and run by mono from
// client-sdk/js/test/webgl-bridge.test.mjs (skipped there when mcs or mono is missing).
//
// First it prints the options JSON of WaygateWebGLOptions.ToJson() (the test creates a
// client with it through the .jslib). Then it reads event JSON lines, as WaygateWebGL_Poll
// wrote them, from stdin and prints, for each, the typed properties C# code reads, as one
// JSON line the test compares with what the JS side sent.

using System;
using System.Text;
using Waygate.WebGL;

static class BridgeJsonCheck
{
    static int Main()
    {
        var options = new WaygateWebGLOptions
        {
            Urls = new[] { "ws://edge-a/", "ws://edge-\"b\"/" },
            TokenBytes = new byte[] { 0xaa, 0xbb, 0xfb, 0xff },
            BackoffMinMs = 1,
            BackoffMaxMs = 8,
            MaxOfflineAgeMs = 2500,
            LifecycleHooks = false,
        };
        Console.WriteLine(options.ToJson());
        if (Base64Url.Encode(Base64Url.Decode("qrv7_w")) != "qrv7_w") return Fail("base64url round trip");

        string line;
        while ((line = Console.ReadLine()) != null)
        {
            if (line.Length == 0) continue;
            WebGLEvent ev = WebGLEvent.Parse(line);
            var sb = new StringBuilder("{");
            Field(sb, "kind", ev.Kind.ToString());
            Field(sb, "kindName", ev.KindName);
            Field(sb, "outcome", ev.Outcome.ToString());
            Field(sb, "from", ev.From.ToString());
            Field(sb, "to", ev.To.ToString());
            Field(sb, "msgId", ev.MsgId.ToString());
            Field(sb, "seq", ev.Seq.ToString());
            Field(sb, "offset", ev.Offset.ToString());
            Field(sb, "trafficClass", ev.TrafficClass.ToString());
            Field(sb, "payloadText", ev.PayloadText());
            Field(sb, "payloadLength", ev.Payload.Length.ToString());
            Field(sb, "code", ev.Code.ToString());
            Field(sb, "sessionId", ev.SessionId ?? "(null)");
            Field(sb, "channel", ev.Channel ?? "(null)");
            Field(sb, "channelKind", ev.ChannelKind ?? "(null)");
            Field(sb, "reason", ev.Reason ?? "(null)");
            Field(sb, "count", ev.Count.ToString());
            Field(sb, "ageMs", ev.AgeMs.ToString());
            Field(sb, "terminal", ev.IsTerminal ? "true" : "false");
            Field(sb, "requestId", ev.RequestId.ToString());
            Field(sb, "status", ev.Status.ToString());
            Field(sb, "failure", ev.Failure.ToString());
            Field(sb, "label", ev.Label ?? "(null)");
            Field(sb, "retryAfterMs", ev.RetryAfterMs.ToString());
            sb.Length--; // the last comma
            Console.WriteLine(sb.Append('}').ToString());
        }
        return 0;
    }

    static void Field(StringBuilder sb, string key, string value)
    {
        sb.Append('"').Append(key).Append("\":");
        sb.Append('"');
        foreach (char c in value)
        {
            if (c == '"' || c == '\\') sb.Append('\\').Append(c);
            else if (c < 0x20) sb.Append("\\u").Append(((int)c).ToString("x4"));
            else sb.Append(c);
        }
        sb.Append("\",");
    }

    static int Fail(string what)
    {
        Console.Error.WriteLine("FAILED: " + what);
        return 1;
    }
}
