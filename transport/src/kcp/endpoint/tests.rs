//! Sans-IO tests of the endpoint: a virtual clock and in-memory delivery with settable loss
//! (quinn-proto's `Pair` habit). No sockets, no sleeps; every loop is bounded.

use super::*;
use crate::kcp::cookie;
use proptest::prelude::*;
use rand::SeedableRng;
use waygate_protocol::frame::Data;
use waygate_protocol::wire::TrafficClass;

const SERVER: &str = "10.0.0.1:9000";
const LATENCY: Duration = Duration::from_millis(5);
const IDLE: Duration = Duration::from_secs(30);
const MAX_FRAME: usize = 16 * 1024;

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("addr")
}

fn client_addr(n: usize) -> SocketAddr {
    SocketAddr::new([10, 0, 1, n as u8 + 1].into(), 5000 + n as u16)
}

fn conn_cfg() -> ConnConfig {
    ConnConfig {
        max_frame_size: MAX_FRAME,
        idle_timeout: Some(IDLE),
        handshake_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

/// The first client sends `frame_bytes(i, len)` for i from `*queued` while its send queue
/// takes them, up to `total`.
fn send_while_room(net: &mut Net, ckey: ConvKey, queued: &mut u64, total: u64, len: usize) {
    while *queued < total && net.clients[0].1.can_send(ckey) {
        let now = net.now;
        net.clients[0]
            .1
            .send(now, ckey, &frame_bytes(*queued, len))
            .expect("send");
        *queued += 1;
    }
}

fn frame_bytes(i: u64, len: usize) -> Bytes {
    Frame::Data(Data {
        class: TrafficClass::Normal,
        msg_id: 7,
        seq: i,
        ack: None,
        payload: Bytes::from(vec![i as u8; len]),
    })
    .to_bytes()
}

struct Packet {
    at: Instant,
    from: SocketAddr,
    to: SocketAddr,
    payload: Vec<u8>,
}

/// A server and clients on a virtual network.
struct Net {
    now: Instant,
    server_addr: SocketAddr,
    server: KcpEndpoint,
    clients: Vec<(SocketAddr, KcpEndpoint)>,
    server_events: Vec<KcpEvent>,
    client_events: Vec<Vec<KcpEvent>>,
    in_flight: Vec<Packet>,
    loss: f64,
    rng: StdRng,
    /// Every datagram the server sent: (to, len).
    server_sent: Vec<(SocketAddr, Vec<u8>)>,
    /// Drop everything in flight (a cut cable).
    blackhole: bool,
}

impl Net {
    fn new(config: KcpConfig, conn: ConnConfig) -> Self {
        let now = Instant::now();
        let server =
            KcpEndpoint::server(config, &conn, now, StdRng::seed_from_u64(1)).expect("server");
        Self {
            now,
            server_addr: addr(SERVER),
            server,
            clients: Vec::new(),
            server_events: Vec::new(),
            client_events: Vec::new(),
            in_flight: Vec::new(),
            loss: 0.0,
            rng: StdRng::seed_from_u64(2),
            server_sent: Vec::new(),
            blackhole: false,
        }
    }

    fn add_client(&mut self, config: KcpConfig, conn: ConnConfig) -> usize {
        let n = self.clients.len();
        let ep = KcpEndpoint::client(
            config,
            &conn,
            self.now,
            StdRng::seed_from_u64(100 + n as u64),
            self.server_addr,
        )
        .expect("client");
        self.clients.push((client_addr(n), ep));
        self.client_events.push(Vec::new());
        n
    }

    fn collect(&mut self) {
        while let Some(t) = self.server.poll_transmit() {
            self.server_sent.push((t.dest, t.payload.clone()));
            self.enqueue(self.server_addr, t);
        }
        for i in 0..self.clients.len() {
            let from = self.clients[i].0;
            while let Some(t) = self.clients[i].1.poll_transmit() {
                self.enqueue(from, t);
            }
        }
        while let Some(e) = self.server.poll_event() {
            self.server_events.push(e);
        }
        for (i, (_, ep)) in self.clients.iter_mut().enumerate() {
            while let Some(e) = ep.poll_event() {
                self.client_events[i].push(e);
            }
        }
    }

    fn enqueue(&mut self, from: SocketAddr, t: Transmit) {
        if self.blackhole || (self.loss > 0.0 && self.rng.random::<f64>() < self.loss) {
            return;
        }
        self.in_flight.push(Packet {
            at: self.now + LATENCY,
            from,
            to: t.dest,
            payload: t.payload,
        });
    }

    /// Delivers a datagram to the server right now (as an attacker would).
    fn inject(&mut self, from: SocketAddr, payload: &[u8]) {
        self.server.handle_datagram(self.now, from, payload);
        self.collect();
    }

    /// Replies the server sent since `mark` (index into `server_sent`).
    fn replies_since(&self, mark: usize) -> Vec<Vec<u8>> {
        self.server_sent[mark..]
            .iter()
            .map(|(_, p)| p.clone())
            .collect()
    }

    fn next_time(&mut self) -> Option<Instant> {
        let mut next = self.in_flight.iter().map(|p| p.at).min();
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        };
        consider(self.server.poll_timeout());
        for (_, ep) in &mut self.clients {
            consider(ep.poll_timeout());
        }
        next
    }

    /// One step: jump to the next event (at most `limit` ahead), deliver, fire timers.
    fn step(&mut self, limit: Duration) -> bool {
        self.collect();
        let Some(next) = self.next_time() else {
            return false;
        };
        if next > self.now + limit {
            return false;
        }
        self.now = self.now.max(next);
        let now = self.now;
        let due: Vec<Packet> = {
            let (due, later) = std::mem::take(&mut self.in_flight)
                .into_iter()
                .partition(|p| p.at <= now);
            self.in_flight = later;
            due
        };
        self.deliver(now, due);
        if self.server.poll_timeout().is_some_and(|t| t <= now) {
            self.server.handle_timeout(now);
        }
        for (_, ep) in &mut self.clients {
            if ep.poll_timeout().is_some_and(|t| t <= now) {
                ep.handle_timeout(now);
            }
        }
        self.collect();
        true
    }

    /// Hands `packets` to their endpoints at `now`.
    fn deliver(&mut self, now: Instant, packets: Vec<Packet>) {
        for p in packets {
            if p.to == self.server_addr {
                self.server.handle_datagram(now, p.from, &p.payload);
            } else if let Some((_, ep)) = self.clients.iter_mut().find(|(a, _)| *a == p.to) {
                ep.handle_datagram(now, p.from, &p.payload);
            }
        }
    }

    /// Steps until `done` holds (bounded by steps and virtual time).
    fn run_until(&mut self, mut done: impl FnMut(&mut Net) -> bool) {
        let start = self.now;
        for _ in 0..200_000 {
            if done(self) {
                return;
            }
            if self.now > start + Duration::from_secs(120) || !self.step(Duration::from_secs(60)) {
                break;
            }
        }
        assert!(done(self), "condition not reached in bounded time");
    }

    /// Steps while anything happens within `quiet` of now.
    fn settle(&mut self, quiet: Duration) {
        for _ in 0..100_000 {
            if !self.step(quiet) {
                return;
            }
        }
        panic!("network did not settle");
    }

    fn client_key(&self, n: usize) -> Option<ConvKey> {
        self.client_events[n].iter().find_map(|e| match e {
            KcpEvent::Connected(k) => Some(*k),
            _ => None,
        })
    }

    fn server_key_for(&self, n: usize) -> Option<ConvKey> {
        let a = self.clients[n].0;
        self.server_events.iter().find_map(|e| match e {
            KcpEvent::Connected(k) if k.addr == a => Some(*k),
            _ => None,
        })
    }

    fn connect(&mut self, n: usize) -> (ConvKey, ConvKey) {
        self.run_until(|net| net.client_key(n).is_some() && net.server_key_for(n).is_some());
        (
            self.client_key(n).expect("client key"),
            self.server_key_for(n).expect("server key"),
        )
    }

    fn messages(events: &[KcpEvent], key: ConvKey) -> Vec<Bytes> {
        events
            .iter()
            .filter_map(|e| match e {
                KcpEvent::Message(k, m) if *k == key => Some(m.clone()),
                _ => None,
            })
            .collect()
    }

    fn server_messages(&self, key: ConvKey) -> Vec<Bytes> {
        Self::messages(&self.server_events, key)
    }

    /// The server's reader takes every message delivered to `key` after the first `taken`,
    /// giving their credit (count and bytes) back, until no more arrive; `unread` sees each
    /// batch as it was delivered and not yet read.
    fn take_delivered(
        &mut self,
        now: Instant,
        key: ConvKey,
        taken: &mut usize,
        mut unread: impl FnMut(&[Bytes]),
    ) {
        for _ in 0..1000 {
            self.collect();
            let delivered = self.server_messages(key);
            if delivered.len() == *taken {
                return;
            }
            let batch = &delivered[*taken..];
            unread(batch);
            let bytes = batch.iter().map(Bytes::len).sum();
            self.server.consumed(now, key, batch.len(), bytes);
            *taken = delivered.len();
        }
    }

    fn client_messages(&self, n: usize, key: ConvKey) -> Vec<Bytes> {
        Self::messages(&self.client_events[n], key)
    }
}

fn pair() -> (Net, ConvKey, ConvKey) {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    net.add_client(KcpConfig::fast(), conn_cfg());
    let (c, s) = net.connect(0);
    (net, c, s)
}

/// A HELLO from `from`, and the COOKIE the server answers with.
fn get_cookie(net: &mut Net, from: SocketAddr, nonce: u64) -> Cookie {
    let mark = net.server_sent.len();
    net.inject(
        from,
        &Control::Hello {
            client_nonce: nonce,
        }
        .encode(),
    );
    let replies = net.replies_since(mark);
    assert_eq!(replies.len(), 1);
    match Control::decode(&replies[0]) {
        Some(Control::Cookie(c)) => c,
        other => panic!("expected a cookie, got {other:?}"),
    }
}

#[test]
fn cookie_exchange_creates_one_session_each_side_and_carries_messages() {
    let (mut net, ckey, skey) = pair();
    assert_eq!(
        ckey,
        ConvKey {
            addr: net.server_addr,
            conv: skey.conv
        }
    );
    assert_eq!(skey.addr, client_addr(0));
    assert_ne!(skey.conv, 0);
    assert_eq!(net.server.session_count(), 1);
    assert_eq!(KcpStats::get(&net.server.stats().cookies_sent), 1);
    let now = net.now;
    net.clients[0]
        .1
        .send(now, ckey, &frame_bytes(1, 10))
        .expect("send");
    net.server
        .send(now, skey, &frame_bytes(2, 20))
        .expect("send");
    net.run_until(|n| {
        !n.server_messages(skey).is_empty() && !n.client_messages(0, ckey).is_empty()
    });
    assert_eq!(net.server_messages(skey), vec![frame_bytes(1, 10)]);
    assert_eq!(net.client_messages(0, ckey), vec![frame_bytes(2, 20)]);
}

#[test]
fn handshake_survives_lost_hello_and_connect() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    net.blackhole = true;
    net.add_client(KcpConfig::fast(), conn_cfg());
    net.collect(); // first HELLO lost
    net.blackhole = false;
    net.loss = 0.5;
    let (_, skey) = net.connect(0);
    assert_eq!(net.server.session_count(), 1);
    assert!(net.server.has_session(skey));
}

