//! The demo game backend: two services on one instance, so routing correctness is visible
//! in every reply.
//!
//! - **player** (msg ids 1000–1999, keyed by player id): `ECHO` (1000) is answered with
//!   `ECHO_REPLY` (1001) whose payload is `"<instance>|<player>|"` followed by the request
//!   payload; `JOIN_ROOM` (1100, payload = room id) binds the session's `room` service to that
//!   room and answers `JOINED` (1101, payload = room id). Requests (PROTOCOL.md §13): `TIME`
//!   (1010) is answered with the instance's clock (Unix ms, big-endian u64), `ASK` (1011)
//!   with `"<instance>|<player>|<body>"` (status 400 `"empty question"` for an empty body).
//! - **room** (msg ids 2000–2999, keyed by room id): `ROOM_SAY` (2000, payload = text) appends
//!   to the room's log and sends `ROOM_EVENT` (2001) to every member on this instance, with
//!   payload `"<instance>|<room>|<n>|<player>|<text>"` where n is the room's message counter.
//!   The first message of a session in a room makes it a member.
//! - **channels** (player service, PROTOCOL.md §11 and §12): `CHANNEL_JOIN` (1200, payload
//!   `<channel>` or `<channel>|<epoch>|<offset>` to recover after that position) makes the
//!   session a member of the channel on its edge; `CHAT` (1202, payload `<channel>|<text>`)
//!   publishes `<player>|<text>` in the CHAT's class on every edge linked to this instance; `CHANNEL_LEAVE` (1203, payload
//!   `<channel>`) ends the membership. Success shows as channel events; a refusal is the
//!   ERROR of the edge's code (`unknown_channel_kind`, `rate_limited`, `queue_full`...).
//!   Announcements an edge withdrew (its announcement log did not take them) are recorded
//!   with the offset their members see skipped ([`DemoService::was_withdrawn`]).
//! - **whispers** (player service, PROTOCOL.md §9.7): `WHISPER` (1300, payload
//!   `<player>|<text>`) pushes `WHISPER_IN` (1301, payload `<sender>|<text>`) to that player
//!   wherever its session is (PLAYER_PUSH), with an id taken from the message, so a WHISPER
//!   handled twice (resent after its edge died) reaches the player once; an answer that
//!   may change (`busy`, `unreachable`, `unknown`, none) is asked again with the same id,
//!   three tries 300 ms apart, all within 10 s. Delivered: no other answer; otherwise the
//!   ERROR of [`whisper_refusal`] (100 for a malformed payload or a name over 256 bytes).
//!   Whispers delivered are recorded ([`DemoService::delivered_whispers`]).

use std::collections::HashMap;
use std::sync::Mutex;

use async_trait::async_trait;
use bytes::Bytes;
use waygate_protocol::channel::ChannelPosition;
use waygate_protocol::{CloseCode, TrafficClass};

use super::{BackendSession, Incoming, Refusal, Service};

