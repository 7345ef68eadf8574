//! Events as one flat C struct.

use std::ffi::{c_char, c_int};

use waygate_client::{ChannelUpdate, Event, RequestError};
use waygate_protocol::frame::WelcomeOutcome;
use waygate_transport::CloseCode;

/// What happened. Which `waygate_event` fields are set depends on the kind.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum waygate_event_kind {
    /// No event (written when a poll returns `WAYGATE_NO_EVENT` or fails).
    WAYGATE_EVENT_NONE = 0,
    /// A session is up (every WELCOME: the first, and after each reconnect). `outcome`
    /// says how (`WAYGATE_OUTCOME_*`: new, restored with nothing lost, restored with a gap
    /// or a new session after a failed restore: resync your game state for the last two);
    /// `text`: the endpoint URL; `session_id`. (Kinds 2–4 are retired: version 0.1 raised
    /// them for the outcomes.)
    WAYGATE_EVENT_CONNECTED = 1,
    /// A message from the server. `traffic_class`, `msg_id`, `seq` (0 for best-effort),
    /// `payload` and `payload_len`. Each sequenced message arrives once, in order.
    WAYGATE_EVENT_MESSAGE = 5,
    /// The link dropped; the client reconnects and resumes by itself. `code`, `text`: the
    /// close code and its name.
    WAYGATE_EVENT_DISCONNECTED = 6,
    /// The server refused a connect (e.g. overloaded); the next attempt waits at least
    /// `retry_after_ms`. `code`, `text`.
    WAYGATE_EVENT_REJECTED = 7,
    /// The server moves this client to another edge; it reconnects and resumes by itself.
    /// `text`: the target endpoint URL ("" means the configured list).
    WAYGATE_EVENT_MIGRATING = 8,
    /// One sent message was not delivered (busy, unavailable, no route...). `code`,
    /// `text`, `msg_id`, `seq` (the client seq of that message), `retry_after_ms`.
    WAYGATE_EVENT_ERROR = 9,
    /// Terminal: another login of the same player took over, an operator kicked it, or a
    /// backend's KICK whose own code would keep the session (PROTOCOL.md §7.8). `code`,
    /// `text`. No reconnect follows; the next poll returns `WAYGATE_CLOSED`.
    WAYGATE_EVENT_KICKED = 10,
    /// Terminal: closed locally, session expired, the token was refused, or the server
    /// ended the session with another code (a ban, a backend's KICK with its own code:
    /// PROTOCOL.md §7.8). `code`, `text`. No reconnect follows; the next poll returns
    /// `WAYGATE_CLOSED`.
    WAYGATE_EVENT_CLOSED = 11,
    /// A channel publication (PROTOCOL.md §12). `text`: the channel; `channel_epoch`,
    /// `channel_offset` (0 for best-effort); `payload`, `payload_len`: its body. In offset
    /// order per channel; one already shown is dropped.
    WAYGATE_EVENT_CHANNEL_PUBLICATION = 12,
    /// The session became a member of a channel; live publications follow the position.
    /// `text`: the channel; `channel_epoch`, `channel_offset`.
    WAYGATE_EVENT_CHANNEL_JOINED = 13,
    /// The session is no longer a member of a channel. `text`, `channel_epoch`,
    /// `channel_offset` (the last offset it was sent).
    WAYGATE_EVENT_CHANNEL_LEFT = 14,
    /// What was missed on a channel cannot be recovered: reload its state; live
    /// publications follow the position. `text`, `channel_epoch`, `channel_offset`.
    WAYGATE_EVENT_CHANNEL_HISTORY_LOST = 15,
    /// One connect attempt failed; the client goes on with the next endpoint or waits its
    /// backoff. `text` is "<endpoint>: <reason>" (resolution, refused, timed out, TLS
    /// certificate...), `seq` the round since the last session was up (1 = the first).
    WAYGATE_EVENT_CONNECT_FAILED = 16,
    /// A message sent while no session was up waited longer than
    /// `options.max_offline_age_ms`, or is above the max frame size the next session's
    /// WELCOME announced: dropped, never sent. `msg_id`, `seq` (what
    /// `waygate_client_send` returned for it), `age_ms`. The messages sent after it moved
    /// down one seq each.
    WAYGATE_EVENT_EXPIRED = 17,
    /// The answer to a request (`waygate_client_request`, `waygate_client_sync_clock`):
    /// `request_id`; `code`: its status (0 success, else the game server's own code);
    /// `payload`, `payload_len`: its body. (Since 0.2.)
    WAYGATE_EVENT_ANSWER = 18,
    /// A request has no answer: `request_id`; `text`: why (`timeout`, `refused`, `expired`,
    /// `session_lost`, `closed`, `bad_answer`); `code` and `retry_after_ms`: the refusal's
    /// code and hint when refused, else 0. Exactly one ANSWER or REQUEST_FAILED per
    /// request. (Since 0.2.)
    WAYGATE_EVENT_REQUEST_FAILED = 19,
    /// `seq` status events (connect failed, rejected, disconnected, migrating) were dropped
    /// here because the caller was not polling: past 256 events waiting beside the 4,096 the
    /// handle holds, status events are counted instead of kept (every other kind is always
    /// kept). It stands where they were lost, before the next event kept. (Since 0.2.)
    WAYGATE_EVENT_EVENTS_DROPPED = 20,
}