#[test]
fn every_reply_is_no_larger_than_its_request() {
    let mut config = KcpConfig::fast();
    config.max_sessions = 1;
    let mut net = Net::new(config, conn_cfg());
    let a = client_addr(7);
    let hello = Control::Hello { client_nonce: 1 }.encode();
    let old = get_cookie(&mut net, client_addr(10), 5);
    // HELLO (64) -> COOKIE (42).
    let cookie = get_cookie(&mut net, a, 1);
    assert!(cookie::COOKIE_LEN <= hello.len());
    // CONNECT (64) -> ACCEPT (14); again -> ACCEPT (idempotent).
    let connect = Control::Connect(cookie).encode();
    for _ in 0..2 {
        let mark = net.server_sent.len();
        net.inject(a, &connect);
        let replies = net.replies_since(mark);
        assert_eq!(replies.len(), 1);
        assert_eq!(
            Control::decode(&replies[0]),
            Some(Control::Accept { conv: cookie.conv })
        );
        assert!(replies[0].len() <= connect.len());
    }
    assert_eq!(net.server.session_count(), 1);
    // Over the cap: HELLO (64) -> BUSY (24).
    let mark = net.server_sent.len();
    net.inject(client_addr(8), &hello);
    let replies = net.replies_since(mark);
    assert_eq!(replies.len(), 1);
    assert!(matches!(
        Control::decode(&replies[0]),
        Some(Control::Busy {
            code: CloseCode::Overloaded,
            client_nonce: 1,
            ..
        })
    ));
    assert!(replies[0].len() <= hello.len());
    // A segment for no session (24 bytes) -> RESET (16).
    let mut segment = vec![0u8; 24];
    segment[..4].copy_from_slice(&0x1234_5678u32.to_le_bytes());
    segment[4] = 81;
    let mark = net.server_sent.len();
    net.inject(client_addr(9), &segment);
    let replies = net.replies_since(mark);
    assert_eq!(replies.len(), 1);
    assert_eq!(
        Control::decode(&replies[0]),
        Some(Control::Reset {
            conv: 0x1234_5678,
            code: CloseCode::GoingAway
        })
    );
    assert!(replies[0].len() <= segment.len());
    // An expired cookie (64) -> a fresh COOKIE (42) or BUSY (24).
    net.now += Duration::from_secs(12);
    let connect = Control::Connect(old).encode();
    let mark = net.server_sent.len();
    net.inject(client_addr(10), &connect);
    for reply in net.replies_since(mark) {
        assert!(reply.len() <= connect.len());
    }
    // A real session's own datagrams are not replies; everything else sent so far was.
    for (_, p) in &net.server_sent {
        assert!(p.len() <= cookie::PADDED_LEN, "reply of {} bytes", p.len());
    }
}

