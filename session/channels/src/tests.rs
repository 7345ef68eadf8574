//! Tests of the hub alone: unit cases for each rule, and a property test that drives the
//! real hub with random publishes, joins (with and without recovery positions), leaves,
//! ended sessions, partial drains and time, checking order, completeness and bounds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use proptest::prelude::*;
use waygate_protocol::channel::{ChannelEvent, ChannelEventKind, ChannelPosition};
use waygate_protocol::TrafficClass;

use super::*;

fn sid(n: u8) -> SessionId {
    [n; 16]
}

fn player(n: u8) -> String {
    format!("player-{n}")
}

fn small_config() -> ChannelsConfig {
    let kind = KindPolicy {
        history_len: 4,
        history_ttl_ms: 10_000,
        max_members: 3,
        max_body: 64,
        publish_rate: 100,
        publish_burst: 10,
        queue_critical: 4,
        queue_normal: 6,
        queue_best_effort: 2,
        backlog: false,
    };
    ChannelsConfig {
        max_channels: 3,
        max_channels_per_session: 2,
        idle_reclaim_ms: 1_000,
        dedup_window_secs: 60,
        dedup_max_ids: 8,
        backlog_players: 2,
        kinds: [
            ("room".to_owned(), kind.clone()),
            (
                "guild".to_owned(),
                KindPolicy {
                    backlog: true,
                    ..kind.clone()
                },
            ),
            ("world".to_owned(), kind),
        ]
        .into_iter()
        .collect(),
        ..ChannelsConfig::default()
    }
}

/// [`small_config`] with budgets the random runs reach: an empty publication's event is 9
/// or 10 bytes (29 or 30 as the hub bounds it before building it), so about 10 are kept and
/// 10 wait over all channels, fewer than the kinds' caps allow (12 kept, 36 waiting).
fn tight_budgets() -> ChannelsConfig {
    ChannelsConfig {
        history_budget_bytes: 100,
        pending_budget_bytes: 300,
        ..small_config()
    }
}

/// Publishes `n` empty publications of `class` to `channel`; returns the last position.
fn publish_n(
    hub: &mut ChannelHub,
    now: Instant,
    channel: &str,
    class: TrafficClass,
    n: usize,
) -> ChannelPosition {
    let mut last = ChannelPosition::default();
    for _ in 0..n {
        last = hub
            .publish(now, channel, 0, class, Bytes::new())
            .unwrap()
            .position;
    }
    last
}

/// Drains every pending delivery of every channel; returns (session, event) in order.
fn drain(hub: &mut ChannelHub) -> Vec<(SessionId, ChannelEvent)> {
    let mut out = Vec::new();
    let mut ready: Vec<Arc<str>> = Vec::new();
    while let Some(c) = hub.poll_ready() {
        ready.push(c);
    }
    for c in ready {
        while let Some(d) = hub.next_delivery(&c) {
            let e = ChannelEvent::decode(d.event.clone()).expect("hub encodes valid events");
            assert_eq!(&*d.channel, e.channel);
            for s in d.to {
                out.push((s, e.clone()));
            }
        }
    }
    out
}

fn offsets_of(events: &[(SessionId, ChannelEvent)], s: SessionId) -> Vec<u64> {
    events
        .iter()
        .filter(|(to, e)| *to == s && e.kind == ChannelEventKind::Publication)
        .map(|(_, e)| e.position.offset)
        .collect()
}

/// Queue depth per kind and class (the channel issue's gauges): publications waiting for
/// their consumer are counted by the kind of their channel and their class, and go back to
/// zero once delivered.
#[test]
fn pending_publications_are_counted_by_kind_and_class() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 12);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    hub.join(now, sid(1), &player(1), "room:b", None).unwrap();
    while let Some(c) = hub.poll_ready() {
        while hub.next_delivery(&c).is_some() {}
    }
    for (name, class) in [
        ("room:a", TrafficClass::Critical),
        ("room:a", TrafficClass::Normal),
        ("room:b", TrafficClass::Normal),
        ("room:b", TrafficClass::BestEffort),
    ] {
        hub.publish(now, name, 0, class, Bytes::new()).unwrap();
    }
    let by_kind = hub.pending_by_kind();
    assert_eq!(by_kind.get("room"), Some(&[1, 2, 1]));
    assert_eq!(by_kind.values().flatten().sum::<usize>(), hub.pending());
    while let Some(c) = hub.poll_ready() {
        while hub.next_delivery(&c).is_some() {}
    }
    assert_eq!(hub.pending_by_kind().get("room"), Some(&[0, 0, 0]));
}

#[test]
fn every_event_of_a_channel_travels_in_one_sequenced_lane() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 11);
    hub.publish(now, "room:a", 0, TrafficClass::Critical, Bytes::new())
        .unwrap();
    hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    let since = ChannelPosition {
        epoch: hub.position("room:a").unwrap().epoch,
        offset: 0,
    };
    hub.join(now, sid(1), &player(1), "room:a", Some(since))
        .unwrap();
    hub.publish(now, "room:a", 0, TrafficClass::BestEffort, Bytes::new())
        .unwrap();
    let mut classes = Vec::new();
    while let Some(c) = hub.poll_ready() {
        while let Some(d) = hub.next_delivery(&c) {
            if d.to.contains(&sid(1)) {
                classes.push((d.class, d.wire_class()));
            }
        }
    }
    use TrafficClass::*;
    // Recovered announcement and chat, JOINED, then the live best-effort one.
    assert_eq!(
        classes,
        [
            (Critical, Normal),
            (Normal, Normal),
            (Critical, Normal),
            (BestEffort, BestEffort)
        ]
    );
}

#[test]
fn publish_reaches_members_in_order_and_markers_frame_membership() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 1);
    let (p, o) = hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    assert_eq!((p.offset, o), (0, JoinOutcome::Joined));
    for i in 0..3u8 {
        let r = hub
            .publish(now, "room:a", 0, TrafficClass::Normal, Bytes::from(vec![i]))
            .unwrap();
        assert_eq!(r.position.offset, u64::from(i) + 1);
        assert_eq!(r.position.epoch, p.epoch);
    }
    assert!(hub.leave(now, sid(1), "room:a").unwrap());
    hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    let got = drain(&mut hub);
    let kinds: Vec<_> = got.iter().map(|(_, e)| e.kind).collect();
    use ChannelEventKind::*;
    assert_eq!(kinds, [Joined, Publication, Publication, Publication, Left]);
    assert_eq!(offsets_of(&got, sid(1)), [1, 2, 3]);
    assert_eq!(
        got[4].1.position.offset, 3,
        "LEFT says where the member stopped"
    );
    assert_eq!(hub.members("room:a"), 0);
    hub.check_invariants().unwrap();
}

#[test]
fn a_member_joining_with_a_position_recovers_what_it_missed_then_goes_live() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 2);
    let last = publish_n(&mut hub, now, "room:a", TrafficClass::Critical, 3);
    let since = ChannelPosition {
        epoch: last.epoch,
        offset: 1,
    };
    let (live, outcome) = hub
        .join(now, sid(1), &player(1), "room:a", Some(since))
        .unwrap();
    assert_eq!(outcome, JoinOutcome::Recovered { publications: 2 });
    assert_eq!(live.offset, 3);
    hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    let got = drain(&mut hub);
    // Publications 1..3 were queued before the join: only the recovered 2 and 3 reach it.
    assert_eq!(offsets_of(&got, sid(1)), [2, 3, 4]);
    hub.check_invariants().unwrap();
}

