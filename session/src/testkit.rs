//! Test support shared by this crate's tests and the edge's: drive a sans-IO
//! [`ClientSession`] over a real [`Connection`] until a condition on the collected events
//! holds or a bound passes; [`EchoSink`], an upstream that echoes every message back.
//! Compiled only for tests (`features = ["testkit"]` in a dev-dependency); never in a
//! production build.

use std::time::{Duration, Instant};

use waygate_protocol::frame::WelcomeOutcome;
use waygate_transport::Connection;

use std::sync::Mutex;

use async_trait::async_trait;
use waygate_protocol::CloseCode;

use std::sync::Arc;

use bytes::Bytes;

use crate::auth::{mint_token, HmacAuthenticator, KeyRing, TokenClaims};
use crate::client::{ClientConfig, ClientEvent, ClientSession};
use crate::driver::{
    DeliverError, Delivered, Downstream, SessionEvent, SessionLayer, SessionRegistry, UpstreamSink,
};
use crate::machine::SessionConfig;
use crate::machine::Upstream;

/// Sends what `client` has to send, feeds it what `conn` receives and appends its events to
/// `events`, until `want(events)` or `within` passes.
pub async fn drive_client(
    client: &mut ClientSession,
    conn: &mut dyn Connection,
    events: &mut Vec<ClientEvent>,
    within: Duration,
    want: impl Fn(&[ClientEvent]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        while let Some(f) = client.poll_transmit() {
            let _ = conn.send(&f).await;
        }
        while let Some(e) = client.poll_event() {
            events.push(e);
        }
        if want(events) || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::select! {
            r = conn.recv() => match r {
                Ok(f) => { let _ = client.handle_frame(Instant::now(), f); }
                Err(e) => client.handle_link_down(Instant::now(), e.close_code()),
            },
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
}

/// A client logged in on an edge over an in-memory link ([`log_in`]): the session's task,
/// the client, its end of the link and its events so far (the WELCOME included).
pub type LoggedIn = (
    tokio::task::JoinHandle<crate::machine::EndReason>,
    ClientSession,
    waygate_transport::mem::MemConnection,
    Vec<ClientEvent>,
);

/// Connects `client` to `edge` over an in-memory link and drives it until its first
/// WELCOME (or `within` passes).
pub async fn log_in(
    edge: &Arc<SessionLayer>,
    mut client: ClientSession,
    within: Duration,
) -> LoggedIn {
    let (server_end, mut conn) = waygate_transport::mem::mem_pair();
    let task = edge.spawn(Box::new(server_end));
    let mut events = Vec::new();
    client
        .connect(Instant::now())
        .expect("a fresh client sends its HELLO");
    drive_client(&mut client, &mut conn, &mut events, within, |e| {
        !welcomes(e).is_empty()
    })
    .await;
    (task, client, conn, events)
}

/// The WELCOME outcomes among `events`, in order.
pub fn welcomes(events: &[ClientEvent]) -> Vec<WelcomeOutcome> {
    events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Welcomed { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect()
}

/// The HMAC key (key id 1) of the test edges built by [`echo_edge`] and the tokens of
/// [`test_token`].
pub const TEST_KEY: &[u8] = b"driver test key: 32 bytes.......";

/// A session layer named `edge_id` whose upstream is an [`EchoSink`] on its own registry,
/// verifying tokens of [`TEST_KEY`] with `config`. Stores are the in-memory defaults; set
/// them (and `unix_now`) before wrapping it in an `Arc`.
pub fn echo_edge(edge_id: &str, config: SessionConfig) -> (SessionLayer, Arc<EchoSink>) {
    let registry = SessionRegistry::new();
    let sink = Arc::new(EchoSink::new(registry.clone()));
    let mut ring = KeyRing::new();
    ring.insert(1, TEST_KEY);
    let mut edge = SessionLayer::new(
        edge_id,
        config,
        Arc::new(HmacAuthenticator::new(ring)),
        sink.clone(),
    );
    edge.registry = registry;
    (edge, sink)
}

/// An auth token for `player` signed with [`TEST_KEY`], issued at `issued_at` (unix
/// seconds) and valid for `ttl_secs`.
pub fn test_token(player: &str, issued_at: u64, ttl_secs: u64) -> Bytes {
    let claims = TokenClaims {
        player_id: player.into(),
        issuer: "t".into(),
        issued_at,
        expires_at: issued_at + ttl_secs,
        extensions: vec![],
    };
    mint_token(1, TEST_KEY, &claims).unwrap_or_default()
}

/// A client session with a [`test_token`] and the default client settings.
pub fn test_client(player: &str, issued_at: u64, ttl_secs: u64) -> ClientSession {
    ClientSession::new(
        test_token(player, issued_at, ttl_secs),
        ClientConfig::default(),
    )
}

/// An [`UpstreamSink`] for tests: records every message and echoes it back to the
/// sender's session with the same class and msg id.
#[derive(Debug, Default)]
pub struct EchoSink {
    registry: SessionRegistry,
    received: Mutex<Vec<Upstream>>,
    events: Mutex<Vec<SessionEvent>>,
}

impl EchoSink {
    /// An echo sink pushing replies through `registry`.
    pub fn new(registry: SessionRegistry) -> Self {
        Self {
            registry,
            received: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
        }
    }

    /// Every message delivered so far.
    pub fn received(&self) -> Vec<Upstream> {
        self.received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every lifecycle event so far.
    pub fn events(&self) -> Vec<SessionEvent> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait]
impl UpstreamSink for EchoSink {
    /// Echoes the message, then answers it as a backend with FORWARD_DONE does: after its
    /// push, through the session's queue.
    async fn deliver(&self, message: Upstream) -> Result<Delivered, DeliverError> {
        let echo = Downstream {
            class: message.class,
            msg_id: message.msg_id,
            payload: message.payload.clone(),
        };
        let (session, seq) = (message.session_id, message.seq);
        self.received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(message);
        self.registry
            .push(&session, echo)
            .map_err(|_| DeliverError {
                code: CloseCode::Busy,
                retry_after_ms: 100,
            })?;
        if seq == 0 {
            return Ok(Delivered::Answered);
        }
        // A full queue here closes the session with a gap; the unanswered message stays
        // unacknowledged, so the client resends it after its resume.
        let _ = self.registry.answered(&session, seq);
        Ok(Delivered::AwaitingAnswer)
    }

    async fn session_event(&self, event: SessionEvent) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(event);
    }
}

/// The store contract: one behavioural suite that every [`SnapshotStore`] and
/// [`OwnershipRegistry`] implementation must pass (the in-memory ones in this crate's tests,
/// Redis in the edge's).
pub mod store_contract {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use bytes::Bytes;
    use waygate_protocol::TrafficClass;

    use crate::replay::{ReplayBuffer, ReplayLimits};
    use crate::resume::ResumeHash;
    use crate::seq::RecvWindow;
    use crate::store::{
        OwnershipRegistry, Snapshot, SnapshotStore, SnapshotWrite, TakeOutcome, SNAPSHOT_VERSION,
    };

    /// Session id number `n` of `player`: its store tag (as [`new_session_id`] mints),
    /// then twelve bytes `n`.
    ///
    /// [`new_session_id`]: crate::resume::new_session_id
    pub fn session_id_of(player: &str, n: u8) -> waygate_protocol::frame::SessionId {
        let mut id = [n; 16];
        id[..crate::resume::STORE_TAG_LEN]
            .copy_from_slice(&crate::resume::player_store_tag(player));
        id
    }

    /// A snapshot with a replay buffer, a previous token and bindings; its session id is
    /// [`session_id_of`]`(player, session)`.
    pub fn snapshot(session: u8, player: &str, fencing: u64) -> Snapshot {
        let mut replay = ReplayBuffer::new(ReplayLimits::default());
        replay.push(TrafficClass::Critical, 5, Bytes::from_static(b"hi"));
        replay.push(TrafficClass::Normal, 6, Bytes::from_static(b"\x00\xff"));
        Snapshot {
            version: SNAPSHOT_VERSION,
            session_id: session_id_of(player, session),
            player_id: player.into(),
            fencing,
            resume_hash: ResumeHash::of(&[2; 16]),
            prev_resume_hash: Some(ResumeHash::of(&[3; 16])),
            last_resume_nonce: 0,
            bindings: BTreeMap::from([
                ("world".to_owned(), "w-1".to_owned()),
                ("chat".to_owned(), "c-2".to_owned()),
            ]),
            replay,
            upstream: RecvWindow::starting_at(4),
            awaiting: Default::default(),
            keys: BTreeMap::from([("room".to_owned(), "lobby".to_owned())]),
            channels: BTreeMap::new(),
            channels_acked: BTreeMap::new(),
            pending_errors: vec![crate::store::PendingError {
                code: 402,
                msg_id: 7,
                client_seq: 3,
                retry_after_ms: 200,
            }],
            push_ids: vec![7, u64::MAX, 1],
        }
    }

    /// What every [`SnapshotStore`] does: round trip, compare-and-delete `take` with the current
    /// or the unconfirmed previous token, fenced delete, overwrite, TTL (real time).
    pub async fn snapshot_store_semantics(store: &dyn SnapshotStore) {
        let s = snapshot(1, "p", 1);
        store.put(&s, Duration::from_secs(10)).await.expect("put");
        assert_eq!(
            store.get(&s.session_id).await,
            Ok(Some(s.clone())),
            "round trip"
        );
        let wrong = ResumeHash::of(&[9; 16]);
        assert_eq!(
            store.take(&s.session_id, &wrong).await,
            Ok(TakeOutcome::Mismatch)
        );
        assert!(
            store.get(&s.session_id).await.expect("get").is_some(),
            "untouched"
        );
        // The unconfirmed previous token is accepted too.
        let prev = ResumeHash::of(&[3; 16]);
        assert_eq!(
            store.take(&s.session_id, &prev).await,
            Ok(TakeOutcome::Taken(Box::new(s.clone())))
        );
        assert_eq!(
            store.take(&s.session_id, &prev).await,
            Ok(TakeOutcome::NotFound)
        );
        assert_eq!(store.get(&s.session_id).await, Ok(None));
        // The current token.
        store.put(&s, Duration::from_secs(10)).await.expect("put");
        let cur = ResumeHash::of(&[2; 16]);
        assert!(matches!(
            store.take(&s.session_id, &cur).await,
            Ok(TakeOutcome::Taken(_))
        ));
        // No previous token: only the current one.
        let mut no_prev = s.clone();
        no_prev.prev_resume_hash = None;
        store
            .put(&no_prev, Duration::from_secs(10))
            .await
            .expect("put");
        assert_eq!(
            store.take(&s.session_id, &prev).await,
            Ok(TakeOutcome::Mismatch)
        );
        assert_eq!(store.delete(&s.session_id, None).await, Ok(true));
        assert_eq!(store.delete(&s.session_id, None).await, Ok(false));
        // Proofs of possession (PROTOCOL.md §7.3): the keys and the last nonce are read
        // back; a proof with a spent nonce or a wrong token takes nothing; a fresh one with
        // the unconfirmed previous token takes it.
        let mut proven = s.clone();
        proven.last_resume_nonce = 7;
        store
            .put(&proven, Duration::from_secs(10))
            .await
            .expect("put");
        assert_eq!(
            store.resume_keys(&s.session_id).await,
            Ok(Some(crate::store::ResumeKeys {
                current: cur,
                previous: Some(prev),
                last_nonce: 7,
            }))
        );
        assert_eq!(store.resume_keys(&[0xEE; 16]).await, Ok(None));
        let attempt = |token: [u8; 16], nonce| {
            crate::machine::ResumeAttempt::proving(&token, &s.session_id, nonce)
        };
        for (token, nonce) in [([3; 16], 7), ([9; 16], 8)] {
            assert_eq!(
                store
                    .take_proven(&s.session_id, &attempt(token, nonce))
                    .await,
                Ok(TakeOutcome::Mismatch),
                "token {token:?} nonce {nonce}"
            );
        }
        assert_eq!(
            store.take_proven(&s.session_id, &attempt([3; 16], 8)).await,
            Ok(TakeOutcome::Taken(Box::new(proven)))
        );
        assert_eq!(
            store.take_proven(&s.session_id, &attempt([2; 16], 9)).await,
            Ok(TakeOutcome::NotFound)
        );
        // Fenced delete.
        store.put(&s, Duration::from_secs(10)).await.expect("put");
        assert_eq!(store.delete(&s.session_id, Some(2)).await, Ok(false));
        assert_eq!(store.delete(&s.session_id, Some(1)).await, Ok(true));
        assert_eq!(store.delete(&s.session_id, Some(1)).await, Ok(false));
        // Overwrite.
        let mut s2 = s.clone();
        s2.bindings.insert("guild".into(), "g-1".into());
        store.put(&s, Duration::from_secs(10)).await.expect("put");
        store.put(&s2, Duration::from_secs(10)).await.expect("put");
        assert_eq!(store.get(&s.session_id).await, Ok(Some(s2)));
        // TTL (real time).
        let s3 = snapshot(3, "q", 1);
        store
            .put(&s3, Duration::from_millis(150))
            .await
            .expect("put");
        assert!(store.get(&s3.session_id).await.expect("get").is_some());
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(store.get(&s3.session_id).await, Ok(None), "expired");
        assert_eq!(
            store.take(&s3.session_id, &cur).await,
            Ok(TakeOutcome::NotFound)
        );
    }

    /// Writes through [`SnapshotStore::put_many`] with [`SnapshotWrite::since`] (what a
    /// store that writes deltas builds on): after every write the store holds exactly the
    /// snapshot written, through replay pushes, acks, evictions and a declared loss,
    /// changed bindings and push ids, a write whose `since` is not what the store holds (a write in
    /// between was lost), one after the record was taken, and a new resume key.
    pub async fn snapshot_store_write_through_semantics(store: &dyn SnapshotStore) {
        let ttl = Duration::from_secs(10);
        let mut s = snapshot(4, "wt", 1);
        let id = s.session_id;
        let mut since: Option<Box<Snapshot>> = None;
        /// The write of `s` after the one `since` holds; `since` becomes `s`.
        fn write(s: &Snapshot, since: &mut Option<Box<Snapshot>>) -> SnapshotWrite {
            let w = SnapshotWrite {
                snapshot: s.clone(),
                since: since.take(),
            };
            *since = Some(Box::new(s.clone()));
            w
        }
        for step in 0..40u32 {
            match step % 8 {
                0..=2 => {
                    let body = Bytes::from(vec![step as u8; (step as usize * 37) % 300]);
                    s.replay.push(TrafficClass::Normal, step, body);
                    if step % 8 == 1 {
                        // A push with an id (PLAYER_PUSH): its id goes with it.
                        s.push_ids.push(u64::from(step) << 40);
                    }
                }
                3 => {
                    let _ = s.replay.ack(s.replay.highest_sent().saturating_sub(1));
                }
                4 => {
                    s.upstream.receive(u64::from(step) + 10);
                    s.bindings.insert(format!("svc{step}"), "i-1".into());
                }
                5 if step == 13 => s.replay.declare_lost(2),
                6 if step == 22 => {
                    // A write the store never saw: the next one's `since` is not what it
                    // holds.
                    let _ = write(&s, &mut since);
                    s.replay
                        .push(TrafficClass::Critical, 99, Bytes::from_static(b"x"));
                }
                _ => {}
            }
            let w = write(&s, &mut since);
            let results = store.put_many(std::slice::from_ref(&w), ttl).await;
            assert_eq!(results, vec![Ok(())], "step {step}");
            assert_eq!(store.get(&id).await, Ok(Some(s.clone())), "step {step}");
        }
        // Many entries held, one added: still exact.
        for i in 0..50u32 {
            s.replay
                .push(TrafficClass::Normal, i, Bytes::from(vec![1; 64]));
        }
        let w = write(&s, &mut since);
        assert_eq!(store.put_many(&[w], ttl).await, vec![Ok(())]);
        s.replay
            .push(TrafficClass::Normal, 7, Bytes::from(vec![2; 64]));
        let w = write(&s, &mut since);
        assert_eq!(store.put_many(&[w], ttl).await, vec![Ok(())]);
        assert_eq!(store.get(&id).await, Ok(Some(s.clone())));
        // Taken meanwhile (resumed elsewhere): a later write from this copy is whole.
        assert!(matches!(
            store.take(&id, &s.resume_hash).await,
            Ok(TakeOutcome::Taken(t)) if *t == s
        ));
        s.replay
            .push(TrafficClass::Normal, 8, Bytes::from_static(b"after"));
        let w = write(&s, &mut since);
        assert_eq!(store.put_many(&[w], ttl).await, vec![Ok(())]);
        assert_eq!(store.get(&id).await, Ok(Some(s.clone())));
        // A new resume key (a resume on this edge).
        s.prev_resume_hash = Some(s.resume_hash);
        s.resume_hash = ResumeHash::of(&[8; 16]);
        s.last_resume_nonce += 1;
        let _ = s.replay.ack(s.replay.highest_sent());
        let w = write(&s, &mut since);
        assert_eq!(store.put_many(&[w], ttl).await, vec![Ok(())]);
        assert_eq!(store.get(&id).await, Ok(Some(s.clone())));
        assert!(store.delete(&id, None).await.expect("delete"));
    }

    /// What every [`OwnershipRegistry`] does: claims with growing fencing tokens, the previous
    /// owner reported, fenced release, independence of players (tokens compared by order only).
    pub async fn ownership_semantics(reg: &dyn OwnershipRegistry) {
        assert_eq!(reg.owner("p").await, Ok(None));
        let a = reg.claim("p", &[1; 16], "e1").await.expect("claim");
        assert_eq!(a.previous, None);
        let owner = reg.owner("p").await.expect("owner").expect("some");
        assert_eq!(
            (owner.session_id, owner.edge.as_str(), owner.fencing),
            ([1; 16], "e1", a.fencing)
        );
        let b = reg.claim("p", &[2; 16], "e2").await.expect("claim");
        assert!(b.fencing > a.fencing);
        let prev = b.previous.clone().expect("previous");
        assert_eq!(
            (prev.session_id, prev.edge.as_str(), prev.fencing),
            ([1; 16], "e1", a.fencing)
        );
        assert_eq!(
            reg.release("p", &[1; 16], a.fencing).await,
            Ok(false),
            "stale owner"
        );
        assert_eq!(
            reg.release("p", &[2; 16], a.fencing).await,
            Ok(false),
            "wrong token"
        );
        assert_eq!(
            reg.release("p", &[1; 16], b.fencing).await,
            Ok(false),
            "wrong session"
        );
        assert_eq!(reg.release("p", &[2; 16], b.fencing).await, Ok(true));
        assert_eq!(
            reg.release("p", &[2; 16], b.fencing).await,
            Ok(false),
            "once"
        );
        assert_eq!(reg.owner("p").await, Ok(None));
        let c = reg.claim("p", &[3; 16], "e1").await.expect("claim");
        assert!(c.fencing > b.fencing, "never goes back after a release");
        assert_eq!(c.previous, None);
        // Re-claim by the same session (a restore): previous is itself.
        let d = reg.claim("p", &[3; 16], "e2").await.expect("claim");
        assert!(d.fencing > c.fencing);
        assert_eq!(d.previous.map(|o| o.session_id), Some([3; 16]));
        // Players are independent.
        let other = reg.claim("other", &[4; 16], "e1").await.expect("claim");
        assert_eq!(other.previous, None);
        assert_eq!(
            reg.owner("p").await.expect("owner").map(|o| o.session_id),
            Some([3; 16])
        );
    }
}