#[test]
fn bad_mac_expired_cookie_and_wrong_address_create_no_session() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    let a = client_addr(1);
    let cookie = get_cookie(&mut net, a, 42);
    let stats = net.server.stats();
    // Tampered MAC.
    let mut forged = cookie;
    forged.mac[0] ^= 1;
    net.inject(a, &Control::Connect(forged).encode());
    // Another conv with the same MAC.
    net.inject(
        a,
        &Control::Connect(Cookie {
            conv: cookie.conv ^ 1,
            ..cookie
        })
        .encode(),
    );
    // The right cookie from another address or port.
    net.inject(client_addr(2), &Control::Connect(cookie).encode());
    net.inject(
        SocketAddr::new(a.ip(), a.port() + 1),
        &Control::Connect(cookie).encode(),
    );
    assert_eq!(KcpStats::get(&stats.bad_macs), 4);
    assert_eq!(net.server.session_count(), 0);
    // Expired.
    net.now += Duration::from_secs(11);
    let mark = net.server_sent.len();
    net.inject(a, &Control::Connect(cookie).encode());
    assert_eq!(KcpStats::get(&stats.expired_cookies), 1);
    assert_eq!(net.server.session_count(), 0);
    let replies = net.replies_since(mark);
    assert!(matches!(
        Control::decode(&replies[0]),
        Some(Control::Cookie(_))
    ));
    // Short CONNECT: ignored.
    let fresh = get_cookie(&mut net, a, 43);
    let connect = Control::Connect(fresh).encode();
    let mark = net.server_sent.len();
    net.inject(a, &connect[..63]);
    assert!(net.replies_since(mark).is_empty());
    assert_eq!(net.server.session_count(), 0);
    // And the genuine article works.
    net.inject(a, &connect);
    assert_eq!(net.server.session_count(), 1);
    assert!(net
        .server_events
        .iter()
        .all(|e| matches!(e, KcpEvent::Connected(k) if k.addr == a)));
}

#[test]
fn short_hello_is_ignored() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    let hello = Control::Hello { client_nonce: 9 }.encode();
    for len in [0, 4, 10, 18, 40, 63] {
        net.inject(client_addr(1), &hello[..len]);
    }
    assert!(net.server_sent.is_empty());
    assert_eq!(KcpStats::get(&net.server.stats().cookies_sent), 0);
    assert_eq!(net.server.session_count(), 0);
}

#[test]
fn cookie_replies_are_rate_limited() {
    let mut config = KcpConfig::fast();
    config.cookie_burst = 5;
    config.cookie_rate_per_sec = 1;
    config.reject_rate_per_sec = 3;
    let mut net = Net::new(config, conn_cfg());
    let hello = Control::Hello { client_nonce: 1 }.encode();
    for i in 0..20 {
        net.inject(client_addr(i), &hello);
    }
    let stats = net.server.stats();
    assert_eq!(KcpStats::get(&stats.cookies_sent), 5);
    assert_eq!(KcpStats::get(&stats.busy_sent), 3);
    assert_eq!(net.server_sent.len(), 8);
    assert_eq!(net.server.session_count(), 0);
}

#[test]
fn cookie_rate_refusals_spread_their_retry_after_hints() {
    // A storm of resumes over the cookie rate: each refused client gets a slot of its own,
    // one token apart, instead of one fixed hint that brings them all back at once.
    let mut config = KcpConfig::fast();
    config.cookie_burst = 5;
    config.cookie_rate_per_sec = 100;
    config.reject_rate_per_sec = 1000;
    let mut net = Net::new(config, conn_cfg());
    let mark = net.server_sent.len();
    for i in 0..20 {
        let hello = Control::Hello {
            client_nonce: i as u64,
        }
        .encode();
        net.inject(client_addr(i), &hello);
    }
    let hints: Vec<u32> = net
        .replies_since(mark)
        .iter()
        .filter_map(|r| match Control::decode(r) {
            Some(Control::Busy {
                code: CloseCode::Overloaded,
                retry_after_ms,
                ..
            }) => Some(retry_after_ms),
            _ => None,
        })
        .collect();
    assert_eq!(hints.len(), 15, "{hints:?}");
    // 10 ms apart (one token at 100/s), the first after the bucket's own wait.
    for (i, pair) in hints.windows(2).enumerate() {
        assert_eq!(pair[1] - pair[0], 10, "hint {i}: {hints:?}");
    }
    assert!((1..=10).contains(&hints[0]), "{hints:?}");
}