#[test]
fn trimmed_history_or_another_epoch_answers_history_lost() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 3);
    let last = publish_n(&mut hub, now, "room:a", TrafficClass::Normal, 6);
    drain(&mut hub);
    // history_len 4 keeps offsets 3..=6: resuming after 1 needs 2, which is gone.
    let trimmed = ChannelPosition {
        epoch: last.epoch,
        offset: 1,
    };
    let (_, o) = hub
        .join(now, sid(1), &player(1), "room:a", Some(trimmed))
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost);
    // After 2 is still whole (3..=6 kept).
    let whole = ChannelPosition {
        epoch: last.epoch,
        offset: 2,
    };
    let (_, o) = hub
        .join(now, sid(2), &player(2), "room:a", Some(whole))
        .unwrap();
    assert_eq!(o, JoinOutcome::Recovered { publications: 4 });
    let other_epoch = ChannelPosition {
        epoch: last.epoch ^ 1,
        offset: 6,
    };
    let (_, o) = hub
        .join(now, sid(3), &player(3), "room:a", Some(other_epoch))
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost);
    let got = drain(&mut hub);
    assert_eq!(got[0].1.kind, ChannelEventKind::HistoryLost);
    assert_eq!(got[0].1.position, last);
    assert_eq!(offsets_of(&got, sid(2)), [3, 4, 5, 6]);
    // The TTL trims too: after it, offset 6 is gone.
    let later = now + Duration::from_secs(11);
    hub.sweep(later);
    let after_5 = ChannelPosition {
        epoch: last.epoch,
        offset: 5,
    };
    let (_, o) = hub
        .join(later, sid(4), &player(4), "world", Some(after_5))
        .unwrap();
    assert_eq!(
        o,
        JoinOutcome::HistoryLost,
        "another channel: another epoch"
    );
    hub.session_ended(&sid(1));
    let (_, o) = hub
        .join(later, sid(1), &player(1), "room:a", Some(after_5))
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost, "trimmed by its TTL");
}

/// With an announcement log, an announcement is held until the log has it: nothing of its
/// channel is delivered past it, a retry meanwhile is answered `busy`, the log's answer
/// releases it (or withdraws it: delivered to nobody, and a retry publishes it anew).
#[test]
fn an_announcement_waits_for_the_log_and_a_refused_one_reaches_nobody() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 4);
    hub.set_announcement_log(true);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    let a = hub
        .publish(
            now,
            "room:a",
            7,
            TrafficClass::Critical,
            Bytes::from_static(b"A"),
        )
        .unwrap();
    let rec = a.persist.clone().expect("held for the log");
    assert_eq!(rec.position, a.position);
    assert_eq!(rec.keep, 4);
    let n = hub
        .publish(
            now,
            "room:a",
            0,
            TrafficClass::Normal,
            Bytes::from_static(b"n"),
        )
        .unwrap();
    assert!(n.persist.is_none(), "only announcements are logged");
    // JOINED goes out; the announcement and what follows it wait.
    let got = drain(&mut hub);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].1.kind, ChannelEventKind::Joined);
    assert_eq!(
        hub.publish(
            now,
            "room:a",
            7,
            TrafficClass::Critical,
            Bytes::from_static(b"A")
        ),
        Err(ChannelError::Persisting)
    );
    assert_eq!(ChannelError::Persisting.code(), CloseCode::Busy);
    hub.check_invariants().unwrap();
    assert!(hub.persisted("room:a", a.position, true));
    assert!(!hub.persisted("room:a", a.position, true), "answered once");
    assert_eq!(offsets_of(&drain(&mut hub), sid(1)), [1, 2]);
    // Refused: withdrawn from the queue and the history; the next one goes on.
    let b = hub
        .publish(
            now,
            "room:a",
            8,
            TrafficClass::Critical,
            Bytes::from_static(b"B"),
        )
        .unwrap();
    hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    assert!(drain(&mut hub).is_empty());
    assert!(hub.persisted("room:a", b.position, false));
    hub.check_invariants().unwrap();
    assert_eq!(offsets_of(&drain(&mut hub), sid(1)), [4]);
    let again = hub
        .publish(
            now,
            "room:a",
            8,
            TrafficClass::Critical,
            Bytes::from_static(b"B"),
        )
        .unwrap();
    assert!(!again.duplicate, "a refused publish is published anew");
    assert_eq!(again.position.offset, 5);
    hub.persisted("room:a", again.position, true);
    assert_eq!(offsets_of(&drain(&mut hub), sid(1)), [5]);
}

/// A member whose position is of another epoch (its channel was on an edge that died)
/// receives the announcements the log holds after it, in order, then HISTORY_LOST:
/// announcements survive the edge, the rest is declared lost.
#[test]
fn a_position_of_another_epoch_recovers_the_logged_announcements_before_history_lost() {
    let now = Instant::now();
    let mut old = ChannelHub::new(small_config(), 5);
    old.set_announcement_log(true);
    let mut log = Vec::new();
    for i in 0..3u8 {
        let r = old
            .publish(
                now,
                "room:a",
                0,
                TrafficClass::Critical,
                Bytes::from(vec![i]),
            )
            .unwrap();
        log.push(r.persist.unwrap());
        old.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
            .unwrap();
    }
    // The member had seen offset 2 (the first announcement and a normal one).
    let since = ChannelPosition {
        epoch: log[0].position.epoch,
        offset: 2,
    };
    let mut hub = ChannelHub::new(small_config(), 6);
    hub.set_announcement_log(true);
    assert!(hub.needs_logged(sid(1), "room:a", Some(since)));
    assert!(!hub.needs_logged(sid(1), "room:a", None));
    // A kind the join would refuse, or an invalid name, reads nothing (bounds audit: each
    // such join from a backend cost a read of the log).
    assert!(!hub.needs_logged(sid(1), "nosuch:a", Some(since)));
    assert!(!hub.needs_logged(sid(1), "bad name", Some(since)));
    let (live, o) = hub
        .join_with_logged(now, sid(1), &player(1), "room:a", Some(since), &log)
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost);
    assert!(
        !hub.needs_logged(sid(1), "room:a", Some(live)),
        "its own epoch"
    );
    let got = drain(&mut hub);
    let kinds: Vec<_> = got
        .iter()
        .map(|(_, e)| (e.kind, e.position.offset))
        .collect();
    assert_eq!(
        kinds,
        [
            (ChannelEventKind::Publication, 3),
            (ChannelEventKind::Publication, 5),
            (ChannelEventKind::HistoryLost, 0)
        ]
    );
    assert_eq!(got[0].1.body, Bytes::from(vec![1u8]));
    assert_eq!(got[0].1.position.epoch, since.epoch);
    assert_eq!(hub.stats().logged_recovered, 2);
}