/// How a session came up (`waygate_event.outcome` of `WAYGATE_EVENT_CONNECTED`); the names
/// are the same in every SDK and in PROTOCOL.md (WELCOME's outcome).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum waygate_outcome {
    /// `new_session`: a fresh session (the first connect).
    WAYGATE_OUTCOME_NEW_SESSION = 0,
    /// `restored`: the session was resumed; missed messages follow, nothing lost.
    WAYGATE_OUTCOME_RESTORED = 1,
    /// `restored_with_gap`: resumed, but some downstream messages were lost: resync.
    WAYGATE_OUTCOME_RESTORED_WITH_GAP = 2,
    /// `restore_failed_new_session`: the resume failed and a new session started: resync.
    WAYGATE_OUTCOME_RESTORE_FAILED_NEW_SESSION = 3,
}

/// One event. Pointers in it (`payload`, `text`) stay valid until the next poll or wait on
/// the same handle, or `waygate_client_free`: copy what you keep.
///
/// Set `struct_size = sizeof(waygate_event)` before polling: the library writes only that
/// many bytes (later versions add fields at the end), so a program built against an older
/// header keeps working with a newer library.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct waygate_event {
    /// `sizeof(waygate_event)` as the caller compiled it (set it before polling).
    pub struct_size: usize,
    /// What happened.
    pub kind: waygate_event_kind,
    /// `WAYGATE_CLASS_*` of a message.
    pub traffic_class: u8,
    /// Close or error code (PROTOCOL.md close-code table), else 0.
    pub code: u16,
    /// Message id of a message or of an undelivered message, else 0.
    pub msg_id: u32,
    /// Retry hint in milliseconds (rejected, error), else 0.
    pub retry_after_ms: u32,
    /// Server seq of a message (0 for best-effort); client seq of an undelivered message;
    /// the round of a failed connect; how many were dropped (`WAYGATE_EVENT_EVENTS_DROPPED`).
    pub seq: u64,
    /// Message body (NULL when empty).
    pub payload: *const u8,
    /// Message body length.
    pub payload_len: usize,
    /// NUL-terminated text: endpoint URL, migration target or code name ("" if none).
    /// Never NULL.
    pub text: *const c_char,
    /// Session id (connected, restored, restored-with-gap, new-session), else zeros.
    pub session_id: [u8; 16],
    /// Channel events: the channel's epoch, else 0.
    pub channel_epoch: u64,
    /// Channel events: the offset (see each `WAYGATE_EVENT_CHANNEL_*`), else 0.
    pub channel_offset: u64,
    /// `WAYGATE_EVENT_CONNECTED`: how the session came up (since 0.2).
    pub outcome: waygate_outcome,
    /// `WAYGATE_EVENT_ANSWER`, `WAYGATE_EVENT_REQUEST_FAILED`: the request (since 0.2).
    pub request_id: u32,
    /// `WAYGATE_EVENT_EXPIRED`: how long the message had waited, in milliseconds (since 0.2).
    pub age_ms: u64,
}