#[test]
fn session_cap_answers_busy_and_the_client_reports_it() {
    let mut config = KcpConfig::fast();
    config.max_sessions = 1;
    let mut net = Net::new(config, conn_cfg());
    // A cookie handed out while there was room...
    let early = get_cookie(&mut net, client_addr(5), 77);
    net.add_client(KcpConfig::fast(), conn_cfg());
    net.connect(0);
    // ... is answered BUSY once the cap is reached.
    let mark = net.server_sent.len();
    net.inject(client_addr(5), &Control::Connect(early).encode());
    let replies = net.replies_since(mark);
    assert!(matches!(
        Control::decode(&replies[0]),
        Some(Control::Busy {
            client_nonce: 77,
            code: CloseCode::Overloaded,
            ..
        })
    ));
    // A second client endpoint fails its handshake with Refused.
    net.add_client(KcpConfig::fast(), conn_cfg());
    net.run_until(|n| !n.client_events[1].is_empty());
    assert!(matches!(
        net.client_events[1][0],
        KcpEvent::HandshakeFailed(HandshakeError::Refused {
            code: CloseCode::Overloaded,
            retry_after_ms: 1000
        })
    ));
    assert_eq!(net.server.session_count(), 1);
}

#[test]
fn handshake_times_out_without_a_server() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    net.blackhole = true;
    net.add_client(KcpConfig::fast(), conn_cfg());
    net.run_until(|n| !n.client_events[0].is_empty());
    assert_eq!(
        net.client_events[0],
        vec![KcpEvent::HandshakeFailed(HandshakeError::TimedOut)]
    );
    assert!(net.now >= net.clients[0].1.epoch + Duration::from_secs(10));
    assert_eq!(net.clients[0].1.poll_timeout(), None);
}

/// Captures the next KCP segment the client sends.
fn capture_client_segment(net: &mut Net, n: usize, key: ConvKey, i: u64) -> Vec<u8> {
    let now = net.now;
    net.clients[n]
        .1
        .send(now, key, &frame_bytes(i, 30))
        .expect("send");
    let t = net.clients[n].1.poll_transmit().expect("a segment");
    assert!(!is_control(&t.payload));
    t.payload
}

/// Hardening issue, item 3: a datagram longer than the endpoint's mtu is dropped before the
/// engine sees it (counted), even with a live session's conv from its own address; the
/// session is undisturbed.
#[test]
fn a_datagram_over_the_mtu_is_dropped_unread() {
    let (mut net, ckey, skey) = pair();
    let stats = net.server.stats();
    let mut segment = capture_client_segment(&mut net, 0, ckey, 1);
    segment.resize(KcpConfig::fast().mtu + 1, 0);
    let mark = net.server_sent.len();
    net.inject(skey.addr, &segment);
    assert_eq!(KcpStats::get(&stats.oversized_datagrams), 1);
    assert!(net.replies_since(mark).is_empty(), "no reply");
    assert!(net.server_messages(skey).is_empty());
    assert_eq!(net.server.session_count(), 1);
    // The session still works.
    let now = net.now;
    net.server
        .send(now, skey, &frame_bytes(3, 5))
        .expect("send");
    net.run_until(|n| !n.client_messages(0, ckey).is_empty());
    assert_eq!(net.client_messages(0, ckey), vec![frame_bytes(3, 5)]);
}

#[test]
fn known_conv_from_another_address_is_dropped_and_the_session_is_undisturbed() {
    let (mut net, ckey, skey) = pair();
    let segment = capture_client_segment(&mut net, 0, ckey, 1);
    let stats = net.server.stats();
    let mark = net.server_sent.len();
    // Replayed from another port and another host, plus a crafted one (huge sn/una).
    net.inject(
        SocketAddr::new(skey.addr.ip(), skey.addr.port() + 1),
        &segment,
    );
    net.inject(client_addr(99), &segment);
    let mut crafted = segment.clone();
    crafted[12..16].copy_from_slice(&0x8000_0000u32.to_le_bytes());
    crafted[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    net.inject(client_addr(99), &crafted);
    assert_eq!(KcpStats::get(&stats.foreign_segments), 3);
    assert!(
        net.replies_since(mark).is_empty(),
        "no reply to foreign segments"
    );
    assert_eq!(net.server.session_count(), 1);
    assert!(net.server_messages(skey).is_empty());
    // The real session still works both ways, and gets the message exactly once.
    net.in_flight.push(Packet {
        at: net.now,
        from: skey.addr,
        to: net.server_addr,
        payload: segment,
    });
    let now = net.now;
    net.server
        .send(now, skey, &frame_bytes(3, 5))
        .expect("send");
    net.run_until(|n| {
        !n.server_messages(skey).is_empty() && !n.client_messages(0, ckey).is_empty()
    });
    net.settle(Duration::from_millis(200));
    assert_eq!(net.server_messages(skey), vec![frame_bytes(1, 30)]);
    assert_eq!(net.client_messages(0, ckey), vec![frame_bytes(3, 5)]);
    assert!(net
        .server_events
        .iter()
        .all(|e| !matches!(e, KcpEvent::Closed(..))));
}

#[test]
fn segment_without_cookie_creates_nothing_and_gets_at_most_a_small_reset() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    // A perfectly valid first segment of conv 0xABCD (what a tokio_kcp client would send).
    let mut seg = vec![0u8; 24 + 8];
    seg[..4].copy_from_slice(&0xABCDu32.to_le_bytes());
    seg[4] = 81;
    seg[20..24].copy_from_slice(&8u32.to_le_bytes());
    seg[24..].copy_from_slice(b"hi there");
    let mark = net.server_sent.len();
    net.inject(client_addr(3), &seg);
    assert_eq!(net.server.session_count(), 0);
    let replies = net.replies_since(mark);
    assert!(replies.len() <= 1);
    for r in replies {
        assert!(r.len() <= seg.len());
        assert!(matches!(
            Control::decode(&r),
            Some(Control::Reset { conv: 0xABCD, .. })
        ));
    }
    assert!(net.server_events.is_empty());
}