/// Echo request (player service).
pub const ECHO: u32 = 1000;
/// Echo reply.
pub const ECHO_REPLY: u32 = 1001;
/// Join a room (player service); payload is the room id.
pub const JOIN_ROOM: u32 = 1100;
/// Room joined.
pub const JOINED: u32 = 1101;
/// Say something in the bound room (room service).
pub const ROOM_SAY: u32 = 2000;
/// Broadcast of a room message.
pub const ROOM_EVENT: u32 = 2001;
/// Join a channel (player service); payload `<channel>` or `<channel>|<epoch>|<offset>`.
pub const CHANNEL_JOIN: u32 = 1200;
/// Publish to a channel (player service); payload `<channel>|<text>`.
pub const CHAT: u32 = 1202;
/// Leave a channel (player service); payload `<channel>`.
pub const CHANNEL_LEAVE: u32 = 1203;
/// Request (PROTOCOL.md §13, player service): the game server's clock; the answer's body is
/// Unix time in ms (big-endian u64), what the SDKs' `sync_clock` reads.
pub const TIME: u32 = 1010;
/// Request (player service): answered `"<instance>|<player>|<body>"`, status 0; an empty body
/// is answered with status [`ASK_EMPTY`] and body `"empty question"`.
pub const ASK: u32 = 1011;
/// The status of an ASK with an empty body.
pub const ASK_EMPTY: u16 = 400;
/// Whisper to a player anywhere (player service); payload `<player>|<text>`.
pub const WHISPER: u32 = 1300;
/// A whisper received; payload `<sender>|<text>`, in the WHISPER's class.
pub const WHISPER_IN: u32 = 1301;
/// Tries of a whisper whose answer may change (`busy`, `unreachable`, `unknown`, none).
const WHISPER_TRIES: u32 = 3;
/// All of a whisper's tries end within this (each may wait 5 s for credit and 5 s for the
/// answer); past it: 403 `unavailable`. The session's later messages wait meanwhile.
const WHISPER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The ERROR a client gets for a WHISPER that was not delivered: `offline` 409
/// `member_offline`; `queue_full` 407 `queue_full` (retry after 100 ms); after the tries,
/// `busy` 402 `busy` (200 ms), `unreachable` 403 `unavailable` (1,000 ms), `unknown` or no
/// answer 403 `unavailable` (1,000 ms: it may still arrive, PROTOCOL.md §9.7).
pub fn whisper_refusal(outcome: Option<crate::PlayerPushOutcome>) -> Refusal {
    use crate::PlayerPushOutcome as O;
    let (code, retry_after_ms) = match outcome {
        Some(O::Offline) => (CloseCode::MemberOffline, 0),
        Some(O::QueueFull) => (CloseCode::QueueFull, 100),
        Some(O::Busy) => (CloseCode::Busy, 200),
        _ => (CloseCode::Unavailable, 1_000),
    };
    Refusal {
        code,
        retry_after_ms,
    }
}

/// Whispers a [`DemoService`] remembers as delivered (the first 100,000).
const WHISPERS_KEPT: usize = 100_000;

/// The ERROR a client gets for a request its message made that failed: the edge's refusal
/// of a channel request (its code and hint), `protocol_error` for a name the link cannot
/// carry (over 256 bytes), `busy` when the edge did not answer in time.
fn refusal_of(e: crate::BackendError) -> Refusal {
    match e {
        crate::BackendError::ChannelRefused {
            code,
            retry_after_ms,
        } => Refusal {
            code,
            retry_after_ms,
        },
        crate::BackendError::AnnouncementWithdrawn { retry_after_ms, .. } => Refusal {
            code: CloseCode::Unavailable,
            retry_after_ms,
        },
        crate::BackendError::NoCredit | crate::BackendError::NoAnswer => Refusal {
            code: CloseCode::Busy,
            retry_after_ms: 200,
        },
        crate::BackendError::FieldTooLong(_) => BAD_REQUEST,
        _ => INTERNAL,
    }
}

/// `<channel>` or `<channel>|<epoch>|<offset>`.
fn parse_join(payload: &[u8]) -> Result<(String, Option<ChannelPosition>), Refusal> {
    let text = std::str::from_utf8(payload).map_err(|_| BAD_REQUEST)?;
    let mut parts = text.split('|');
    let channel = parts.next().unwrap_or_default().to_owned();
    let since = match (parts.next(), parts.next()) {
        (None, _) => None,
        (Some(epoch), Some(offset)) => Some(ChannelPosition {
            epoch: epoch.parse().map_err(|_| BAD_REQUEST)?,
            offset: offset.parse().map_err(|_| BAD_REQUEST)?,
        }),
        (Some(_), None) => return Err(BAD_REQUEST),
    };
    Ok((channel, since))
}

const BAD_REQUEST: Refusal = Refusal {
    code: CloseCode::ProtocolError,
    retry_after_ms: 0,
};

#[derive(Debug, Default)]
struct Room {
    counter: u64,
    members: HashMap<[u8; 16], BackendSession>,
}

/// Publication positions a [`DemoService`] remembers per kind (the first 100,000).
const POSITIONS_KEPT: usize = 100_000;

/// A bounded set of publication positions: (channel, epoch, offset).
#[derive(Debug, Default)]
struct PositionSet(Mutex<std::collections::HashSet<(String, u64, u64)>>);