impl waygate_event {
    /// The empty event (kind NONE, empty text).
    pub(crate) fn none() -> Self {
        Self {
            struct_size: std::mem::size_of::<Self>(),
            kind: waygate_event_kind::WAYGATE_EVENT_NONE,
            traffic_class: 0,
            code: 0,
            msg_id: 0,
            retry_after_ms: 0,
            seq: 0,
            payload: std::ptr::null(),
            payload_len: 0,
            text: c"".as_ptr(),
            session_id: [0; 16],
            channel_epoch: 0,
            channel_offset: 0,
            outcome: waygate_outcome::WAYGATE_OUTCOME_NEW_SESSION,
            request_id: 0,
            age_ms: 0,
        }
    }
}

/// Converts an SDK event into the flat struct and the text it points to (the caller keeps
/// both the event, whose payload the struct points into, and the text alive). `None` for an
/// event this version does not know (skipped).
pub(crate) fn flatten(event: &Event) -> Option<(waygate_event, String)> {
    use waygate_event_kind as K;
    let mut e = waygate_event::none();
    let text = match event {
        Event::Connected {
            endpoint,
            session_id,
            outcome,
        } => {
            e.kind = K::WAYGATE_EVENT_CONNECTED;
            e.outcome = match outcome {
                WelcomeOutcome::NewSession => waygate_outcome::WAYGATE_OUTCOME_NEW_SESSION,
                WelcomeOutcome::Restored => waygate_outcome::WAYGATE_OUTCOME_RESTORED,
                WelcomeOutcome::RestoredWithGap => {
                    waygate_outcome::WAYGATE_OUTCOME_RESTORED_WITH_GAP
                }
                WelcomeOutcome::RestoreFailedNewSession => {
                    waygate_outcome::WAYGATE_OUTCOME_RESTORE_FAILED_NEW_SESSION
                }
            };
            let n = session_id.len().min(e.session_id.len());
            e.session_id[..n].copy_from_slice(&session_id[..n]);
            endpoint.clone()
        }
        Event::Message {
            class,
            msg_id,
            seq,
            payload,
        } => {
            e.kind = K::WAYGATE_EVENT_MESSAGE;
            e.traffic_class = *class as u8;
            e.msg_id = *msg_id;
            e.seq = *seq;
            if !payload.is_empty() {
                e.payload = payload.as_ptr();
                e.payload_len = payload.len();
            }
            String::new()
        }
        Event::Disconnected { code } => {
            e.kind = K::WAYGATE_EVENT_DISCONNECTED;
            code_text(&mut e, *code)
        }
        Event::Rejected {
            code,
            retry_after_ms,
        } => {
            e.kind = K::WAYGATE_EVENT_REJECTED;
            e.retry_after_ms = *retry_after_ms;
            code_text(&mut e, *code)
        }
        Event::Migrating { target } => {
            e.kind = K::WAYGATE_EVENT_MIGRATING;
            target.clone()
        }
        Event::ConnectFailed {
            endpoint,
            reason,
            attempt,
        } => {
            e.kind = K::WAYGATE_EVENT_CONNECT_FAILED;
            e.seq = u64::from(*attempt);
            format!("{endpoint}: {reason}")
        }
        Event::Error(report) => {
            e.kind = K::WAYGATE_EVENT_ERROR;
            e.msg_id = report.msg_id;
            e.seq = report.client_seq;
            e.retry_after_ms = report.retry_after_ms;
            code_text(&mut e, report.code)
        }
        Event::Channel(update) => {
            let (kind, channel, position, body) = match update {
                ChannelUpdate::Publication {
                    channel,
                    position,
                    body,
                } => (
                    K::WAYGATE_EVENT_CHANNEL_PUBLICATION,
                    channel,
                    position,
                    Some(body),
                ),
                ChannelUpdate::Joined { channel, position } => {
                    (K::WAYGATE_EVENT_CHANNEL_JOINED, channel, position, None)
                }
                ChannelUpdate::Left { channel, position } => {
                    (K::WAYGATE_EVENT_CHANNEL_LEFT, channel, position, None)
                }
                ChannelUpdate::HistoryLost { channel, position } => (
                    K::WAYGATE_EVENT_CHANNEL_HISTORY_LOST,
                    channel,
                    position,
                    None,
                ),
                _ => return None,
            };
            e.kind = kind;
            e.channel_epoch = position.epoch;
            e.channel_offset = position.offset;
            if let Some(body) = body.filter(|b| !b.is_empty()) {
                e.payload = body.as_ptr();
                e.payload_len = body.len();
            }
            channel.clone()
        }
        Event::Expired { msg_id, seq, age } => {
            e.kind = K::WAYGATE_EVENT_EXPIRED;
            e.msg_id = *msg_id;
            e.seq = *seq;
            e.age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
            String::new()
        }
        Event::Answered { request_id, result } => {
            e.request_id = *request_id;
            match result {
                Ok(answer) => {
                    e.kind = K::WAYGATE_EVENT_ANSWER;
                    e.code = answer.status;
                    if !answer.body.is_empty() {
                        e.payload = answer.body.as_ptr();
                        e.payload_len = answer.body.len();
                    }
                    String::new()
                }
                Err(error) => {
                    e.kind = K::WAYGATE_EVENT_REQUEST_FAILED;
                    request_failure(&mut e, error).to_owned()
                }
            }
        }
        Event::EventsDropped { count } => {
            e.kind = K::WAYGATE_EVENT_EVENTS_DROPPED;
            e.seq = *count;
            String::new()
        }
        Event::Closed { code } => {
            e.kind = if *code == CloseCode::Kicked {
                K::WAYGATE_EVENT_KICKED
            } else {
                K::WAYGATE_EVENT_CLOSED
            };
            code_text(&mut e, *code)
        }
        _ => return None,
    };
    Some((e, text))
}