#[test]
fn a_panic_in_one_session_closes_only_that_session() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    net.add_client(KcpConfig::fast(), conn_cfg());
    net.add_client(KcpConfig::fast(), conn_cfg());
    let (c0, s0) = net.connect(0);
    let (c1, s1) = net.connect(1);
    net.server.inject_panic(s0);
    let now = net.now;
    net.clients[0]
        .1
        .send(now, c0, &frame_bytes(1, 10))
        .expect("send");
    net.clients[1]
        .1
        .send(now, c1, &frame_bytes(2, 10))
        .expect("send");
    net.run_until(|n| !n.server_messages(s1).is_empty() && !n.server.has_session(s0));
    assert_eq!(KcpStats::get(&net.server.stats().panics), 1);
    assert!(net
        .server_events
        .contains(&KcpEvent::Closed(s0, CloseReason::Failed)));
    assert!(net.server_events.contains(&KcpEvent::Released(s0)));
    // The client of the failed session learns through RESET.
    net.run_until(|n| {
        n.client_events[0].contains(&KcpEvent::Closed(
            c0,
            CloseReason::Reset(CloseCode::Internal),
        ))
    });
    // The other session is untouched and keeps working.
    assert!(net.server.has_session(s1));
    let now = net.now;
    net.server.send(now, s1, &frame_bytes(3, 10)).expect("send");
    net.run_until(|n| !n.client_messages(1, c1).is_empty());
    assert!(!net
        .server_events
        .iter()
        .any(|e| matches!(e, KcpEvent::Closed(k, _) if *k == s1)));
}

#[test]
fn ten_percent_loss_delivers_100_messages_in_order_both_ways() {
    for seed in 0..5 {
        let (mut net, ckey, skey) = pair();
        net.rng = StdRng::seed_from_u64(seed);
        net.loss = 0.1;
        for i in 0..100u64 {
            let now = net.now;
            let len = if i % 10 == 0 {
                3000
            } else {
                1 + (i as usize * 37) % 300
            };
            net.clients[0]
                .1
                .send(now, ckey, &frame_bytes(i, len))
                .expect("send");
            net.server
                .send(now, skey, &frame_bytes(i, len))
                .expect("send");
            net.step(Duration::from_millis(1));
            // Readers keep up.
            let (sn, cn) = (
                net.server_messages(skey).len(),
                net.client_messages(0, ckey).len(),
            );
            let now = net.now;
            net.server.consumed(now, skey, sn, usize::MAX);
            net.clients[0].1.consumed(now, ckey, cn, usize::MAX);
        }
        net.run_until(|n| {
            let (sn, cn) = (
                n.server_messages(skey).len(),
                n.client_messages(0, ckey).len(),
            );
            let now = n.now;
            n.server.consumed(now, skey, 100, usize::MAX);
            n.clients[0].1.consumed(now, ckey, 100, usize::MAX);
            sn == 100 && cn == 100
        });
        let expect: Vec<Bytes> = (0..100u64)
            .map(|i| {
                frame_bytes(
                    i,
                    if i % 10 == 0 {
                        3000
                    } else {
                        1 + (i as usize * 37) % 300
                    },
                )
            })
            .collect();
        assert_eq!(net.server_messages(skey), expect, "seed {seed}");
        assert_eq!(net.client_messages(0, ckey), expect, "seed {seed}");
    }
}

impl Net {
    /// Client `n` sends message `i` on `key`; returns the mark of what the server sent so
    /// far (for [`Net::replies_since`]).
    fn client_sends(&mut self, n: usize, key: ConvKey, i: u64) -> usize {
        let now = self.now;
        self.clients[n]
            .1
            .send(now, key, &frame_bytes(i, 50))
            .expect("send");
        self.server_sent.len()
    }

    /// Client `n`'s session on `key`.
    fn client_session(&self, n: usize, key: ConvKey) -> &Session {
        self.clients[n]
            .1
            .sessions
            .get(&key)
            .expect("client session")
    }
}

/// The ACK owed for a delivered message waits for the reply and leaves in the same datagram;
/// an unanswered message is acknowledged alone when the delay ends; with no delay, at once.
/// A client acknowledges at once whatever its config says.
#[test]
fn the_ack_of_a_message_rides_with_its_reply_or_leaves_after_the_delay() {
    let (mut net, ckey, skey) = pair();
    net.settle(Duration::from_millis(500));
    let delay = Duration::from_millis(KcpConfig::fast().ack_delay_ms);
    assert!(delay > Duration::ZERO);

    // Answered: one datagram carries the ACK and the reply.
    let mark = net.client_sends(0, ckey, 1);
    net.run_until(|n| !n.server_messages(skey).is_empty());
    assert_eq!(net.replies_since(mark).len(), 0, "the ACK waits");
    let now = net.now;
    net.server
        .send(now, skey, &frame_bytes(2, 50))
        .expect("reply");
    net.collect();
    assert_eq!(
        net.replies_since(mark).len(),
        1,
        "ACK and reply in one datagram"
    );
    net.run_until(|n| !n.client_messages(0, ckey).is_empty());
    let client = net.client_session(0, ckey);
    assert_eq!(
        client.kcp.wait_snd(),
        0,
        "the client's message is acknowledged"
    );
    assert_eq!(client.ack_due, None, "a client holds no ACK back");

    // Unanswered: the ACK leaves alone when the delay ends.
    net.settle(Duration::from_millis(500));
    let mark = net.client_sends(0, ckey, 3);
    net.run_until(|n| n.server_messages(skey).len() == 2);
    let delivered_at = net.now;
    assert_eq!(net.replies_since(mark).len(), 0);
    assert_eq!(net.server.poll_timeout(), Some(delivered_at + delay));
    net.run_until(|n| n.server_sent.len() > mark);
    assert_eq!(net.now, delivered_at + delay);
    assert_eq!(net.replies_since(mark).len(), 1, "the ACK alone");
    net.settle(Duration::from_millis(500));
    assert_eq!(net.client_session(0, ckey).kcp.wait_snd(), 0);

    // No delay configured: the ACK leaves with the delivery.
    let fast_acks = KcpConfig {
        ack_delay_ms: 0,
        ..KcpConfig::fast()
    };
    let mut net = Net::new(fast_acks.clone(), conn_cfg());
    net.add_client(fast_acks, conn_cfg());
    let (ckey, skey) = net.connect(0);
    net.settle(Duration::from_millis(500));
    let mark = net.client_sends(0, ckey, 1);
    net.run_until(|n| !n.server_messages(skey).is_empty());
    assert_eq!(net.replies_since(mark).len(), 1, "ACK at once");
}