/// A LEAVE taken while a join of the same membership reads the announcement log follows
/// that join: the member gets the join's events, then LEFT, and is a member of nothing.
/// Channels audit: before, the leave found no member (answered as taken) and the join,
/// carried out after the read, left the session a member the backend had left.
#[test]
fn a_leave_taken_while_a_join_reads_the_log_follows_the_join() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 6);
    hub.set_announcement_log(true);
    let since = ChannelPosition {
        epoch: 99,
        offset: 2,
    };
    assert!(hub.needs_logged(sid(1), "room:a", Some(since)));
    hub.deferred_join_started(sid(1), "room:a");
    assert_eq!(hub.leave(now, sid(1), "room:a"), Ok(true), "taken");
    assert_eq!(hub.members("room:a"), 0, "not carried out before the join");
    hub.join_with_logged(now, sid(1), &player(1), "room:a", Some(since), &[])
        .unwrap();
    assert!(
        hub.deferred_join_done(now, sid(1), "room:a"),
        "left after it"
    );
    let got = drain(&mut hub);
    let kinds: Vec<_> = got.iter().map(|(_, e)| e.kind).collect();
    assert_eq!(
        kinds,
        [ChannelEventKind::HistoryLost, ChannelEventKind::Left]
    );
    assert_eq!(hub.members("room:a"), 0);
    // Once the join is over, a leave is carried out at once again, and a done without a
    // start changes nothing.
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    assert!(!hub.deferred_join_done(now, sid(1), "room:a"));
    assert_eq!(hub.leave(now, sid(1), "room:a"), Ok(true));
    let got = drain(&mut hub);
    let kinds: Vec<_> = got.iter().map(|(_, e)| e.kind).collect();
    assert_eq!(kinds, [ChannelEventKind::Joined, ChannelEventKind::Left]);
    assert_eq!(hub.members("room:a"), 0);
    // Two deferred joins, then a LEAVE: carried out after both, not between them (the
    // second would cancel it).
    hub.deferred_join_started(sid(1), "room:a");
    hub.deferred_join_started(sid(1), "room:a");
    assert_eq!(hub.leave(now, sid(1), "room:a"), Ok(true));
    hub.join_with_logged(now, sid(1), &player(1), "room:a", None, &[])
        .unwrap();
    assert!(
        !hub.deferred_join_done(now, sid(1), "room:a"),
        "one still out"
    );
    hub.join_with_logged(now, sid(1), &player(1), "room:a", None, &[])
        .unwrap();
    assert!(hub.deferred_join_done(now, sid(1), "room:a"));
    drain(&mut hub);
    assert_eq!(hub.members("room:a"), 0);
    // A deferred join, a LEAVE, then a join at once: the last word is the join.
    hub.deferred_join_started(sid(1), "room:a");
    assert_eq!(hub.leave(now, sid(1), "room:a"), Ok(true));
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    hub.join_with_logged(now, sid(1), &player(1), "room:a", None, &[])
        .unwrap();
    assert!(
        !hub.deferred_join_done(now, sid(1), "room:a"),
        "the leave was cancelled"
    );
    drain(&mut hub);
    assert_eq!(hub.members("room:a"), 1);
    hub.check_invariants().unwrap();
}

#[test]
fn refusals_are_typed_and_take_nothing() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 4);
    let e = hub.publish(now, "clan:1", 0, TrafficClass::Normal, Bytes::new());
    assert_eq!(e, Err(ChannelError::UnknownKind));
    assert_eq!(e.unwrap_err().code(), CloseCode::UnknownChannelKind);
    // A leave too, not a quiet `normal` (channels audit).
    assert_eq!(
        hub.leave(now, sid(1), "clan:1"),
        Err(ChannelError::UnknownKind)
    );
    for bad in ["", "room a", ":x", "room\n"] {
        assert_eq!(
            hub.publish(now, bad, 0, TrafficClass::Normal, Bytes::new()),
            Err(ChannelError::InvalidName)
        );
    }
    assert_eq!(
        hub.publish(
            now,
            "room:a",
            0,
            TrafficClass::Normal,
            Bytes::from(vec![0; 65])
        ),
        Err(ChannelError::TooLarge)
    );
    // Queue caps per class: best-effort 2, then refused; normal still taken.
    for _ in 0..2 {
        hub.publish(now, "room:a", 0, TrafficClass::BestEffort, Bytes::new())
            .unwrap();
    }
    let full = hub.publish(now, "room:a", 0, TrafficClass::BestEffort, Bytes::new());
    assert_eq!(full, Err(ChannelError::QueueFull));
    assert_eq!(full.unwrap_err().retry_after_ms(), QUEUE_FULL_RETRY_MS);
    let r = hub
        .publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    assert_eq!(r.position.offset, 1, "best-effort takes no offset");
    // Rate: burst 10, three taken so far.
    let mut limited = None;
    for _ in 0..10 {
        if let Err(e) = hub.publish(now, "room:a", 0, TrafficClass::Critical, Bytes::new()) {
            limited = Some(e);
            break;
        }
    }
    // The critical queue (4) fills before the burst runs out.
    assert_eq!(limited, Some(ChannelError::QueueFull));
    drain(&mut hub);
    let mut rate = None;
    for _ in 0..10 {
        if let Err(e) = hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new()) {
            rate = Some(e);
            break;
        }
    }
    match rate {
        Some(ChannelError::RateLimited { retry_after_ms }) => assert!(retry_after_ms > 0),
        other => panic!("expected rate limited, got {other:?}"),
    }
    // Caps: channels per edge (3), per session (2), members per channel (3).
    hub.join(now, sid(1), &player(1), "room:b", None).unwrap();
    hub.join(now, sid(1), &player(1), "room:c", None).unwrap();
    assert_eq!(
        hub.join(now, sid(1), &player(1), "room:a", None),
        Err(ChannelError::Limit)
    );
    assert_eq!(
        hub.publish(now, "room:d", 0, TrafficClass::Normal, Bytes::new()),
        Err(ChannelError::Limit)
    );
    for s in 2..5 {
        let r = hub.join(now, sid(s), &player(s), "room:b", None);
        assert_eq!(r.is_err(), s == 4, "member {s}");
    }
    hub.check_invariants().unwrap();
}

/// Publishes an empty normal publication with publish id `id`.
fn publish_id(
    hub: &mut ChannelHub,
    at: Instant,
    channel: &str,
    id: u64,
) -> Result<PublishReceipt, ChannelError> {
    hub.publish(at, channel, id, TrafficClass::Normal, Bytes::new())
}

#[test]
fn a_retried_publish_is_answered_with_its_first_result() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 5);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    let first = hub
        .publish(
            now,
            "room:a",
            77,
            TrafficClass::Normal,
            Bytes::from_static(b"x"),
        )
        .unwrap();
    let again = hub
        .publish(
            now,
            "room:a",
            77,
            TrafficClass::Normal,
            Bytes::from_static(b"x"),
        )
        .unwrap();
    assert!(!first.duplicate && again.duplicate);
    assert_eq!(first.position, again.position);
    assert_eq!(offsets_of(&drain(&mut hub), sid(1)), [1]);
    // Within the window (60 s) the id is remembered however many publish after it...
    let later = now + Duration::from_secs(59);
    for id in 100..107 {
        hub.publish(later, "room:a", id, TrafficClass::BestEffort, Bytes::new())
            .unwrap();
        drain(&mut hub);
    }
    let again = publish_id(&mut hub, later, "room:a", 77).unwrap();
    assert!(again.duplicate);
    hub.check_invariants().unwrap();
    // ... and after it, the id is a new publish.
    let old = publish_id(&mut hub, now + Duration::from_secs(60), "room:a", 77).unwrap();
    assert!(!old.duplicate);
    hub.check_invariants().unwrap();
}

