/*
 * echo.c: the waygate C ABI in a game-loop style (tick + poll, no callbacks).
 *
 * Connects to an edge, sends N echo requests (msg id 1000, the demo player service) and
 * drops the link half way (waygate_client_drop_link, a drill for a network failure). The
 * client reconnects and resumes by itself; this program checks that every reply (msg id
 * 1001, payload "<backend>|<player>|echo-<i>") arrives exactly once and in order.
 *
 *   usage: echo ENDPOINTS TOKEN PLAYER [CA_PEM_FILE|-] [N]
 *     ENDPOINTS  comma-separated URLs, e.g. "tcp://127.0.0.1:7000"
 *     TOKEN      the auth token as base64url text (`waygate token --player alice`)
 *     PLAYER     the player id inside the token (replies name it)
 *     CA_PEM_FILE CA to trust for tls/wss/quic endpoints ("-" or absent: none)
 *     N          number of echo requests (default 20)
 *
 * Exits 0 when every check passed, 1 with a message on stderr otherwise.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "waygate.h"

#define ECHO 1000
#define ECHO_REPLY 1001

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "echo: FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

/* Decodes unpadded (or padded) base64url; returns the length, or -1 on bad input. */
static long b64url_decode(const char *in, uint8_t *out, size_t cap) {
    uint32_t acc = 0;
    int bits = 0;
    size_t n = 0;
    for (; *in && *in != '='; in++) {
        int v;
        char ch = *in;
        if (ch >= 'A' && ch <= 'Z') v = ch - 'A';
        else if (ch >= 'a' && ch <= 'z') v = ch - 'a' + 26;
        else if (ch >= '0' && ch <= '9') v = ch - '0' + 52;
        else if (ch == '-' || ch == '+') v = 62;
        else if (ch == '_' || ch == '/') v = 63;
        else return -1;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            if (n == cap) return -1;
            out[n++] = (uint8_t)(acc >> bits);
        }
    }
    return (long)n;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail("cannot open %s", path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap * 2 + 4096 + 1;
            buf = realloc(buf, cap);
            if (!buf) fail("out of memory");
        }
        size_t got = fread(buf + len, 1, 4096, f);
        len += got;
        if (got == 0) break;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

typedef struct {
    waygate_client *client;
    const char *player;
    int n;             /* requests */
    int next_reply;    /* index of the reply expected next */
    uint64_t last_seq; /* server seq of the last reply */
    int connected, restored, disconnected, closed;
    char backend[64];
} state;

static void on_message(state *s, const waygate_event *ev) {
    if (ev->msg_id != ECHO_REPLY) {
        printf("echo: ignoring message %u\n", ev->msg_id);
        return;
    }
    char text[512];
    if (ev->payload_len >= sizeof text) fail("reply too long (%zu bytes)", ev->payload_len);
    memcpy(text, ev->payload, ev->payload_len);
    text[ev->payload_len] = '\0';
    if (s->next_reply >= s->n) fail("extra reply after all %d: \"%s\"", s->n, text);
    char *bar = strchr(text, '|');
    if (!bar) fail("malformed reply \"%s\"", text);
    char want[256];
    snprintf(want, sizeof want, "%s|echo-%d", s->player, s->next_reply);
    if (strcmp(bar + 1, want) != 0)
        fail("reply %d out of order or duplicated: got \"%s\", want \"<backend>|%s\"",
             s->next_reply, text, want);
    if (ev->seq <= s->last_seq) fail("server seq went from %llu to %llu",
                                     (unsigned long long)s->last_seq,
                                     (unsigned long long)ev->seq);
    s->last_seq = ev->seq;
    *bar = '\0';
    snprintf(s->backend, sizeof s->backend, "%.63s", text);
    s->next_reply++;
}