/// A PING answered at once leaves the server no wake-up before its idle deadline: not at the
/// ACK delay (the ACK left with the reply), and not at the engine's resend check once the
/// client acknowledged the reply (W5: those two wake-ups per PING/PONG exchange did nothing;
/// without them an idle KCP edge spends ~12% less CPU).
#[test]
fn an_answered_ping_leaves_no_wake_up_before_the_idle_deadline() {
    let (mut net, ckey, skey) = pair();
    net.settle(Duration::from_millis(500));
    let delay = Duration::from_millis(KcpConfig::fast().ack_delay_ms);
    net.client_sends(0, ckey, 1);
    net.run_until(|n| !n.server_messages(skey).is_empty());
    let delivered_at = net.now;
    net.server
        .send(delivered_at, skey, &frame_bytes(2, 50))
        .expect("reply");
    net.collect();
    let next = net
        .server
        .poll_timeout()
        .expect("a resend check while unacknowledged");
    assert!(
        next > delivered_at + delay,
        "a wake-up {:?} after the delivery, for an ACK already sent",
        next - delivered_at
    );
    // The reply and the client's ACK of it arrive at once (a fast network).
    for _ in 0..2 {
        net.collect();
        let in_flight = std::mem::take(&mut net.in_flight);
        net.deliver(net.now, in_flight);
    }
    net.collect();
    assert_eq!(net.client_messages(0, ckey).len(), 1, "the reply arrived");
    let server_session = net.server.sessions.get(&skey).expect("session");
    assert_eq!(
        server_session.kcp.wait_snd(),
        0,
        "the reply is acknowledged"
    );
    assert_idle_deadline_next(net.now, net.server.poll_timeout(), "server");
}

/// The next deadline is the idle timeout's, ~`IDLE` from `now`.
fn assert_idle_deadline_next(now: Instant, next: Option<Instant>, who: &str) {
    let next = next.expect("idle deadline");
    assert!(
        next >= now + IDLE - Duration::from_secs(1),
        "{who} wakes in {:?}",
        next - now
    );
}

#[test]
fn an_idle_session_schedules_no_timer_work() {
    let (mut net, ckey, skey) = pair();
    let now = net.now;
    net.clients[0]
        .1
        .send(now, ckey, &frame_bytes(1, 100))
        .expect("send");
    net.run_until(|n| !n.server_messages(skey).is_empty());
    net.settle(Duration::from_millis(500));
    // Everything acked: the only deadline left is the idle timeout, ~30 s away.
    let now = net.now;
    assert_idle_deadline_next(now, net.server.poll_timeout(), "server");
    assert_idle_deadline_next(now, net.clients[0].1.poll_timeout(), "client");

    // Without an idle timeout: nothing at all.
    let conn = ConnConfig {
        idle_timeout: None,
        ..conn_cfg()
    };
    let mut net = Net::new(KcpConfig::fast(), conn.clone());
    net.add_client(KcpConfig::fast(), conn);
    let (ckey, skey) = net.connect(0);
    let now = net.now;
    net.clients[0]
        .1
        .send(now, ckey, &frame_bytes(1, 100))
        .expect("send");
    net.run_until(|n| !n.server_messages(skey).is_empty());
    net.settle(Duration::from_millis(500));
    assert_eq!(net.server.poll_timeout(), None);
    assert_eq!(net.clients[0].1.poll_timeout(), None);
}

/// Superseded timer entries below a live one stay bounded: a busy session's exchanges leave
/// stale entries under a quiet session's earlier deadline, and the heap is rebuilt past
/// 4 entries per session plus 1,024; the quiet session's deadline survives it.
#[test]
fn stale_timer_entries_stay_bounded_under_a_live_deadline() {
    let (mut net, _quiet_ckey, quiet_skey) = pair();
    net.add_client(KcpConfig::fast(), conn_cfg());
    let (busy_ckey, busy_skey) = net.connect(1);
    net.settle(Duration::from_millis(500));
    let quiet_deadline = {
        let s = net.server.sessions.get(&quiet_skey).expect("quiet session");
        s.last_rx + IDLE
    };
    let mut most = 0;
    for i in 0..1_500u64 {
        let now = net.now;
        net.clients[1]
            .1
            .send(now, busy_ckey, &frame_bytes(i, 20))
            .expect("send");
        net.run_until(|n| !n.server_messages(busy_skey).is_empty());
        net.server_events.clear();
        let now = net.now;
        net.server.consumed(now, busy_skey, 1, 20);
        net.server
            .send(now, busy_skey, &frame_bytes(i, 20))
            .expect("reply");
        net.run_until(|n| !n.client_messages(1, busy_ckey).is_empty());
        net.client_events[1].clear();
        let now = net.now;
        net.clients[1].1.consumed(now, busy_ckey, 1, 20);
        most = most.max(net.server.timers.len());
    }
    assert!(net.now < quiet_deadline, "the quiet session is still live");
    assert!(
        most <= 4 * net.server.sessions.len() + 1_025,
        "timer heap reached {most} entries for {} sessions",
        net.server.sessions.len()
    );
    assert!(
        most > 100,
        "stale entries did pile up ({most}): the bound was exercised"
    );
    // Once the busy session's last reply is acknowledged, the quiet one's deadline is next.
    net.settle(Duration::from_millis(500));
    assert_eq!(net.server.poll_timeout(), Some(quiet_deadline));
}

/// An idle session gives its engine's output buffer back (issue 17, W4: ~4.2 KiB of an
/// idle KCP session), and the next message both ways still goes through.
#[test]
fn an_idle_session_keeps_no_output_buffer_and_takes_one_when_it_sends() {
    let (mut net, ckey, skey) = pair();
    let staged = |net: &Net| {
        (
            net.server.sessions[&skey].kcp.output_buffer_capacity(),
            net.clients[0].1.sessions[&ckey]
                .kcp
                .output_buffer_capacity(),
        )
    };
    for round in 1..=3u64 {
        let now = net.now;
        net.clients[0]
            .1
            .send(now, ckey, &frame_bytes(round, 100))
            .expect("send");
        net.server
            .send(now, skey, &frame_bytes(round + 100, 200))
            .expect("send");
        net.run_until(|n| {
            n.server_messages(skey).len() == round as usize
                && n.client_messages(0, ckey).len() == round as usize
        });
        net.settle(Duration::from_millis(500));
        assert_eq!(
            staged(&net),
            (0, 0),
            "round {round}: idle, buffers given back"
        );
    }
    assert_eq!(
        net.server_messages(skey),
        (1..=3).map(|r| frame_bytes(r, 100)).collect::<Vec<_>>()
    );
    assert_eq!(
        net.client_messages(0, ckey),
        (1..=3)
            .map(|r| frame_bytes(r + 100, 200))
            .collect::<Vec<_>>()
    );
}