impl PositionSet {
    fn insert(&self, channel: &str, position: ChannelPosition) {
        if let Ok(mut set) = self.0.lock() {
            if set.len() < POSITIONS_KEPT {
                set.insert((channel.to_owned(), position.epoch, position.offset));
            }
        }
    }

    fn contains(&self, channel: &str, position: ChannelPosition) -> bool {
        self.0
            .lock()
            .is_ok_and(|set| set.contains(&(channel.to_owned(), position.epoch, position.offset)))
    }
}

/// The demo service. Room state lives here, per instance.
#[derive(Debug, Default)]
pub struct DemoService {
    rooms: Mutex<HashMap<String, Room>>,
    room_of: Mutex<HashMap<[u8; 16], String>>,
    /// Announcements an edge withdrew: (channel, epoch, offset), the offsets members see
    /// skipped.
    withdrawn: PositionSet,
    /// Announcements an edge took: (channel, epoch, offset). A member never sees one of
    /// them skipped, not even in the announcement log's stretch after its edge was lost.
    announced: PositionSet,
    /// CHAT publishes sent to an edge, and those not sent because the edge told it has no
    /// such channel (PROTOCOL.md §12.6).
    edge_publishes: std::sync::atomic::AtomicU64,
    edge_publishes_skipped: std::sync::atomic::AtomicU64,
    /// Whispers answered `delivered`: (recipient, WHISPER_IN payload).
    whispers: Mutex<std::collections::HashSet<(String, Bytes)>>,
}

impl DemoService {
    /// A fresh demo service.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether an edge withdrew an announcement this instance published to `channel` at
    /// `position` (its announcement log did not take it: the members there see that offset
    /// skipped, PROTOCOL.md §12.5). Remembers the first 100,000.
    pub fn was_withdrawn(&self, channel: &str, position: ChannelPosition) -> bool {
        self.withdrawn.contains(channel, position)
    }

    /// Whether an edge took an announcement this instance published to `channel` at
    /// `position` (remembers the first 100,000).
    pub fn was_announced(&self, channel: &str, position: ChannelPosition) -> bool {
        self.announced.contains(channel, position)
    }