/// The window never forgets an id early: an edge holding `dedup_max_ids` (8) ids younger
/// than the window, over all its channels, refuses a publish with a new id `rate_limited`
/// until the oldest expires; a retry of a remembered id is still answered.
#[test]
fn a_full_publish_id_window_refuses_until_its_oldest_expires() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 5);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    hub.join(now, sid(1), &player(1), "room:b", None).unwrap();
    for (i, id) in (1..=8).enumerate() {
        let at = now + Duration::from_secs(i as u64);
        let channel = if id % 2 == 0 { "room:b" } else { "room:a" };
        publish_id(&mut hub, at, channel, id).unwrap();
        drain(&mut hub);
    }
    let at = now + Duration::from_secs(10);
    let refused = publish_id(&mut hub, at, "room:b", 9);
    // The oldest (id 1) was published at `now` and expires at now + 60 s.
    assert_eq!(
        refused,
        Err(ChannelError::RateLimited {
            retry_after_ms: 50_000
        })
    );
    let retry = publish_id(&mut hub, at, "room:b", 8).unwrap();
    assert!(retry.duplicate);
    hub.check_invariants().unwrap();
    // The sweep forgets expired ids: the next publish is taken.
    hub.sweep(now + Duration::from_secs(60));
    hub.check_invariants().unwrap();
    let taken = publish_id(&mut hub, now + Duration::from_secs(60), "room:a", 9).unwrap();
    assert!(!taken.duplicate);
    let first_again = publish_id(&mut hub, now + Duration::from_secs(61), "room:a", 1).unwrap();
    assert!(!first_again.duplicate, "id 1's window has passed");
}

#[test]
fn idle_channels_are_reclaimed_and_come_back_with_a_new_epoch() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 6);
    let p = hub
        .publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap()
        .position;
    drain(&mut hub);
    assert_eq!(
        hub.sweep(now + Duration::from_secs(2)),
        0,
        "history still live"
    );
    let later = now + Duration::from_secs(11);
    assert_eq!(hub.sweep(later), 1);
    assert_eq!(hub.channels(), 0);
    let (_, o) = hub
        .join(later, sid(1), &player(1), "room:a", Some(p))
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost);
    assert_ne!(hub.position("room:a").unwrap().epoch, p.epoch);
}

#[test]
fn an_ended_session_is_dropped_from_every_channel_and_a_rejoin_cancels_a_leave() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 7);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    hub.join(now, sid(1), &player(1), "world", None).unwrap();
    hub.session_ended(&sid(1));
    assert_eq!(hub.members("room:a") + hub.members("world"), 0);
    hub.check_invariants().unwrap();
    drain(&mut hub);
    hub.join(now, sid(2), &player(2), "room:a", None).unwrap();
    hub.leave(now, sid(2), "room:a").unwrap();
    let (_, o) = hub.join(now, sid(2), &player(2), "room:a", None).unwrap();
    assert_eq!(o, JoinOutcome::AlreadyMember);
    hub.publish(now, "room:a", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    let got = drain(&mut hub);
    let kinds: Vec<_> = got.iter().map(|(_, e)| e.kind).collect();
    assert_eq!(
        kinds,
        [ChannelEventKind::Joined, ChannelEventKind::Publication]
    );
    assert_eq!(hub.members("room:a"), 1);
    hub.check_invariants().unwrap();
}

/// Session 1 of player 1 joins `guild:g` at `joined` (a kind with backlog), three normal
/// publications follow and are delivered, and the session departs at `left` having
/// acknowledged up to offset `acked`. Returns the channel's epoch.
fn guild_member_departed(hub: &mut ChannelHub, joined: Instant, left: Instant, acked: u64) -> u64 {
    hub.join(joined, sid(1), &player(1), "guild:g", None)
        .unwrap();
    publish_n(hub, joined, "guild:g", TrafficClass::Normal, 3);
    drain(hub);
    let epoch = hub.position("guild:g").unwrap().epoch;
    let acked = [(
        "guild:g".to_owned(),
        ChannelPosition {
            epoch,
            offset: acked,
        },
    )]
    .into();
    hub.session_departed(left, &sid(1), &player(1), &acked);
    epoch
}

#[test]
fn a_departed_member_of_a_kind_with_backlog_recovers_from_its_acknowledged_position() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 8);
    // The client acknowledged up to offset 2 when its session ended.
    let epoch = guild_member_departed(&mut hub, now, now, 2);
    assert_eq!(hub.members("guild:g"), 0);
    hub.publish(now, "guild:g", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    // Its next session joins without a position: the backlog is 3 and 4.
    let (_, o) = hub.join(now, sid(9), &player(1), "guild:g", None).unwrap();
    assert_eq!(o, JoinOutcome::Recovered { publications: 2 });
    assert_eq!(offsets_of(&drain(&mut hub), sid(9)), [3, 4]);
    // Remembered once: a later join is a plain join.
    hub.session_ended(&sid(9));
    let (_, o) = hub.join(now, sid(10), &player(1), "guild:g", None).unwrap();
    assert_eq!(o, JoinOutcome::Joined);
    // Kinds without backlog remember nothing; the memory is capped (2) and expires.
    hub.join(now, sid(2), &player(2), "room:r", None).unwrap();
    let room = [("room:r".to_owned(), hub.position("room:r").unwrap())].into();
    hub.session_departed(now, &sid(2), &player(2), &room);
    let (_, o) = hub.join(now, sid(3), &player(2), "room:r", None).unwrap();
    assert_eq!(o, JoinOutcome::Joined);
    for n in 20..24u8 {
        hub.join(now, sid(n), &player(n), "guild:g", None).unwrap();
        let p = [("guild:g".to_owned(), ChannelPosition { epoch, offset: 4 })].into();
        hub.session_departed(now, &sid(n), &player(n), &p);
        hub.check_invariants().unwrap();
    }
    let (_, o) = hub
        .join(now, sid(40), &player(20), "guild:g", None)
        .unwrap();
    assert_eq!(
        o,
        JoinOutcome::Joined,
        "the oldest departed player was forgotten"
    );
    let (_, o) = hub
        .join(now, sid(41), &player(23), "guild:g", None)
        .unwrap();
    assert_eq!(o, JoinOutcome::Recovered { publications: 0 });
    hub.session_ended(&sid(40));
    hub.session_ended(&sid(41));
    let later = now + Duration::from_secs(11);
    hub.sweep(later);
    let (_, o) = hub
        .join(later, sid(42), &player(22), "guild:g", None)
        .unwrap();
    assert_eq!(o, JoinOutcome::Joined, "expired with the history TTL");
    hub.check_invariants().unwrap();
}

/// Regression (2026-12-05, an audit of PROTOCOL.md §12 against the code): the backlog
/// memory went only with a join *without* `since`, so after a join with `since`, a LEAVE
/// and a later join without it, the edge sent again what followed the old departure: the
/// SDKs, which forget a channel's position at LEFT, showed those publications twice. The
/// memory is used once, by the next join taken (§12.4).
#[test]
fn the_backlog_memory_goes_with_any_join_taken() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 8);
    let epoch = guild_member_departed(&mut hub, now, now, 1);
    // The next session joins with its own position (offset 3): that position wins.
    let since = ChannelPosition { epoch, offset: 3 };
    let (_, o) = hub
        .join(now, sid(9), &player(1), "guild:g", Some(since))
        .unwrap();
    assert_eq!(o, JoinOutcome::Recovered { publications: 0 });
    drain(&mut hub);
    assert_eq!(hub.leave(now, sid(9), "guild:g"), Ok(true));
    drain(&mut hub);
    let (_, o) = hub.join(now, sid(9), &player(1), "guild:g", None).unwrap();
    assert_eq!(o, JoinOutcome::Joined, "not offsets 2 and 3 again");
    hub.check_invariants().unwrap();
}