#[test]
fn idle_timeout_closes_the_session_then_resets_it() {
    let (mut net, ckey, skey) = pair();
    net.blackhole = true;
    net.run_until(|n| !n.server.has_session(skey) && !n.clients[0].1.has_session(ckey));
    assert!(net
        .server_events
        .contains(&KcpEvent::Closed(skey, CloseReason::IdleTimeout(IDLE))));
    assert_eq!(KcpStats::get(&net.server.stats().idle_timeouts), 1);
    assert_eq!(net.server.session_count(), 0);
    assert_eq!(net.server.poll_timeout(), None);
}

#[test]
fn a_stalled_reader_pushes_back_through_the_receive_window() {
    let mut config = KcpConfig::fast();
    config.inbound_queue_messages = 4;
    let mut net = Net::new(config, conn_cfg());
    net.add_client(KcpConfig::fast(), conn_cfg());
    let (ckey, skey) = net.connect(0);
    // 600 messages of 1 segment each: far more than the server's 256-segment window.
    let mut queued = 0u64;
    for _ in 0..2000 {
        send_while_room(&mut net, ckey, &mut queued, 600, 50);
        if !net.step(Duration::from_millis(50)) {
            break;
        }
    }
    // Only the credit was delivered; the rest waits in the engines.
    assert_eq!(net.server_messages(skey).len(), 4);
    assert!(net.clients[0].1.sessions[&ckey].kcp.wait_snd() > 0);
    assert!(!net.clients[0].1.can_send(ckey) || queued == 600);
    // The reader catches up (takes whatever was delivered): everything arrives, in order.
    let mut taken = 0;
    net.run_until(|n| {
        let now = n.now;
        n.take_delivered(now, skey, &mut taken, |_| {});
        send_while_room(n, ckey, &mut queued, 600, 50);
        n.server_messages(skey).len() == 600
    });
    let expect: Vec<Bytes> = (0..600).map(|i| frame_bytes(i, 50)).collect();
    assert_eq!(net.server_messages(skey), expect);
}

/// Regression (2026-12-04, second stop, a transport audit): the inbox credit counted
/// messages only, so a peer sending maximum-size messages faster than the reader took them
/// had 64 of them (4 MiB at a 64 KiB max frame) held per session. It counts bytes too: what
/// is delivered and unread stays within `inbound_queue_bytes` (one message always goes when
/// nothing is outstanding), the rest waits in the engine, and everything arrives in order
/// as the reader takes it.
#[test]
fn a_stalled_reader_holds_at_most_the_byte_credit() {
    let mut config = KcpConfig::fast();
    config.inbound_queue_bytes = 12 * 1024;
    let mut net = Net::new(config, conn_cfg());
    net.add_client(KcpConfig::fast(), conn_cfg());
    let (ckey, skey) = net.connect(0);
    let size = frame_bytes(0, 10_000).len();
    let mut queued = 0u64;
    for _ in 0..400 {
        send_while_room(&mut net, ckey, &mut queued, 20, 10_000);
        if !net.step(Duration::from_millis(50)) {
            break;
        }
    }
    // One ~10 KiB message fits 12 KiB, a 2nd does not: it waits in the engines.
    assert_eq!(net.server_messages(skey).len(), 12 * 1024 / size);
    // A message larger than the whole byte credit (within the max frame size) still goes
    // when nothing is outstanding.
    let mut taken = 0;
    net.run_until(|n| {
        let now = n.now;
        n.take_delivered(now, skey, &mut taken, |unread| {
            let bytes: usize = unread.iter().map(Bytes::len).sum();
            assert!(
                bytes <= 12 * 1024 || unread.len() == 1,
                "{bytes} bytes delivered and unread"
            );
        });
        let got = taken;
        send_while_room(n, ckey, &mut queued, 20, 10_000);
        if queued == 20 && got == 20 && n.clients[0].1.can_send(ckey) {
            n.clients[0]
                .1
                .send(now, ckey, &frame_bytes(20, 15_000))
                .expect("send");
            queued += 1;
        }
        n.server_messages(skey).len() == 21
    });
    let mut expect: Vec<Bytes> = (0..20).map(|i| frame_bytes(i, 10_000)).collect();
    expect.push(frame_bytes(20, 15_000));
    assert_eq!(net.server_messages(skey), expect);
}

#[test]
fn send_waits_when_the_send_queue_is_full_and_resumes_on_acks() {
    let (mut net, ckey, skey) = pair();
    net.blackhole = true;
    let mut sent = 0;
    while net.clients[0].1.can_send(ckey) && sent < 10_000 {
        let now = net.now;
        net.clients[0]
            .1
            .send(now, ckey, &frame_bytes(sent, 1000))
            .expect("send");
        sent += 1;
    }
    assert!(!net.clients[0].1.can_send(ckey));
    assert!((512..=600).contains(&sent), "sent {sent} before blocking");
    net.blackhole = false;
    net.run_until(|n| n.client_events[0].contains(&KcpEvent::Writable(ckey)));
    assert!(net.clients[0].1.can_send(ckey));
    net.run_until(|n| {
        let now = n.now;
        n.server.consumed(now, skey, 64, usize::MAX);
        n.server_messages(skey).len() == sent as usize
    });
}

#[test]
fn close_flushes_the_close_frame_then_resets() {
    let (mut net, ckey, skey) = pair();
    let now = net.now;
    net.clients[0]
        .1
        .send(now, ckey, &frame_bytes(1, 10))
        .expect("send");
    net.clients[0]
        .1
        .close(now, ckey, CloseCode::Normal, "bye", false);
    assert!(net.clients[0]
        .1
        .send(now, ckey, &frame_bytes(2, 10))
        .is_err());
    net.run_until(|n| !n.server.has_session(skey) && !n.clients[0].1.has_session(ckey));
    let got = net.server_messages(skey);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0], frame_bytes(1, 10));
    assert_eq!(
        Frame::decode(got[1].clone()),
        Ok(Frame::Close {
            code: CloseCode::Normal,
            message: "bye".into()
        })
    );
    // The client's RESET ended the server side.
    assert!(net.server_events.contains(&KcpEvent::Closed(
        skey,
        CloseReason::Reset(CloseCode::Normal)
    )));
    assert!(net.client_events[0].contains(&KcpEvent::Released(ckey)));
}