/* Handles every event that is ready (one frame of a game loop). */
static void pump(state *s) {
    waygate_client_tick(s->client, now_ms());
    for (;;) {
        waygate_event ev = { .struct_size = sizeof ev };
        waygate_result r = waygate_client_poll_event(s->client, &ev);
        if (r == WAYGATE_NO_EVENT) return;
        if (r == WAYGATE_CLOSED) { s->closed = 1; return; }
        if (r != WAYGATE_OK) fail("poll: %s: %s", waygate_result_str(r), waygate_last_error());
        switch (ev.kind) {
        case WAYGATE_EVENT_CONNECTED:
            switch (ev.outcome) {
            case WAYGATE_OUTCOME_NEW_SESSION:
                s->connected++;
                printf("echo: connected over %s\n", ev.text);
                break;
            case WAYGATE_OUTCOME_RESTORED:
                s->restored++;
                printf("echo: session restored over %s\n", ev.text);
                break;
            default:
                fail("resume lost messages (%s)", waygate_outcome_str(ev.outcome));
            }
            break;
        case WAYGATE_EVENT_MESSAGE:
            on_message(s, &ev);
            break;
        case WAYGATE_EVENT_DISCONNECTED:
            s->disconnected++;
            printf("echo: link down (%s); the client resumes by itself\n", ev.text);
            break;
        case WAYGATE_EVENT_REJECTED:
            printf("echo: connect refused (%s), retry after %u ms\n", ev.text, ev.retry_after_ms);
            break;
        case WAYGATE_EVENT_MIGRATING:
            printf("echo: migrating to %s\n", ev.text);
            break;
        case WAYGATE_EVENT_ERROR:
            fail("message %u (seq %llu) not delivered: %s", ev.msg_id,
                 (unsigned long long)ev.seq, ev.text);
            break;
        case WAYGATE_EVENT_KICKED:
        case WAYGATE_EVENT_CLOSED:
            s->closed = 1;
            printf("echo: %s (%s)\n", waygate_event_kind_str(ev.kind), ev.text);
            break;
        default:
            break;
        }
    }
}

/* Runs the loop until `cond` holds, for at most `ms` milliseconds. */
#define WAIT_UNTIL(s, cond, ms, what)                                        \
    do {                                                                     \
        uint64_t deadline_ = now_ms() + (ms);                                \
        for (;;) {                                                           \
            pump(s);                                                         \
            if (cond) break;                                                 \
            if ((s)->closed) fail("client closed while waiting for " what);  \
            if (now_ms() > deadline_) fail("timed out waiting for " what);   \
            sleep_ms(1);                                                     \
        }                                                                    \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s ENDPOINTS TOKEN PLAYER [CA_PEM_FILE|-] [N]\n", argv[0]);
        return 2;
    }
    state s;
    memset(&s, 0, sizeof s);
    s.player = argv[3];
    s.n = argc > 5 ? atoi(argv[5]) : 20;
    if (s.n < 2 || s.n > 100000) fail("N must be between 2 and 100000");

    uint8_t token[1024];
    long token_len = b64url_decode(argv[2], token, sizeof token);
    if (token_len <= 0) fail("TOKEN is not base64url");
    char *ca = (argc > 4 && strcmp(argv[4], "-") != 0) ? read_file(argv[4]) : NULL;

    waygate_options o;
    waygate_options_init(&o, sizeof o);
    o.endpoints = argv[1];
    o.token = token;
    o.token_len = (size_t)token_len;
    o.ca_pem = ca;
    o.backoff_min_ms = 50;

    waygate_client *c = waygate_client_new(&o);
    free(ca); /* options are copied */
    if (!c) fail("waygate_client_new: %s", waygate_last_error());
    s.client = c;
    printf("echo: waygate %s, %d requests to %s\n", waygate_version(), s.n, argv[1]);

    waygate_result r = waygate_client_connect(c);
    if (r != WAYGATE_OK) fail("connect: %s", waygate_result_str(r));
    WAIT_UNTIL(&s, s.connected >= 1, 10000, "connected");

    for (int i = 0; i < s.n; i++) {
        if (i == s.n / 2) {
            r = waygate_client_drop_link(c);
            if (r != WAYGATE_OK) fail("drop_link: %s", waygate_result_str(r));
            printf("echo: dropped the link after %d requests (%d replies so far)\n", i,
                   s.next_reply);
        }
        char body[64];
        int len = snprintf(body, sizeof body, "echo-%d", i);
        uint64_t seq = 0;
        r = waygate_client_send(c, WAYGATE_CLASS_NORMAL, ECHO, (const uint8_t *)body,
                                (size_t)len, &seq);
        if (r != WAYGATE_OK)
            fail("send %d: %s: %s", i, waygate_result_str(r), waygate_last_error());
        if (seq != (uint64_t)i + 1) fail("send %d got client seq %llu", i, (unsigned long long)seq);
        pump(&s);
    }
    WAIT_UNTIL(&s, s.next_reply == s.n && s.restored >= 1, 20000, "every reply and the resume");

    /* Any duplicate arriving late fails in on_message. */
    uint64_t settle = now_ms() + 300;
    while (now_ms() < settle) {
        pump(&s);
        sleep_ms(5);
    }

    waygate_stats st;
    waygate_client_stats(c, &st);
    waygate_client_close(c);
    WAIT_UNTIL(&s, s.closed, 5000, "closed");
    waygate_client_free(c);

    printf("echo: OK: %d replies exactly once and in order from %s; %d link drop(s), "
           "%d resume(s), %llu connects, rtt %llu us over %llu samples\n",
           s.n, s.backend, s.disconnected, s.restored, (unsigned long long)st.connects,
           (unsigned long long)st.rtt_smoothed_us, (unsigned long long)st.rtt_samples);
    return 0;
}