/// Regression (same audit): a JOIN from a session already a member ignores its `since`
/// (§12.3), but with an announcement log and a `since` of another epoch the edge read the
/// log first (which could answer `unavailable` or take 2 s) for a join that changes nothing.
#[test]
fn a_member_s_join_never_reads_the_log() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 6);
    hub.set_announcement_log(true);
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    let other_epoch = ChannelPosition {
        epoch: hub.position("room:a").unwrap().epoch + 1,
        offset: 2,
    };
    assert!(hub.needs_logged(sid(2), "room:a", Some(other_epoch)));
    assert!(
        !hub.needs_logged(sid(1), "room:a", Some(other_epoch)),
        "already a member"
    );
}

/// A returning member's join refused `queue_full` keeps its backlog position: the retry
/// recovers. Before, the position was taken before the check, and the retry was a plain
/// JOINED that skipped what the member had missed (channels audit).
#[test]
fn a_backlog_join_refused_queue_full_recovers_when_retried() {
    let now = Instant::now();
    let mut config = small_config();
    if let Some(k) = config.kinds.get_mut("guild") {
        k.max_members = 5_000;
    }
    let mut hub = ChannelHub::new(config, 8);
    guild_member_departed(&mut hub, now, now, 1);
    // Other joins fill the channel's queue of direct deliveries (one JOINED each).
    let mut n = 0u16;
    let refused = loop {
        n += 1;
        assert!(n < 5_000, "the direct queue never filled");
        let mut s = [7u8; 16];
        s[..2].copy_from_slice(&n.to_be_bytes());
        if let Err(e) = hub.join(now, s, &format!("crowd-{n}"), "guild:g", None) {
            break e;
        }
    };
    assert_eq!(refused, ChannelError::QueueFull);
    assert_eq!(
        hub.join(now, sid(9), &player(1), "guild:g", None),
        Err(ChannelError::QueueFull)
    );
    drain(&mut hub);
    let (_, o) = hub.join(now, sid(9), &player(1), "guild:g", None).unwrap();
    assert_eq!(o, JoinOutcome::Recovered { publications: 2 });
    assert_eq!(offsets_of(&drain(&mut hub), sid(9)), [2, 3]);
    hub.check_invariants().unwrap();
}

/// A channel whose history expired but that still remembers a departed member's position
/// (kinds with backlog) is not reclaimed until that memory expires: the member's return is
/// HISTORY_LOST, not a JOINED of a new epoch that hides what it missed (channels audit).
#[test]
fn a_remembered_departed_member_keeps_its_channel_from_being_reclaimed() {
    let t0 = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 8);
    let epoch = guild_member_departed(&mut hub, t0, t0 + Duration::from_secs(5), 1);
    // The history (10 s) has expired; the departed position (10 s from its departure) not.
    let later = t0 + Duration::from_secs(12);
    hub.sweep(later);
    assert_eq!(hub.position("guild:g").map(|p| p.epoch), Some(epoch));
    let (_, o) = hub
        .join(later, sid(9), &player(1), "guild:g", None)
        .unwrap();
    assert_eq!(o, JoinOutcome::HistoryLost);
    drain(&mut hub);
    hub.session_ended(&sid(9));
    // Once nothing is remembered, it goes.
    let much_later = t0 + Duration::from_secs(30);
    hub.sweep(much_later);
    hub.sweep(much_later + Duration::from_secs(2));
    assert_eq!(hub.position("guild:g"), None);
    hub.check_invariants().unwrap();
}

/// A publish refused for its size creates no channel (channels audit).
#[test]
fn a_publish_too_large_creates_no_channel() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 8);
    assert_eq!(
        hub.publish(
            now,
            "room:a",
            0,
            TrafficClass::Normal,
            Bytes::from(vec![0u8; 65])
        ),
        Err(ChannelError::TooLarge)
    );
    assert_eq!(hub.position("room:a"), None);
    assert!(hub
        .publish(
            now,
            "room:a",
            0,
            TrafficClass::Normal,
            Bytes::from(vec![0u8; 64])
        )
        .is_ok());
    hub.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Publish {
        ch: u8,
        class: u8,
    },
    Join {
        s: u8,
        ch: u8,
        since: u8,
    },
    Leave {
        s: u8,
        ch: u8,
    },
    End {
        s: u8,
    },
    Drain {
        ch: u8,
        n: u8,
    },
    Advance {
        ms: u16,
    },
    /// The announcement log answers for the channel's oldest held announcement.
    Persist {
        ch: u8,
        ok: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..3).prop_map(|(ch, class)| Op::Publish { ch, class }),
        2 => (0u8..4, 0u8..3, 0u8..4).prop_map(|(s, ch, since)| Op::Join { s, ch, since }),
        1 => (0u8..4, 0u8..3).prop_map(|(s, ch)| Op::Leave { s, ch }),
        1 => (0u8..4).prop_map(|s| Op::End { s }),
        3 => (0u8..3, 1u8..6).prop_map(|(ch, n)| Op::Drain { ch, n }),
        1 => (0u16..3000).prop_map(|ms| Op::Advance { ms }),
        2 => (0u8..3, proptest::bool::weighted(0.8)).prop_map(|(ch, ok)| Op::Persist { ch, ok }),
    ]
}

const NAMES: [&str; 3] = ["room:a", "room:b", "world"];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever happens, every member sees each channel's recoverable publications in
    /// strictly increasing offset order, and a member that stays sees every one from where
    /// it started (its join's live position, or the position it recovered from) without a
    /// hole; the hub's bounds and indexes hold after every step.
    #[test]
    fn members_see_each_channel_in_order_without_holes(ops in proptest::collection::vec(op(), 1..80)) {
        members_see_each_channel_in_order(ops, false)?;
    }

    /// The same with an announcement log that confirms or refuses held announcements at
    /// random moments: nothing of a channel overtakes a held announcement, a refused one is
    /// delivered to nobody (its offset is a hole every member skips), and nothing else is
    /// missed.
    #[test]
    fn held_announcements_keep_each_channel_in_order(ops in proptest::collection::vec(op(), 1..80)) {
        members_see_each_channel_in_order(ops, true)?;
    }
}