#[test]
fn an_oversized_message_closes_with_frame_too_large() {
    let mut net = Net::new(KcpConfig::fast(), conn_cfg());
    let big = ConnConfig {
        max_frame_size: 2 * MAX_FRAME,
        ..conn_cfg()
    };
    net.add_client(KcpConfig::fast(), big);
    let (ckey, skey) = net.connect(0);
    let now = net.now;
    // Exactly the maximum passes.
    let exact = vec![7u8; MAX_FRAME];
    net.clients[0].1.send(now, ckey, &exact).expect("send");
    net.run_until(|n| n.server_messages(skey).len() == 1);
    assert_eq!(net.server_messages(skey)[0].len(), MAX_FRAME);
    // One byte more is refused locally by a server-sized endpoint...
    assert_eq!(
        net.server.send(now, skey, &vec![7u8; MAX_FRAME + 1]),
        Err(SendError::TooLarge)
    );
    // ... and closes the session when a peer sends it anyway.
    let now = net.now;
    net.server.consumed(now, skey, 1, usize::MAX);
    net.clients[0]
        .1
        .send(now, ckey, &vec![7u8; MAX_FRAME + 1])
        .expect("send");
    net.run_until(|n| !n.server.has_session(skey));
    assert!(net.server_events.contains(&KcpEvent::Closed(
        skey,
        CloseReason::FrameTooLarge {
            len: MAX_FRAME + 1,
            max: MAX_FRAME
        }
    )));
    assert_eq!(KcpStats::get(&net.server.stats().oversized), 1);
    let close = net
        .client_messages(0, ckey)
        .into_iter()
        .map(Frame::decode)
        .last();
    assert!(matches!(
        close,
        Some(Ok(Frame::Close {
            code: CloseCode::FrameTooLarge,
            ..
        }))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_datagrams_never_panic_and_create_no_session(
        datagrams in proptest::collection::vec(
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..200),
                // Control-looking packets.
                proptest::collection::vec(any::<u8>(), 0..70).prop_map(|mut v| {
                    let mut p = vec![0, 0, 0, 0, b'W', b'G', b'K', b'C', 1];
                    p.append(&mut v);
                    p
                }),
                // Segment-looking packets with a small length field.
                (any::<u32>(), 81u8..=84, any::<[u8; 18]>(), proptest::collection::vec(any::<u8>(), 0..64))
                    .prop_map(|(conv, cmd, mid, tail)| {
                        let mut p = conv.to_le_bytes().to_vec();
                        p.push(cmd);
                        p.extend_from_slice(&mid[..15]);
                        p.extend_from_slice(&(tail.len() as u32).to_le_bytes());
                        p.extend_from_slice(&tail);
                        p
                    }),
            ],
            1..40,
        ),
        jumps in proptest::collection::vec(0u64..20_000, 1..40),
    ) {
        let mut net = Net::new(KcpConfig::fast(), conn_cfg());
        for (i, d) in datagrams.iter().enumerate() {
            let mark = net.server_sent.len();
            net.inject(client_addr(i % 3), d);
            for reply in net.replies_since(mark) {
                prop_assert!(reply.len() <= d.len(), "reply {} > request {}", reply.len(), d.len());
            }
            net.now += Duration::from_millis(jumps[i % jumps.len()]);
            let now = net.now;
            net.server.handle_timeout(now);
        }
        prop_assert_eq!(net.server.session_count(), 0);
        prop_assert_eq!(KcpStats::get(&net.server.stats().panics), 0);
    }

    #[test]
    fn arbitrary_segments_into_a_live_session_never_panic_the_endpoint(
        datagrams in proptest::collection::vec(
            (81u8..=84, any::<u8>(), any::<u16>(), any::<u32>(), any::<u32>(), any::<u32>(),
             proptest::collection::vec(any::<u8>(), 0..40)),
            1..30,
        ),
    ) {
        let (mut net, _ckey, skey) = pair();
        for (cmd, frg, wnd, ts, sn, una, data) in datagrams {
            let mut p = skey.conv.to_le_bytes().to_vec();
            p.extend_from_slice(&[cmd, frg]);
            p.extend_from_slice(&wnd.to_le_bytes());
            p.extend_from_slice(&ts.to_le_bytes());
            p.extend_from_slice(&sn.to_le_bytes());
            p.extend_from_slice(&una.to_le_bytes());
            p.extend_from_slice(&(data.len() as u32).to_le_bytes());
            p.extend_from_slice(&data);
            net.inject(skey.addr, &p);
            net.now += Duration::from_millis(7);
            let now = net.now;
            net.server.handle_timeout(now);
            net.collect();
        }
        // Either the session survived or it was closed cleanly; the endpoint is fine and
        // still accepts a new client.
        prop_assert!(net.server.session_count() <= 1);
        net.add_client(KcpConfig::fast(), conn_cfg());
        net.connect(1);
    }
}

#[test]
fn a_reset_still_delivers_what_was_acknowledged_to_a_stalled_reader() {
    let mut config = KcpConfig::normal();
    config.inbound_queue_messages = 4;
    let mut net = Net::new(config, conn_cfg());
    net.add_client(KcpConfig::normal(), conn_cfg());
    let (ckey, skey) = net.connect(0);
    let now = net.now;
    for i in 0..150 {
        net.clients[0]
            .1
            .send(now, ckey, &frame_bytes(i, 1000))
            .expect("send");
    }
    net.clients[0]
        .1
        .close(now, ckey, CloseCode::GoingAway, "bye", false);
    // The server never reads; the client's linger ends with RESET.
    net.run_until(|n| !n.server.has_session(skey) && !n.clients[0].1.has_session(ckey));
    let got = net.server_messages(skey);
    let mut expect: Vec<Bytes> = (0..150).map(|i| frame_bytes(i, 1000)).collect();
    expect.push(
        Frame::Close {
            code: CloseCode::GoingAway,
            message: "bye".into(),
        }
        .to_bytes(),
    );
    // The client could send only what the server's window took (credit 4 + 128 queued);
    // every one of those (acknowledged, so "delivered" for the client) reaches the reader,
    // past its credit, after the RESET.
    assert_eq!(got.len(), 4 + 128);
    let first_bad = got.iter().zip(&expect).position(|(a, b)| a != b);
    assert_eq!(first_bad, None, "first differing message");
    assert!(net.server_events.contains(&KcpEvent::Closed(
        skey,
        CloseReason::Reset(CloseCode::GoingAway)
    )));
}