/// The reason label of a failed request (and its refusal code and hint).
fn request_failure(e: &mut waygate_event, error: &RequestError) -> &'static str {
    match error {
        RequestError::Timeout(_) => "timeout",
        RequestError::Refused {
            code,
            retry_after_ms,
        } => {
            e.code = code.to_u16();
            e.retry_after_ms = *retry_after_ms;
            "refused"
        }
        RequestError::Expired => "expired",
        RequestError::SessionLost => "session_lost",
        RequestError::BadAnswer(_) => "bad_answer",
        _ => "closed",
    }
}

fn code_text(e: &mut waygate_event, code: CloseCode) -> String {
    e.code = code.to_u16();
    code.as_str().to_owned()
}

/// A static name for an event kind ("connected", "message", ...; "unknown" for a value that
/// is not a `waygate_event_kind`). Never NULL.
#[no_mangle]
pub extern "C" fn waygate_event_kind_str(kind: c_int) -> *const c_char {
    ffi_body!(c"".as_ptr() => {
        let s = match kind {
            0 => c"none",
            1 => c"connected",
            5 => c"message",
            6 => c"disconnected",
            7 => c"rejected",
            8 => c"migrating",
            9 => c"error",
            10 => c"kicked",
            11 => c"closed",
            12 => c"channel_publication",
            13 => c"channel_joined",
            14 => c"channel_left",
            15 => c"channel_history_lost",
            16 => c"connect_failed",
            17 => c"expired",
            18 => c"answer",
            19 => c"request_failed",
            20 => c"events_dropped",
            _ => c"unknown",
        };
        s.as_ptr()
    })
}