fn members_see_each_channel_in_order(ops: Vec<Op>, log: bool) -> Result<(), TestCaseError> {
    let start = Instant::now();
    let mut now = start;
    let mut hub = ChannelHub::new(tight_budgets(), 9);
    hub.set_announcement_log(log);
    // Held announcements per channel, oldest first; those the log refused.
    let mut held: HashMap<&str, VecDeque<ChannelPosition>> = HashMap::new();
    let mut withdrawn: HashSet<(&str, ChannelPosition)> = HashSet::new();
    // (session, channel) -> next offset it must receive, while it is a member.
    let mut expect: HashMap<(SessionId, &str), u64> = HashMap::new();
    let mut epochs: HashMap<&str, u64> = HashMap::new();
    let mut consumers: HashSet<Arc<str>> = HashSet::new();
    let check = |hub: &mut ChannelHub,
                 deliveries: Vec<Delivery>,
                 expect: &mut HashMap<(SessionId, &'static str), u64>,
                 withdrawn: &HashSet<(&'static str, ChannelPosition)>|
     -> Result<(), TestCaseError> {
        for d in deliveries {
            let e = ChannelEvent::decode(d.event.clone()).expect("valid");
            let name = NAMES
                .iter()
                .copied()
                .find(|n| *n == e.channel)
                .expect("known");
            for s in d.to {
                match e.kind {
                    ChannelEventKind::Publication if e.position.offset > 0 => {
                        prop_assert!(
                            !withdrawn.contains(&(name, e.position)),
                            "a refused announcement was delivered"
                        );
                        if let Some(next) = expect.get_mut(&(s, name)) {
                            // Offsets the log refused are holes nobody receives.
                            while withdrawn.contains(&(
                                name,
                                ChannelPosition {
                                    epoch: e.position.epoch,
                                    offset: *next,
                                },
                            )) {
                                *next += 1;
                            }
                            prop_assert_eq!(
                                e.position.offset,
                                *next,
                                "member {:?} of {}",
                                s[0],
                                name
                            );
                            *next += 1;
                        }
                    }
                    ChannelEventKind::Left => {
                        expect.remove(&(s, name));
                    }
                    _ => {}
                }
            }
        }
        hub.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    };
    for op in ops {
        let mut deliveries = Vec::new();
        match op {
            Op::Publish { ch, class } => {
                let class = TrafficClass::ALL[class as usize];
                let name = NAMES[ch as usize];
                if let Ok(r) = hub.publish(now, name, 0, class, Bytes::new()) {
                    prop_assert_eq!(r.persist.is_some(), log && class == TrafficClass::Critical);
                    if let Some(rec) = r.persist {
                        held.entry(name).or_default().push_back(rec.position);
                    }
                }
            }
            Op::Join { s, ch, since } => {
                let name = NAMES[ch as usize];
                let here = hub.position(name);
                let since = match (since, here) {
                    (0, _) | (_, None) => None,
                    (1, Some(p)) => Some(p),
                    (2, Some(p)) => Some(ChannelPosition {
                        epoch: p.epoch,
                        offset: p.offset.saturating_sub(2),
                    }),
                    (_, Some(p)) => Some(ChannelPosition {
                        epoch: p.epoch ^ 5,
                        offset: p.offset,
                    }),
                };
                let was_member = expect.contains_key(&(sid(s), name));
                if let Ok((live, outcome)) = hub.join(now, sid(s), &player(s), name, since) {
                    let first = match outcome {
                        JoinOutcome::Recovered { .. } => since.map(|p| p.offset + 1),
                        JoinOutcome::Joined | JoinOutcome::HistoryLost => Some(live.offset + 1),
                        JoinOutcome::AlreadyMember => None,
                    };
                    if let (Some(first), false) = (first, was_member) {
                        expect.insert((sid(s), name), first);
                    }
                    epochs.insert(name, live.epoch);
                }
            }
            Op::Leave { s, ch } => {
                let _ = hub.leave(now, sid(s), NAMES[ch as usize]);
            }
            Op::End { s } => {
                hub.session_ended(&sid(s));
                expect.retain(|(who, _), _| *who != sid(s));
            }
            Op::Drain { ch, n } => {
                while let Some(c) = hub.poll_ready() {
                    consumers.insert(c);
                }
                let name: Arc<str> = NAMES[ch as usize].into();
                if consumers.contains(&name) {
                    for _ in 0..n {
                        match hub.next_delivery(&name) {
                            Some(d) => deliveries.push(d),
                            None => {
                                consumers.remove(&name);
                                break;
                            }
                        }
                    }
                }
            }
            Op::Advance { ms } => {
                now += Duration::from_millis(ms.into());
                hub.sweep(now);
            }
            Op::Persist { ch, ok } => {
                let name = NAMES[ch as usize];
                if let Some(p) = held.get_mut(name).and_then(VecDeque::pop_front) {
                    prop_assert!(
                        hub.persisted(name, p, ok),
                        "a held announcement was not found"
                    );
                    if !ok {
                        withdrawn.insert((name, p));
                    }
                }
            }
        }
        check(&mut hub, deliveries, &mut expect, &withdrawn)?;
    }
    // The log confirms what it still holds; then drain everything: members that stayed
    // have seen every offset up to the last.
    for (name, ps) in held.drain() {
        for p in ps {
            prop_assert!(hub.persisted(name, p, true));
        }
    }
    while let Some(c) = hub.poll_ready() {
        consumers.insert(c);
    }
    let mut rest = Vec::new();
    for c in consumers.drain() {
        while let Some(d) = hub.next_delivery(&c) {
            rest.push(d);
        }
    }
    check(&mut hub, rest, &mut expect, &withdrawn)?;
    for ((s, name), next) in &mut expect {
        let here = hub.position(name).unwrap_or_default();
        while withdrawn.contains(&(
            *name,
            ChannelPosition {
                epoch: here.epoch,
                offset: *next,
            },
        )) {
            *next += 1;
        }
        let last = here.offset;
        prop_assert_eq!(
            *next,
            last + 1,
            "member {:?} of {} missed the tail",
            s[0],
            name
        );
    }
    prop_assert_eq!(hub.pending(), 0);
    Ok(())
}

/// A reclaimed channel's ids expire without touching the channel that comes back under its
/// name: an id taken again there is remembered for its own window.
#[test]
fn a_reclaimed_channels_ids_do_not_expire_its_successors() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 5);
    publish_id(&mut hub, now, "room:a", 5).unwrap();
    drain(&mut hub);
    // No members; the history (10 s TTL) and the idle time (1 s) pass: reclaimed.
    let later = now + Duration::from_secs(11);
    assert_eq!(hub.sweep(later), 1);
    let again = publish_id(&mut hub, later, "room:a", 5).unwrap();
    assert!(
        !again.duplicate,
        "a new epoch: the first one's ids went with it"
    );
    // (Not drained: the channel stays while its publication is pending.)
    hub.check_invariants().unwrap();
    // The first id's window ends (now + 60 s); the second's (later + 60 s) has not.
    hub.sweep(now + Duration::from_secs(60));
    hub.check_invariants().unwrap();
    let retry = publish_id(&mut hub, now + Duration::from_secs(60), "room:a", 5).unwrap();
    assert!(retry.duplicate);
    assert_eq!(retry.position, again.position);
}

/// Every delivery of `channel` now (its consumer run to the end).
fn deliveries_of(hub: &mut ChannelHub, channel: &str) -> Vec<Delivery> {
    std::iter::from_fn(|| hub.next_delivery(channel)).collect()
}

fn notice(seq: u64, present: bool, channel: &str) -> InterestNotice {
    InterestNotice {
        seq,
        present,
        channel: channel.into(),
    }
}

#[test]
fn a_new_channel_is_delivered_only_once_every_link_acknowledged_it() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 1);
    let (a, b) = (hub.interest_link_up(), hub.interest_link_up());
    assert_eq!(hub.poll_interest_wakeup(), None, "nothing to tell yet");
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    assert!(hub.awaiting_interest("room:a"));
    assert_eq!(hub.awaiting_channels(), 1);
    let mut woken: Vec<_> = std::iter::from_fn(|| hub.poll_interest_wakeup()).collect();
    woken.sort_unstable();
    assert_eq!(woken, vec![a, b]);
    // A publication while it waits is taken, queued behind the JOINED.
    publish_n(&mut hub, now, "room:a", TrafficClass::Normal, 1);
    assert_eq!(
        hub.poll_ready(),
        None,
        "nothing delivered before the acknowledgements"
    );
    assert_eq!(hub.interest_due(a, 10), vec![notice(1, true, "room:a")]);
    assert_eq!(hub.interest_due(a, 10), vec![], "each change once");
    // Waiting past the deadline names the links that owe it, not before.
    let deadline = Duration::from_secs(5);
    assert_eq!(
        hub.interest_overdue(now + Duration::from_secs(4), deadline),
        Vec::<InterestLink>::new()
    );
    let mut overdue = hub.interest_overdue(now + deadline, deadline);
    overdue.sort_unstable();
    assert_eq!(overdue, vec![a, b]);
    hub.interest_acked(a, 1);
    assert_eq!(hub.interest_overdue(now + deadline, deadline), vec![b]);
    assert!(hub.awaiting_interest("room:a"), "b has not acknowledged");
    assert_eq!(hub.poll_interest_settled(), None);
    assert_eq!(hub.interest_due(b, 10), vec![notice(1, true, "room:a")]);
    hub.interest_acked(b, 1);
    assert!(!hub.awaiting_interest("room:a"));
    assert_eq!(hub.awaiting_channels(), 0);
    assert_eq!(hub.poll_interest_settled().as_deref(), Some("room:a"));
    assert_eq!(hub.poll_ready().as_deref(), Some("room:a"));
    let kinds: Vec<ChannelEventKind> = deliveries_of(&mut hub, "room:a")
        .iter()
        .map(|d| ChannelEvent::decode(d.event.clone()).unwrap().kind)
        .collect();
    assert_eq!(
        kinds,
        vec![ChannelEventKind::Joined, ChannelEventKind::Publication]
    );
    assert_eq!(
        hub.interest_overdue(now + Duration::from_secs(60), Duration::from_secs(5)),
        Vec::<InterestLink>::new(),
        "nothing owed any more"
    );
    // A second member of a settled channel waits for nobody.
    hub.join(now, sid(2), &player(2), "room:a", None).unwrap();
    assert!(!hub.awaiting_interest("room:a"));
    hub.check_invariants().unwrap();
}