    /// CHAT publishes this instance sent to edges, and those it did not send to an edge that
    /// told it has no such channel (PROTOCOL.md §12.6): (sent, skipped).
    pub fn edge_publishes(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.edge_publishes.load(Relaxed),
            self.edge_publishes_skipped.load(Relaxed),
        )
    }

    /// Whispers this instance had delivered, as (recipient, WHISPER_IN payload): the first
    /// 100,000 (a whisper handled twice is one).
    pub fn delivered_whispers(&self) -> Vec<(String, Bytes)> {
        self.whispers
            .lock()
            .map(|w| w.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Pushes a whisper to `to` (see the module docs), recording it once delivered.
    async fn whisper(
        &self,
        session: &BackendSession,
        msg: &Incoming,
        to: &str,
        body: Bytes,
    ) -> Result<(), Refusal> {
        use crate::PlayerPushOutcome as O;
        let id = session.publish_id_for(msg.client_seq, 1);
        let tries = async {
            let mut last = None;
            for attempt in 1..=WHISPER_TRIES {
                let outcome = match session
                    .push_to_player_with_id(id, to, WHISPER_IN, msg.class, body.clone())
                    .await
                {
                    Ok(o) => Some(o),
                    Err(crate::BackendError::FieldTooLong(_)) => return Err(BAD_REQUEST),
                    Err(_) => None,
                };
                match outcome {
                    Some(O::Delivered) => {
                        if let Ok(mut w) = self.whispers.lock() {
                            if w.len() < WHISPERS_KEPT {
                                w.insert((to.to_owned(), body));
                            }
                        }
                        return Ok(());
                    }
                    Some(O::Offline | O::QueueFull) => return Err(whisper_refusal(outcome)),
                    _ => last = outcome,
                }
                if attempt < WHISPER_TRIES {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                }
            }
            Err(whisper_refusal(last))
        };
        tokio::time::timeout(WHISPER_DEADLINE, tries)
            .await
            .unwrap_or_else(|_| Err(whisper_refusal(None)))
    }

    /// Number of sessions that are members of `room` on this instance.
    pub fn room_members(&self, room: &str) -> usize {
        self.rooms
            .lock()
            .map(|r| r.get(room).map_or(0, |r| r.members.len()))
            .unwrap_or(0)
    }

    /// Number of messages said in `room` on this instance.
    pub fn room_counter(&self, room: &str) -> u64 {
        self.rooms
            .lock()
            .map(|r| r.get(room).map_or(0, |r| r.counter))
            .unwrap_or(0)
    }
}

const INTERNAL: Refusal = Refusal {
    code: CloseCode::Internal,
    retry_after_ms: 0,
};

#[async_trait]
impl Service for DemoService {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        match msg.msg_id {
            ECHO => {
                let mut out =
                    format!("{}|{}|", session.instance_id(), session.player_id()).into_bytes();
                out.extend_from_slice(&msg.payload);
                session
                    .push(ECHO_REPLY, msg.class, Bytes::from(out))
                    .await
                    .map_err(|_| INTERNAL)
            }
            TIME | ASK => {
                let request = msg.request().ok_or(Refusal {
                    code: CloseCode::ProtocolError,
                    retry_after_ms: 0,
                })?;
                let (status, body) = if msg.msg_id == TIME {
                    let now = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                    (0, waygate_protocol::request::encode_clock(now).to_vec())
                } else if request.body.is_empty() {
                    (ASK_EMPTY, b"empty question".to_vec())
                } else {
                    let mut out =
                        format!("{}|{}|", session.instance_id(), session.player_id()).into_bytes();
                    out.extend_from_slice(&request.body);
                    (0, out)
                };
                session
                    .answer(&request, status, &body)
                    .await
                    .map_err(|_| INTERNAL)
            }
            JOIN_ROOM => {
                let room = String::from_utf8_lossy(&msg.payload).into_owned();
                session.bind("room", &room).await.map_err(refusal_of)?;
                session
                    .push(JOINED, TrafficClass::Critical, msg.payload)
                    .await
                    .map_err(|_| INTERNAL)
            }
            CHANNEL_JOIN => {
                let (channel, since) = parse_join(&msg.payload)?;
                session
                    .join_channel(&channel, since)
                    .await
                    .map(drop)
                    .map_err(refusal_of)
            }
            WHISPER => {
                let text = std::str::from_utf8(&msg.payload).map_err(|_| BAD_REQUEST)?;
                let (to, said) = text.split_once('|').ok_or(BAD_REQUEST)?;
                let body = Bytes::from(format!("{}|{said}", session.player_id()));
                self.whisper(session, &msg, to, body).await
            }
            CHANNEL_LEAVE => {
                let channel = std::str::from_utf8(&msg.payload).map_err(|_| BAD_REQUEST)?;
                session
                    .leave_channel(channel)
                    .await
                    .map(drop)
                    .map_err(refusal_of)
            }
            CHAT => {
                let text = std::str::from_utf8(&msg.payload).map_err(|_| BAD_REQUEST)?;
                let (channel, said) = text.split_once('|').ok_or(BAD_REQUEST)?;
                let body = Bytes::from(format!("{}|{said}", session.player_id()));
                // Every edge's members hear it (channels are per edge). The sayer's own
                // edge decides the answer; another edge's refusal is that edge's to count.
                // One id per message: a CHAT its client resent after its edge died is
                // handled again, and publishes nothing twice (PROTOCOL.md §12.5).
                let id = session.publish_id_for(msg.client_seq, 0);
                let results = session
                    .publish_on_every_edge_with_id(id, channel, msg.class, body)
                    .await;
                for r in &results {
                    let skipped = matches!(&r.result, Ok(a) if a.skipped);
                    let counter = if skipped {
                        &self.edge_publishes_skipped
                    } else {
                        &self.edge_publishes
                    };
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match &r.result {
                        Err(crate::BackendError::AnnouncementWithdrawn { position, .. }) => {
                            self.withdrawn.insert(channel, *position);
                        }
                        Ok(receipt) if msg.class == TrafficClass::Critical => {
                            self.announced.insert(channel, receipt.position);
                        }
                        _ => {}
                    }
                }
                let own = results
                    .into_iter()
                    .find(|r| r.edge_id == session.edge_id())
                    .map(|r| r.result);
                match own {
                    Some(Ok(_)) => Ok(()),
                    Some(Err(e)) => Err(refusal_of(e)),
                    None => Err(refusal_of(crate::BackendError::LinkClosed)),
                }
            }
            ROOM_SAY => {
                let sid = *session.session_id();
                let room = {
                    let map = self.room_of.lock().map_err(|_| INTERNAL)?;
                    map.get(&sid).cloned()
                };
                // The edge routes by the bound room; the payload is "<room>|<text>".
                let text = String::from_utf8_lossy(&msg.payload).into_owned();
                let (room_id, said) = text.split_once('|').unwrap_or(("", text.as_str()));
                let room_id = room.unwrap_or_else(|| room_id.to_string());
                let (event, members) = {
                    let mut rooms = self.rooms.lock().map_err(|_| INTERNAL)?;
                    let r = rooms.entry(room_id.clone()).or_default();
                    r.members.insert(sid, session.clone());
                    r.counter += 1;
                    let event = format!(
                        "{}|{}|{}|{}|{}",
                        session.instance_id(),
                        room_id,
                        r.counter,
                        session.player_id(),
                        said
                    );
                    (event, r.members.values().cloned().collect::<Vec<_>>())
                };
                if let Ok(mut map) = self.room_of.lock() {
                    map.insert(sid, room_id);
                }
                let event = Bytes::from(event);
                for m in members {
                    let _ = m.push(ROOM_EVENT, msg.class, event.clone()).await;
                }
                Ok(())
            }
            _ => Err(Refusal {
                code: CloseCode::NoRoute,
                retry_after_ms: 0,
            }),
        }
    }

    /// Ends the session's room membership if it is this opening's: after a resume on
    /// another edge and a ROOM_SAY there, the member is the new edge's opening, and the old
    /// edge's close (which may come later) leaves it a member.
    async fn session_closed(&self, session: &BackendSession, _code: CloseCode) {
        let sid = *session.session_id();
        let (Ok(mut rooms), Ok(mut room_of)) = (self.rooms.lock(), self.room_of.lock()) else {
            return;
        };
        let Some(room) = room_of.get(&sid) else {
            return;
        };
        let Some(r) = rooms.get_mut(room) else {
            room_of.remove(&sid);
            return;
        };
        if r.members.get(&sid).is_none_or(|m| m.same_opening(session)) {
            r.members.remove(&sid);
            room_of.remove(&sid);
        }
    }
}