/// The outcome's name, as in every SDK and PROTOCOL.md ("new_session", "restored",
/// "restored_with_gap", "restore_failed_new_session"; "unknown" for another value). Never
/// NULL.
#[no_mangle]
pub extern "C" fn waygate_outcome_str(outcome: c_int) -> *const c_char {
    ffi_body!(c"".as_ptr() => {
        let s = match outcome {
            0 => c"new_session",
            1 => c"restored",
            2 => c"restored_with_gap",
            3 => c"restore_failed_new_session",
            _ => c"unknown",
        };
        s.as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::ffi::CStr;
    use waygate_transport::TrafficClass;

    #[test]
    fn events_flatten_with_their_fields() {
        let payload = Bytes::from_static(b"hello");
        let (e, text) = flatten(&Event::Message {
            class: TrafficClass::BestEffort,
            msg_id: 1001,
            seq: 0,
            payload: payload.clone(),
        })
        .unwrap();
        assert_eq!(e.kind, waygate_event_kind::WAYGATE_EVENT_MESSAGE);
        assert_eq!(e.traffic_class, crate::WAYGATE_CLASS_BEST_EFFORT);
        assert_eq!((e.msg_id, e.payload_len), (1001, 5));
        assert_eq!(e.payload, payload.as_ptr());
        assert_eq!(text, "");

        let (e, text) = flatten(&Event::Closed {
            code: CloseCode::Kicked,
        })
        .unwrap();
        assert_eq!(e.kind, waygate_event_kind::WAYGATE_EVENT_KICKED);
        assert_eq!((e.code, text.as_str()), (301, "kicked"));

        let (e, text) = flatten(&Event::Connected {
            endpoint: "tcp://127.0.0.1:7000".into(),
            session_id: [7; 16],
            outcome: WelcomeOutcome::RestoredWithGap,
        })
        .unwrap();
        assert_eq!(e.kind, waygate_event_kind::WAYGATE_EVENT_CONNECTED);
        assert_eq!(
            e.outcome,
            waygate_outcome::WAYGATE_OUTCOME_RESTORED_WITH_GAP
        );
        assert_eq!(e.session_id, [7; 16]);
        assert_eq!(text, "tcp://127.0.0.1:7000");

        let (e, text) = flatten(&Event::Expired {
            msg_id: 1000,
            seq: 7,
            age: std::time::Duration::from_millis(2500),
        })
        .unwrap();
        assert_eq!(e.kind, waygate_event_kind::WAYGATE_EVENT_EXPIRED);
        assert_eq!((e.msg_id, e.seq, e.age_ms), (1000, 7, 2500));
        assert_eq!(text, "");

        let body = Bytes::from_static(b"hi");
        let (e, text) = flatten(&Event::Channel(ChannelUpdate::Publication {
            channel: "guild:42".into(),
            position: waygate_client::ChannelPosition {
                epoch: 300,
                offset: 7,
            },
            body: body.clone(),
        }))
        .unwrap();
        assert_eq!(
            e.kind,
            waygate_event_kind::WAYGATE_EVENT_CHANNEL_PUBLICATION
        );
        assert_eq!((e.channel_epoch, e.channel_offset), (300, 7));
        assert_eq!((e.payload, e.payload_len), (body.as_ptr(), 2));
        assert_eq!(text, "guild:42");

        let (e, text) = flatten(&Event::EventsDropped { count: 12 }).unwrap();
        assert_eq!(e.kind, waygate_event_kind::WAYGATE_EVENT_EVENTS_DROPPED);
        assert_eq!(e.seq, 12);
        assert_eq!(text, "");
    }

    #[test]
    fn kind_names_match_the_enum() {
        for (kind, name) in [
            (waygate_event_kind::WAYGATE_EVENT_NONE, "none"),
            (waygate_event_kind::WAYGATE_EVENT_CONNECTED, "connected"),
            (waygate_event_kind::WAYGATE_EVENT_EXPIRED, "expired"),
            (waygate_event_kind::WAYGATE_EVENT_CLOSED, "closed"),
            (
                waygate_event_kind::WAYGATE_EVENT_EVENTS_DROPPED,
                "events_dropped",
            ),
            (
                waygate_event_kind::WAYGATE_EVENT_CHANNEL_HISTORY_LOST,
                "channel_history_lost",
            ),
        ] {
            // SAFETY: waygate_event_kind_str returns a static NUL-terminated string.
            let s = unsafe { CStr::from_ptr(waygate_event_kind_str(kind as c_int)) };
            assert_eq!(s.to_str().unwrap(), name);
        }
    }
}