#[test]
fn a_link_that_goes_down_owes_nothing_and_a_new_one_learns_every_channel() {
    let now = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 1);
    let a = hub.interest_link_up();
    hub.join(now, sid(1), &player(1), "room:a", None).unwrap();
    // Sent, not acknowledged, then the link dies: the channel stops waiting.
    assert_eq!(hub.interest_due(a, 10).len(), 1);
    hub.interest_link_down(a);
    assert!(!hub.awaiting_interest("room:a"));
    assert_eq!(hub.poll_interest_settled().as_deref(), Some("room:a"));
    let b = hub.interest_link_up();
    assert_eq!(
        hub.poll_interest_wakeup(),
        Some(b),
        "room:a is due on the new link"
    );
    hub.join(now, sid(1), &player(1), "room:b", None).unwrap();
    assert!(hub.awaiting_interest("room:b"));
    // The new link learns room:a (which does not wait for it) and room:b.
    assert_eq!(
        hub.interest_due(b, 10),
        vec![notice(1, true, "room:a"), notice(2, true, "room:b")]
    );
    // A link that dies before its notice was even sent owes nothing either.
    let c = hub.interest_link_up();
    hub.publish(now, "world", 0, TrafficClass::Normal, Bytes::new())
        .unwrap();
    hub.interest_link_down(c);
    assert!(hub.awaiting_interest("world"), "b still owes its ack");
    hub.interest_acked(b, 1);
    assert!(hub.awaiting_interest("room:b") && hub.awaiting_interest("world"));
    hub.interest_acked(b, 2);
    assert!(!hub.awaiting_interest("room:b"));
    assert_eq!(hub.interest_due(b, 10), vec![notice(3, true, "world")]);
    hub.interest_acked(b, 3);
    assert!(!hub.awaiting_interest("world"));
    hub.check_invariants().unwrap();
}