/// The demo game's route table (TOML, `examples/routes.toml` format) over the backend
/// addresses `addrs`: service `player` (messages 1000-1999, by player) with instances
/// `p1..`, and service `room` (2000-2999, by room) with instances `r1..`, one of each per
/// address. `player_state(i)` gives the state of the i-th player instance (`Some("active")`,
/// `Some("draining")`, ...) or leaves it out (`None`); room instances are always active.
pub fn route_table(
    addrs: &[std::net::SocketAddr],
    epoch: u64,
    player_state: impl Fn(usize) -> Option<&'static str>,
) -> String {
    let mut t = format!("epoch = {epoch}\nupdated_at = 0\n");
    for (service, prefix, range) in [
        ("player", "p", "[[1000, 1999]]"),
        ("room", "r", "[[2000, 2999]]"),
    ] {
        t.push_str(&format!(
            "[[services]]\nname = \"{service}\"\nmessages = {range}\nkey = \"{service}\"\n"
        ));
        for (i, a) in addrs.iter().enumerate() {
            let state = if service == "player" {
                player_state(i)
            } else {
                Some("active")
            };
            let Some(state) = state else { continue };
            t.push_str(&format!(
                "  [[services.instances]]\n  id = \"{prefix}{}\"\n  address = \"{a}\"\n  state = \"{state}\"\n",
                i + 1
            ));
        }
    }
    t
}