#[test]
fn a_reclaimed_channel_is_told_absent_and_a_new_epoch_waits_again() {
    let start = Instant::now();
    let mut hub = ChannelHub::new(small_config(), 1);
    let a = hub.interest_link_up();
    hub.join(start, sid(1), &player(1), "room:a", None).unwrap();
    assert_eq!(hub.interest_due(a, 10), vec![notice(1, true, "room:a")]);
    hub.interest_acked(a, 1);
    while let Some(c) = hub.poll_ready() {
        deliveries_of(&mut hub, &c);
    }
    hub.leave(start, sid(1), "room:a").unwrap();
    while let Some(c) = hub.poll_ready() {
        deliveries_of(&mut hub, &c);
    }
    let later = start + Duration::from_secs(5);
    assert_eq!(hub.sweep(later), 1);
    assert_eq!(hub.poll_interest_wakeup(), Some(a));
    assert_eq!(hub.interest_due(a, 10), vec![notice(2, false, "room:a")]);
    // Reclaimed and created again before the link was told: one notice, the state now.
    hub.join(later, sid(1), &player(1), "room:a", None).unwrap();
    hub.leave(later, sid(1), "room:a").unwrap();
    hub.interest_acked(a, 2);
    assert!(hub.awaiting_interest("room:a"));
    assert_eq!(hub.interest_due(a, 10), vec![notice(3, true, "room:a")]);
    hub.interest_acked(a, 3);
    assert!(!hub.awaiting_interest("room:a"));
    hub.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum InterestOp {
    LinkUp,
    LinkDown {
        l: u8,
    },
    /// The link's task sends up to `n` due notices (on the wire).
    Send {
        l: u8,
        n: u8,
    },
    /// The backend takes up to `n` notices off the wire.
    Take {
        l: u8,
        n: u8,
    },
    /// The backend acknowledges what it took.
    Ack {
        l: u8,
    },
    Join {
        s: u8,
        ch: u8,
    },
    Leave {
        s: u8,
        ch: u8,
    },
    Publish {
        ch: u8,
    },
    Drain,
    Advance {
        ms: u16,
    },
}

fn interest_op() -> impl Strategy<Value = InterestOp> {
    prop_oneof![
        1 => Just(InterestOp::LinkUp),
        1 => (0u8..4).prop_map(|l| InterestOp::LinkDown { l }),
        3 => (0u8..4, 1u8..4).prop_map(|(l, n)| InterestOp::Send { l, n }),
        3 => (0u8..4, 1u8..4).prop_map(|(l, n)| InterestOp::Take { l, n }),
        3 => (0u8..4).prop_map(|l| InterestOp::Ack { l }),
        3 => (0u8..4, 0u8..3).prop_map(|(s, ch)| InterestOp::Join { s, ch }),
        1 => (0u8..4, 0u8..3).prop_map(|(s, ch)| InterestOp::Leave { s, ch }),
        2 => (0u8..3).prop_map(|ch| InterestOp::Publish { ch }),
        2 => Just(InterestOp::Drain),
        1 => (0u16..3000).prop_map(|ms| InterestOp::Advance { ms }),
    ]
}

/// A backend's view of one edge, as it builds it from the notices it takes.
#[derive(Debug, Default)]
struct BackendView {
    link: InterestLink,
    present: HashSet<String>,
    /// Sent by the edge, not taken yet.
    wire: VecDeque<InterestNotice>,
    /// The last notice taken (acknowledged on `Ack`).
    taken: u64,
    /// Its first CREDIT came: everything the edge had at link-up was taken.
    synced: bool,
}

impl BackendView {
    /// Takes the next notice off the wire, in order.
    fn take(&mut self, n: InterestNotice) -> Result<(), TestCaseError> {
        prop_assert_eq!(n.seq, self.taken + 1);
        self.taken = n.seq;
        if n.present {
            self.present.insert(n.channel.to_string());
        } else {
            self.present.remove(&*n.channel);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever the order of links coming and going, notices sent and acknowledged, joins,
    /// publishes and reclaims: a channel that delivers (does not wait) is known as present
    /// by every synced backend that is linked, so a backend that publishes only where a
    /// channel is present never skips an edge whose members have been shown their JOINED.
    #[test]
    fn a_channel_delivers_only_once_every_linked_backend_knows_it(
        ops in proptest::collection::vec(interest_op(), 1..80)
    ) {
        let mut now = Instant::now();
        let mut hub = ChannelHub::new(small_config(), 3);
        let mut views: Vec<BackendView> = Vec::new();
        for op in ops {
            match op {
                InterestOp::LinkUp => {
                    let link = hub.interest_link_up();
                    let mut view = BackendView { link, ..BackendView::default() };
                    // The shell sends everything due before the link's first CREDIT.
                    loop {
                        let due = hub.interest_due(link, 2);
                        if due.is_empty() {
                            break;
                        }
                        for n in due {
                            view.take(n)?;
                        }
                    }
                    view.synced = true;
                    views.push(view);
                }
                InterestOp::LinkDown { l } => {
                    if !views.is_empty() {
                        let v = views.remove(l as usize % views.len());
                        hub.interest_link_down(v.link);
                    }
                }
                InterestOp::Send { l, n } => {
                    if !views.is_empty() {
                        let i = l as usize % views.len();
                        let v = &mut views[i];
                        v.wire.extend(hub.interest_due(v.link, n.into()));
                    }
                }
                InterestOp::Take { l, n } => {
                    if !views.is_empty() {
                        let i = l as usize % views.len();
                        let v = &mut views[i];
                        for _ in 0..n {
                            let Some(n) = v.wire.pop_front() else { break };
                            v.take(n)?;
                        }
                    }
                }
                InterestOp::Ack { l } => {
                    if !views.is_empty() {
                        let i = l as usize % views.len();
                        hub.interest_acked(views[i].link, views[i].taken);
                    }
                }
                InterestOp::Join { s, ch } => {
                    let _ = hub.join(now, sid(s), &player(s), NAMES[ch as usize], None);
                }
                InterestOp::Leave { s, ch } => {
                    let _ = hub.leave(now, sid(s), NAMES[ch as usize]);
                }
                InterestOp::Publish { ch } => {
                    let _ = hub.publish(now, NAMES[ch as usize], 0, TrafficClass::Normal, Bytes::new());
                }
                InterestOp::Drain => {
                    while let Some(c) = hub.poll_ready() {
                        prop_assert!(!hub.awaiting_interest(&c), "{} scheduled while it waits", c);
                        deliveries_of(&mut hub, &c);
                    }
                }
                InterestOp::Advance { ms } => {
                    now += Duration::from_millis(ms.into());
                    hub.sweep(now);
                }
            }
            while hub.poll_interest_settled().is_some() {}
            while hub.poll_interest_wakeup().is_some() {}
            hub.check_invariants().map_err(TestCaseError::fail)?;
            for name in NAMES {
                if hub.position(name).is_some() && !hub.awaiting_interest(name) {
                    for v in views.iter().filter(|v| v.synced) {
                        prop_assert!(
                            v.present.contains(name),
                            "{} delivers but link {} does not know it", name, v.link
                        );
                    }
                }
            }
        }
        // Every backend takes and acknowledges what it was sent: no channel is left
        // waiting, and everything pending is delivered.
        for v in &mut views {
            loop {
                let due = hub.interest_due(v.link, 16);
                if due.is_empty() {
                    break;
                }
                v.wire.extend(due);
            }
            if let Some(last) = v.wire.back() {
                v.taken = last.seq;
            }
            hub.interest_acked(v.link, v.taken);
        }
        for name in NAMES {
            prop_assert!(!hub.awaiting_interest(name), "{} still waits", name);
        }
        while let Some(c) = hub.poll_ready() {
            deliveries_of(&mut hub, &c);
        }
        prop_assert_eq!(hub.pending(), 0);
    }
}

/// Every channel's history together keeps to `history_budget_bytes` (bounded-everything
/// audit: only each channel's own caps bounded it, 10,000 channels x 500 x 16 KiB): a
/// channel publishing past the budget recycles its own oldest first, a channel with
/// nothing of its own to give takes the oldest of another, and a member recovering from
/// before what was forgotten gets HISTORY_LOST.
#[test]
fn histories_keep_to_their_budget_oldest_first() {
    let now = Instant::now();
    let body = Bytes::from(vec![7u8; 50]);
    // One publication's bytes, measured on a hub like the one under test.
    let mut probe = ChannelHub::new(small_config(), 3);
    probe
        .publish(now, "room:a", 0, TrafficClass::Normal, body.clone())
        .unwrap();
    let one = probe.history_bytes();
    let mut config = small_config();
    // Four and a half: room:a's four fit, not a fifth publication anywhere.
    config.history_budget_bytes = 4 * one + one / 2;
    let mut hub = ChannelHub::new(config, 3);
    let mut at = now;
    let mut publish = |hub: &mut ChannelHub, name: &str| {
        at += Duration::from_millis(10);
        hub.publish(at, name, 0, TrafficClass::Normal, body.clone())
            .unwrap();
        drain(hub);
        hub.check_invariants().unwrap();
        at
    };
    for _ in 0..4 {
        publish(&mut hub, "room:a");
    }
    assert_eq!(hub.stats().history_evicted, 0, "within the budget");
    // room:b's first needs room and room:b has nothing else to give: room:a's oldest
    // goes. Then room:b recycles its own oldest.
    publish(&mut hub, "room:b");
    assert_eq!(hub.stats().history_evicted, 1);
    publish(&mut hub, "room:b");
    let at = publish(&mut hub, "room:b");
    assert_eq!(hub.stats().history_evicted, 3);
    let since = |hub: &ChannelHub, name: &str, offset| {
        Some(ChannelPosition {
            epoch: hub.position(name).unwrap().epoch,
            offset,
        })
    };
    let s = since(&hub, "room:a", 0);
    let (_, a) = hub.join(at, sid(1), &player(1), "room:a", s).unwrap();
    assert_eq!(a, JoinOutcome::HistoryLost, "room:a's first was forgotten");
    let s = since(&hub, "room:a", 1);
    let (_, a) = hub.join(at, sid(2), &player(2), "room:a", s).unwrap();
    assert!(matches!(a, JoinOutcome::Recovered { .. }), "{a:?}");
    let s = since(&hub, "room:b", 1);
    let (_, b) = hub.join(at, sid(3), &player(3), "room:b", s).unwrap();
    assert_eq!(
        b,
        JoinOutcome::HistoryLost,
        "room:b recycled its own oldest"
    );
    assert!(hub.history_bytes() <= 4 * one + one / 2);
    hub.check_invariants().unwrap();
}

/// Publications waiting for their consumers over all channels keep to
/// `pending_budget_bytes`: past it a publish is refused `queue_full` (a typed answer,
/// nothing queued) even where the channel's own queue has room, and taken again once the
/// consumers have delivered.
#[test]
fn waiting_publications_keep_to_their_budget() {
    let now = Instant::now();
    let body = Bytes::from(vec![7u8; 50]);
    let mut config = small_config();
    config.pending_budget_bytes = 3 * publication_len_bound("room:a", body.len());
    let mut hub = ChannelHub::new(config, 3);
    for name in ["room:a", "room:b", "room:a"] {
        hub.publish(now, name, 0, TrafficClass::Normal, body.clone())
            .unwrap();
    }
    assert_eq!(
        hub.publish(now, "room:b", 0, TrafficClass::Normal, body.clone())
            .unwrap_err(),
        ChannelError::QueueFull,
        "the channel's queue has room, the edge's budget not"
    );
    hub.check_invariants().unwrap();
    drain(&mut hub);
    hub.publish(now, "room:b", 0, TrafficClass::Normal, body.clone())
        .unwrap();
    hub.check_invariants().unwrap();
}
