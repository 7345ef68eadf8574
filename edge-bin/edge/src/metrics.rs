//! The edge's Prometheus metrics (O1), one registry per edge (no globals, so several edges
//! can run in one test process). Library crates keep plain atomic counters; the edge exposes
//! them here, read at scrape time by a collector registered in the same registry, so
//! `/metrics` is one registry's exposition (one `# TYPE` line per family).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use waygate_session::driver::SessionLayer;

/// Label: transport kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabel {
    /// `tcp`, `tls`, `ws`, `wss`, `quic`, `kcp`.
    pub transport: String,
}

/// Labels: transport and setup phase.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `tcp`, `tls`, `ws`, `wss`, `quic`, `kcp`.
    pub transport: String,
    /// `transport`, `hello`, `auth`, `restore`, `claim`.
    pub phase: String,
}

/// Labels: service and instance.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    /// Service name.
    pub service: String,
    /// Instance id.
    pub instance: String,
}

/// Label: a close/error code.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// Code label (`busy`, `unavailable`...).
    pub code: String,
}

/// Label: why the edge re-asserted its sessions' ownership in Redis.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SweepLabel {
    /// `periodic` (every `cluster.reassert_ms`), `redis_back` (Redis answered again after
    /// failing), `missed_kicks` (kick notices may have been missed).
    pub reason: String,
}

/// Label: the kind of key a backend pinned (PIN).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PinKindLabel {
    /// `player` or `room`.
    pub kind: String,
}

/// Label: what became of a backend's push to a player (PLAYER_PUSH).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `delivered`, `offline`, `queue_full`, `busy`, `unreachable`, `unknown`.
    pub outcome: String,
}

/// Label: traffic class.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    /// `critical`, `normal`, `best_effort`.
    pub class: String,
}

/// Label: backend address.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabel {
    /// `host:port`.
    pub backend: String,
}

/// Labels: channel kind, traffic class, and what happened.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChannelLabels {
    /// The channel kind (`guild`, `world`...).
    pub kind: String,
    /// `critical` (announcement), `normal` (reliable), `best_effort`.
    pub class: String,
    /// Publish: `accepted`, `duplicate`, or the refusal; delivery: `delivered`, `offline`,
    /// `queue_full`, `shed`; join: `joined`, `recovered`, `history_lost`...
    pub result: String,
}

/// Labels: channel kind and traffic class.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ChannelClassLabels {
    /// The channel kind.
    pub kind: String,
    /// The traffic class.
    pub class: String,
}

/// Every metric of one edge.
#[derive(Debug)]
pub struct EdgeMetrics {
    /// The registry (encode it for `/metrics`).
    pub registry: Registry,
    /// Connections that finished the transport handshake.
    pub connections_accepted: Family<TransportLabel, Counter>,
    /// Open client connections.
    pub connections_open: Family<TransportLabel, Gauge>,
    /// Time from transport accept to session established (WELCOME), seconds.
    pub session_setup_seconds: Family<TransportLabel, Histogram>,
    /// The phases of that setup: waiting for HELLO, auth, restore, claim.
    pub session_phase_seconds: Family<PhaseLabels, Histogram>,
    /// Time to route one upstream message (router lock and decision: service, then
    /// instance), seconds.
    pub route_seconds: Histogram,
    /// Upstream messages forwarded to a backend.
    pub forwarded: Family<RouteLabels, Counter>,
    /// Upstream messages answered with ERROR instead (busy, unavailable, no_route...).
    pub upstream_refused: Family<CodeLabel, Counter>,
    /// Downstream messages handed to sessions.
    pub pushed: Family<ClassLabel, Counter>,
    /// Downstream messages not queued: session gone, best-effort shed, or a full queue (a
    /// sequenced one is then declared lost in the session: slow_consumer close, gap on resume).
    pub push_dropped: Family<ClassLabel, Counter>,
    /// Backends' pushes to players (PLAYER_PUSH) by outcome, and the same counters
    /// indexed by `PlayerPushOutcome as usize` (taken once).
    pub player_pushes: Family<OutcomeLabel, Counter>,
    /// `player_pushes`' counters by outcome byte.
    pub player_push_outcomes: [Counter; 6],
    /// Backends' pushes to players waiting to be sent to another edge (not the batch out).
    pub player_pushes_waiting: Gauge,
    /// Backend PINs applied to the router (R3).
    pub pins_applied: Counter,
    /// Backend PINs refused (unknown instance, not pinnable, too many pins).
    pub pins_refused: Counter,
    /// Backend pins removed: by UNPIN, or dropped with their instance from the route table.
    pub pins_removed: Counter,
    /// Keys pinned by backends on this edge's router, by kind (at most 100,000 of each).
    pub pinned_keys: Family<PinKindLabel, Gauge>,
    /// Backend BINDs refused (a service the route table does not have).
    pub binds_refused: Counter,
    /// `forwarded`'s counter per routed instance, found without building a label.
    forwarded_by_target: Mutex<HashMap<ServiceInstance, Counter>>,
    /// `pushed` and `push_dropped` per class (indexed by `TrafficClass as usize`), taken
    /// once: the push path allocates no label.
    pub push_counters: [(Counter, Counter); 3],
    /// Backend links up (1) or down (0).
    pub backend_up: Family<BackendLabel, Gauge>,
    /// FORWARD credit left on each backend link (0: the edge answers `busy`, B4).
    pub link_forward_credits: Family<BackendLabel, Gauge>,
    /// Current route epoch.
    pub route_epoch: Gauge,
    /// Seconds since the route table was last loaded successfully.
    pub route_staleness_seconds: Gauge<f64, AtomicU64>,
    /// Messages re-routed after a backend reported a stale epoch.
    pub stale_epoch_reroutes: Counter,
    /// Client messages that waited in their session's held line (PROTOCOL.md §9.5): behind
    /// an older message to their service that may still be routed again or still runs on
    /// another instance, or behind such a waiting message.
    pub forwards_held: Counter,
    /// Of those, the ones refused `busy` after waiting the bound (2 s since they arrived).
    pub forwards_hold_expired: Counter,
    /// Client messages of sessions quiesced for a hard migration, not forwarded here (the
    /// client resends them to the edge it moves to).
    pub forwards_withdrawn: Counter,
    /// Ownership re-assert sweeps that went through, by reason.
    pub ownership_sweeps: Family<SweepLabel, Counter>,
    /// Players moved to another instance by migrations.
    pub migrations: Counter,
    /// 1 while the edge drains.
    pub draining: Gauge,
    /// 1 when this edge's resume-key secret is not the deployment's (or it has none while
    /// the others seal).
    pub resume_key_mismatch: Gauge,
    /// Overload level 0..=3 (B5).
    pub overload_level: Gauge,
    /// The event loop's sustained lag (the least of a second's timer ticks), seconds: one
    /// of the overload level's inputs (`backpressure.refuse_at_loop_lag_ms`).
    pub event_loop_lag_seconds: Gauge<f64, AtomicU64>,
    /// Connections refused by admission control (B1).
    pub admission_refused: Counter,
    /// Best-effort pushes shed at overload level 1+ (B5).
    pub overload_shed: Counter,
    /// Accept loops restarted after a panic, per transport.
    pub accept_loop_restarts: Family<TransportLabel, Counter>,
    /// Sessions of this edge opened on each backend instance (by link address).
    pub backend_sessions: Family<BackendLabel, Gauge>,
    /// Binding moves queued and not yet carried out (R4).
    pub migrations_pending: Gauge,
    /// Keys bound to an instance on this edge's router (players with a session here, rooms).
    pub route_bindings: Gauge,
    /// Share of this edge's bound keys the last table change queued for a move.
    pub route_keys_moved_ratio: Gauge<f64, AtomicU64>,
    /// Channel publishes by kind, class and result (taken or the refusal's reason).
    pub channel_publishes: Family<ChannelLabels, Counter>,
    /// Channel events pushed to members, by kind, class and result.
    pub channel_deliveries: Family<ChannelLabels, Counter>,
    /// Channel joins by kind and result (joined, recovered, history_lost, refusals).
    pub channel_joins: Family<ChannelLabels, Counter>,
    /// Time from a publish being taken to its push into every member's session queue.
    pub channel_delivery_seconds: Family<ChannelClassLabels, Histogram>,
    /// Publications recovered for joining members.
    pub channel_recovered: Counter,
    /// Channels on this edge.
    pub channels_active: Gauge,
    /// New channels waiting for backends to acknowledge that this edge has them (PROTOCOL.md
    /// §12.6): nothing of them is delivered meanwhile; stuck above 0 means a backend does
    /// not acknowledge (its link is declared dead after three heartbeats).
    pub channels_awaiting_backends: Gauge,
    /// Channel items waiting for their consumer.
    pub channel_pending: Gauge,
    /// Announcements held until the announcement log has them (PROTOCOL.md §12.5): stuck
    /// above 0 means the log is slow or down (alert on it).
    pub announcements_held: Gauge,
    /// Publish ids the channels remember (the dedup window, PROTOCOL.md §12.7): at
    /// `channels.dedup_max_ids`, publishes with a new id are refused `rate_limited`.
    pub channel_publish_ids: Gauge,
    /// Announcements members received from the announcement log (their edge was gone).
    pub announcements_recovered: Counter,
    /// Refused announcements the log could not be told to withdraw (their append may have
    /// landed: a member recovering from the log may receive them).
    pub announcement_withdrawals_failed: Counter,
    /// Channel publications waiting for their consumer, by kind and class.
    pub channel_pending_by_class: Family<ChannelClassLabels, Gauge>,
    /// Bytes of publications kept for recovery over all channels (at most
    /// `channels.history_budget_bytes`).
    pub channel_history_bytes: Gauge,
    /// Bytes of publications waiting for their consumers over all channels (at
    /// `channels.pending_budget_bytes`, publishes are refused `queue_full`).
    pub channel_pending_bytes: Gauge,
    /// Kept publications forgotten early because the histories reached
    /// `channels.history_budget_bytes` (members recovering from before them get
    /// HISTORY_LOST).
    pub channel_history_evicted: Counter,
}

impl Default for EdgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// (service, instance id), shared with the route table.
type ServiceInstance = (Arc<str>, Arc<str>);

/// The session layer of an edge as the metrics see it: set once, when the edge has built it.
pub type SessionLayerSlot = Arc<OnceLock<Arc<SessionLayer>>>;

/// Buckets of `session_queue_length`: empty, then powers of two up to the largest queue
/// bound an operator is likely to set.
const QUEUE_LENGTH_BUCKETS: [f64; 14] = [
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// Reads the session layer's counters at scrape time: `sessions_live`, the write-through
/// counters, `session_transition{from,to}` and every named session counter
/// (`session_<name>_total`).
#[derive(Debug)]
struct SessionLayerCollector(SessionLayerSlot);

impl Collector for SessionLayerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(s) = self.0.get() else {
            return Ok(());
        };
        let live = ConstGauge::new(i64::try_from(s.registry.len()).unwrap_or(i64::MAX));
        live.encode(encoder.encode_descriptor(
            "sessions_live",
            "Sessions held by this edge, attached or lingering",
            None,
            live.metric_type(),
        )?)?;
        let lingering =
            ConstGauge::new(i64::try_from(s.counters.detached_now()).unwrap_or(i64::MAX));
        lingering.encode(encoder.encode_descriptor(
            "sessions_lingering",
            "Sessions held without a connection, waiting for their client to resume",
            None,
            lingering.metric_type(),
        )?)?;
        {
            // The distribution of outbound queue lengths across sessions, taken at scrape
            // time (O1): a slow consumer shows as mass in the high buckets before it overflows.
            let queues = Histogram::new(QUEUE_LENGTH_BUCKETS);
            s.registry
                .each_queue_length(|len| queues.observe(len as f64));
            queues.encode(encoder.encode_descriptor(
                "session_queue_length",
                "Outbound queue length (items) of each session held, at scrape time",
                None,
                queues.metric_type(),
            )?)?;
        }
        {
            // Always exported (0 without write-through), so dashboards and alerts find them.
            use std::sync::atomic::Ordering::Relaxed;
            let (writes, failures, commits, fenced) =
                s.write_through.as_ref().map_or((0, 0, 0, 0), |wt| {
                    (
                        wt.writes.load(Relaxed),
                        wt.failures.load(Relaxed),
                        wt.commits.load(Relaxed),
                        wt.fenced.load(Relaxed),
                    )
                });
            let host = s.registry.stats();
            for (name, help, value) in [
                (
                    "write_through_writes",
                    "Snapshot writes made before the client saw new state",
                    writes,
                ),
                (
                    "write_through_failures",
                    "Snapshot writes that failed (writes pause, then retry)",
                    failures,
                ),
                (
                    "write_through_commits",
                    "Group commits of the write-through (store round trips, each for many sessions)",
                    commits,
                ),
                (
                    "write_through_fenced",
                    "Snapshot writes refused because a newer owner exists (stale copies)",
                    fenced,
                ),
                (
                    "session_host_answer_timeouts",
                    "Hand-overs and takeovers whose session did not answer within 2 s (its connection task was stuck)",
                    host.answer_timeouts,
                ),
                (
                    "session_host_orphaned",
                    "Sessions handed over after their resume gave up waiting (put back in the store)",
                    host.orphaned,
                ),
                (
                    "session_host_mailbox_full",
                    "Commands for a session refused because its mailbox was full",
                    host.mailbox_full,
                ),
            ] {
                let c = ConstCounter::new(value);
                c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
            }
        }
        let transitions = s.counters.transitions();
        if !transitions.is_empty() {
            let mut family = encoder.encode_descriptor(
                "session_transition",
                "Session state machine transitions",
                None,
                MetricType::Counter,
            )?;
            for (from, to, value) in transitions {
                let labels = vec![("from", from.as_str()), ("to", to.as_str())];
                ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, value) in s.counters.named() {
            let full = format!("session_{name}");
            let c = ConstCounter::new(value);
            c.encode(encoder.encode_descriptor(&full, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

/// Reads the listeners' own counters at scrape time: per transport, handshakes that failed
/// or timed out (TLS, WebSocket upgrade, QUIC), connections closed for a bad frame, and
/// admission refusals; and the KCP endpoint's counters.
#[derive(Debug)]
pub struct ListenerCollector {
    /// Per listener.
    pub listeners: Vec<(
        waygate_transport::TransportKind,
        Arc<waygate_transport::conn::ListenerStats>,
    )>,
    /// The KCP endpoint, when KCP is on.
    pub kcp: Option<Arc<waygate_transport::kcp::KcpStats>>,
}

impl Collector for ListenerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        type Read = fn(&waygate_transport::conn::ListenerStats) -> u64;
        let families: [(&str, &str, Read); 4] = [
            (
                "listener_handshake_failed",
                "Transport handshakes that failed or timed out (TLS, WebSocket upgrade, QUIC)",
                |s| s.handshake_failed.load(Relaxed),
            ),
            (
                "listener_bad_frames",
                "Connections closed because the peer sent an invalid frame",
                |s| s.bad_frames.load(Relaxed),
            ),
            (
                "listener_refused",
                "Connections a listener refused by admission control",
                |s| s.refused.load(Relaxed),
            ),
            (
                "listener_quic_retries",
                "QUIC connection attempts answered with a Retry (address validation under load)",
                |s| s.quic_retries.load(Relaxed),
            ),
        ];
        for (name, help, read) in families {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (kind, stats) in &self.listeners {
                let label = EdgeMetrics::transport(*kind);
                ConstCounter::new(read(stats)).encode(family.encode_family(&label)?)?;
            }
        }
        if let Some(k) = &self.kcp {
            let sessions =
                ConstGauge::new(i64::try_from(k.sessions.load(Relaxed)).unwrap_or(i64::MAX));
            sessions.encode(encoder.encode_descriptor(
                "kcp_sessions",
                "KCP sessions held by the endpoint",
                None,
                sessions.metric_type(),
            )?)?;
            for (name, help, value) in [
                (
                    "kcp_cookies_sent",
                    "KCP COOKIE replies sent",
                    &k.cookies_sent,
                ),
                (
                    "kcp_bad_macs",
                    "KCP CONNECTs with a cookie whose MAC failed",
                    &k.bad_macs,
                ),
                (
                    "kcp_expired_cookies",
                    "KCP CONNECTs with an expired cookie",
                    &k.expired_cookies,
                ),
                ("kcp_busy_sent", "KCP BUSY replies sent", &k.busy_sent),
                (
                    "kcp_rate_limited",
                    "KCP handshake packets over the reply rate",
                    &k.rate_limited,
                ),
                ("kcp_malformed", "Malformed KCP datagrams", &k.malformed),
                ("kcp_resets_sent", "KCP RESETs sent", &k.resets_sent),
                (
                    "kcp_panics",
                    "KCP sessions ended by a caught panic",
                    &k.panics,
                ),
                (
                    "kcp_oversized_datagrams",
                    "KCP datagrams longer than the listener's mtu, dropped unread",
                    &k.oversized_datagrams,
                ),
                (
                    "kcp_driver_restarts",
                    "Times the KCP listener's driver task panicked and was restarted",
                    &k.driver_restarts,
                ),
                (
                    "kcp_admission_refused",
                    "KCP HELLOs refused by admission control (answered BUSY, no cookie)",
                    &k.admission_refused,
                ),
                (
                    "kcp_sealed_sessions",
                    "KCP sessions opened sealed (a connect token in CONNECT)",
                    &k.sealed_sessions,
                ),
                (
                    "kcp_unauthenticated",
                    "Datagrams for sealed KCP sessions that did not authenticate (forged, altered, spoofed, unsealed RESET), dropped",
                    &k.unauthenticated,
                ),
                (
                    "kcp_replayed",
                    "Sealed KCP datagrams replayed or too old, dropped",
                    &k.replayed,
                ),
                (
                    "kcp_connect_refused",
                    "KCP CONNECTs refused for their connect token (invalid, or none where required)",
                    &k.connect_refused,
                ),
            ] {
                let c = ConstCounter::new(value.load(Relaxed));
                c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
            }
        }
        Ok(())
    }
}

impl EdgeMetrics {
    /// Adds the listeners' counters to the registry (see [`ListenerCollector`]).
    pub fn register_listeners(&mut self, collector: ListenerCollector) {
        self.registry.register_collector(Box::new(collector));
    }

    /// Creates and registers every metric; the session layer's counters are read from
    /// `sessions` once it is set.
    pub fn with_session_layer(sessions: SessionLayerSlot) -> Self {
        let mut m = Self::new();
        m.registry
            .register_collector(Box::new(SessionLayerCollector(sessions)));
        m
    }

    /// Creates and registers every metric of the edge itself.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("waygate");
        let pushed: Family<ClassLabel, Counter> = Family::default();
        let push_dropped: Family<ClassLabel, Counter> = Family::default();
        let push_counters = waygate_transport::TrafficClass::ALL.map(|class| {
            let label = ClassLabel {
                class: class.as_str().into(),
            };
            (
                pushed.get_or_create(&label).clone(),
                push_dropped.get_or_create(&label).clone(),
            )
        });
        let player_pushes: Family<OutcomeLabel, Counter> = Family::default();
        let player_push_outcomes = waygate_protocol::link::PlayerPushOutcome::ALL.map(|o| {
            player_pushes
                .get_or_create(&OutcomeLabel {
                    outcome: o.as_str().into(),
                })
                .clone()
        });
        let m = Self {
            player_pushes,
            player_push_outcomes,
            player_pushes_waiting: Gauge::default(),
            connections_accepted: Family::default(),
            connections_open: Family::default(),
            session_phase_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                ])
            }),
            session_setup_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                ])
            }),
            route_seconds: Histogram::new(exponential_buckets(0.000_001, 2.0, 16)),
            forwarded: Family::default(),
            upstream_refused: Family::default(),
            pushed,
            push_dropped,
            push_counters,
            forwarded_by_target: Mutex::new(HashMap::new()),
            pins_applied: Counter::default(),
            pins_refused: Counter::default(),
            pins_removed: Counter::default(),
            pinned_keys: Family::default(),
            binds_refused: Counter::default(),
            backend_up: Family::default(),
            link_forward_credits: Family::default(),
            route_epoch: Gauge::default(),
            route_staleness_seconds: Gauge::default(),
            stale_epoch_reroutes: Counter::default(),
            forwards_held: Counter::default(),
            ownership_sweeps: Family::default(),
            forwards_hold_expired: Counter::default(),
            forwards_withdrawn: Counter::default(),
            migrations: Counter::default(),
            draining: Gauge::default(),
            resume_key_mismatch: Gauge::default(),
            overload_level: Gauge::default(),
            event_loop_lag_seconds: Gauge::default(),
            admission_refused: Counter::default(),
            overload_shed: Counter::default(),
            accept_loop_restarts: Family::default(),
            backend_sessions: Family::default(),
            migrations_pending: Gauge::default(),
            route_bindings: Gauge::default(),
            route_keys_moved_ratio: Gauge::default(),
            channel_publishes: Family::default(),
            channel_deliveries: Family::default(),
            channel_joins: Family::default(),
            channel_delivery_seconds: Family::new_with_constructor(|| {
                Histogram::new([
                    0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0,
                ])
            }),
            channel_recovered: Counter::default(),
            channels_active: Gauge::default(),
            channels_awaiting_backends: Gauge::default(),
            channel_pending: Gauge::default(),
            announcements_held: Gauge::default(),
            channel_publish_ids: Gauge::default(),
            announcements_recovered: Counter::default(),
            announcement_withdrawals_failed: Counter::default(),
            channel_pending_by_class: Family::default(),
            channel_history_bytes: Gauge::default(),
            channel_pending_bytes: Gauge::default(),
            channel_history_evicted: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "connections_accepted",
            "Client connections that finished the transport handshake",
            m.connections_accepted.clone(),
        );
        registry.register(
            "connections_open",
            "Open client connections",
            m.connections_open.clone(),
        );
        registry.register(
            "session_phase_seconds",
            "Session setup by phase: transport handshake (TLS, upgrade, QUIC), waiting for HELLO, auth, restore, ownership claim",
            m.session_phase_seconds.clone(),
        );
        registry.register(
            "session_setup_seconds",
            "Time from transport accept to session established",
            m.session_setup_seconds.clone(),
        );
        registry.register(
            "route_seconds",
            "Time to route one upstream message: router lock and decision (service, then instance)",
            m.route_seconds.clone(),
        );
        registry.register(
            "forwarded",
            "Upstream messages forwarded to a backend",
            m.forwarded.clone(),
        );
        registry.register(
            "upstream_refused",
            "Upstream messages answered with an ERROR frame",
            m.upstream_refused.clone(),
        );
        registry.register(
            "pushed",
            "Downstream messages handed to sessions",
            m.pushed.clone(),
        );
        registry.register(
            "player_pushes",
            "Backends' pushes to a player wherever it is (PLAYER_PUSH, PROTOCOL.md §9.7), by outcome",
            m.player_pushes.clone(),
        );
        registry.register(
            "player_pushes_waiting",
            "Backends' pushes to players waiting to be sent to another edge (at most 4,096: busy beyond)",
            m.player_pushes_waiting.clone(),
        );
        registry.register(
            "push_dropped",
            "Downstream messages not queued (session gone, best-effort shed, or a full queue: the session then reports the gap)",
            m.push_dropped.clone(),
        );
        registry.register(
            "backend_up",
            "Backend links up (1) or down (0)",
            m.backend_up.clone(),
        );
        registry.register(
            "link_forward_credits",
            "FORWARD credit left on each backend link (0: new messages get busy)",
            m.link_forward_credits.clone(),
        );
        registry.register(
            "route_epoch",
            "Current route table epoch",
            m.route_epoch.clone(),
        );
        registry.register(
            "route_staleness_seconds",
            "Seconds since the route table was last loaded successfully",
            m.route_staleness_seconds.clone(),
        );
        registry.register(
            "pins_applied",
            "Backend PIN frames applied to the router (a key placed on an instance)",
            m.pins_applied.clone(),
        );
        registry.register(
            "pins_refused",
            "Backend PIN frames refused (instance not in the table for that key, or too many pins)",
            m.pins_refused.clone(),
        );
        registry.register(
            "pins_removed",
            "Backend pins removed: by UNPIN, or dropped because their instance left the route table",
            m.pins_removed.clone(),
        );
        registry.register(
            "pinned_keys",
            "Keys pinned by backends on this edge's router, by kind (PIN; at most 100,000 of each kind, refused beyond)",
            m.pinned_keys.clone(),
        );
        registry.register(
            "binds_refused",
            "Backend BIND frames refused (a service the route table does not have): the session's routing keys are bounded by the table's services",
            m.binds_refused.clone(),
        );
        registry.register(
            "stale_epoch_reroutes",
            "Messages re-routed after a stale-epoch refusal",
            m.stale_epoch_reroutes.clone(),
        );
        registry.register(
            "ownership_sweeps",
            "Ownership re-assert sweeps that went through, by reason (periodic, redis_back, missed_kicks)",
            m.ownership_sweeps.clone(),
        );
        registry.register(
            "forwards_held",
            "Client messages that waited in their session's held line: behind an unanswered older message to their service (route change, moved binding), or behind such a waiting message",
            m.forwards_held.clone(),
        );
        registry.register(
            "forwards_hold_expired",
            "Client messages refused busy after waiting 2 s for older messages of their session",
            m.forwards_hold_expired.clone(),
        );
        registry.register(
            "resume_key_mismatch",
            "1 when another edge seals resume keys with a secret this edge does not read, or does not read this edge's (cluster.redis_resume_key_file, redis_resume_key_accepted_file), or this edge has none while others seal: sessions do not resume between them. Checked every 10 s",
            m.resume_key_mismatch.clone(),
        );
        registry.register(
            "forwards_withdrawn",
            "Client messages of sessions moving to another edge (hard migration) not forwarded here: unacknowledged, their client resends them there",
            m.forwards_withdrawn.clone(),
        );
        registry.register(
            "migrations",
            "Players moved to another instance",
            m.migrations.clone(),
        );
        registry.register("draining", "1 while the edge drains", m.draining.clone());
        registry.register(
            "overload_level",
            "Overload level 0..=3",
            m.overload_level.clone(),
        );
        registry.register(
            "event_loop_lag_seconds",
            "How late the event loop runs a timer, sustained over a second",
            m.event_loop_lag_seconds.clone(),
        );
        registry.register(
            "admission_refused",
            "Connections refused by admission control",
            m.admission_refused.clone(),
        );
        registry.register(
            "backend_sessions",
            "Sessions of this edge opened on each backend instance",
            m.backend_sessions.clone(),
        );
        registry.register(
            "migrations_pending",
            "Binding moves queued and not yet carried out",
            m.migrations_pending.clone(),
        );
        registry.register(
            "route_bindings",
            "Keys bound to an instance on this edge's router (players with a session here, rooms, orders): rising without bound means bindings are not released",
            m.route_bindings.clone(),
        );
        registry.register(
            "route_keys_moved_ratio",
            "Share of bound keys the last route table change queued for a move",
            m.route_keys_moved_ratio.clone(),
        );
        registry.register(
            "accept_loop_restarts",
            "Accept loops restarted after a panic",
            m.accept_loop_restarts.clone(),
        );
        registry.register(
            "overload_shed",
            "Best-effort pushes shed under overload",
            m.overload_shed.clone(),
        );
        registry.register(
            "channel_publishes",
            "Channel publishes by kind, class and result (accepted, duplicate or the refusal)",
            m.channel_publishes.clone(),
        );
        registry.register(
            "channel_deliveries",
            "Channel events pushed to members by kind, class and result (delivered, offline, queue_full, shed)",
            m.channel_deliveries.clone(),
        );
        registry.register(
            "channel_joins",
            "Channel joins by kind and result (joined, recovered, history_lost, refusals)",
            m.channel_joins.clone(),
        );
        registry.register(
            "channel_delivery_seconds",
            "Time from a publish being taken to its push into every member's session queue",
            m.channel_delivery_seconds.clone(),
        );
        registry.register(
            "channel_recovered",
            "Publications recovered from channel history for joining members",
            m.channel_recovered.clone(),
        );
        registry.register(
            "channels_active",
            "Channels on this edge",
            m.channels_active.clone(),
        );
        registry.register(
            "channels_awaiting_backends",
            "New channels waiting for backends to acknowledge that this edge has them (nothing of them delivered meanwhile)",
            m.channels_awaiting_backends.clone(),
        );
        registry.register(
            "channel_pending",
            "Channel items waiting for their consumer",
            m.channel_pending.clone(),
        );
        registry.register(
            "announcements_held",
            "Announcements held until the announcement log has them",
            m.announcements_held.clone(),
        );
        registry.register(
            "channel_publish_ids",
            "Publish ids the channels remember for dedup (refusals at channels.dedup_max_ids)",
            m.channel_publish_ids.clone(),
        );
        registry.register(
            "announcements_recovered",
            "Announcements members received from the announcement log",
            m.announcements_recovered.clone(),
        );
        registry.register(
            "announcement_withdrawals_failed",
            "Refused announcements the log could not be told to withdraw (a member recovering from the log may receive them)",
            m.announcement_withdrawals_failed.clone(),
        );
        registry.register(
            "channel_pending_by_class",
            "Channel publications waiting for their consumer, by channel kind and class",
            m.channel_pending_by_class.clone(),
        );
        registry.register(
            "channel_history_bytes",
            "Bytes of publications kept for recovery over all channels (channels.history_budget_bytes)",
            m.channel_history_bytes.clone(),
        );
        registry.register(
            "channel_pending_bytes",
            "Bytes of publications waiting for their consumers over all channels (channels.pending_budget_bytes: queue_full)",
            m.channel_pending_bytes.clone(),
        );
        registry.register(
            "channel_history_evicted",
            "Kept publications forgotten early because the histories reached channels.history_budget_bytes",
            m.channel_history_evicted.clone(),
        );
        Self { registry, ..m }
    }

    /// The Prometheus/OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Drops the series of a backend address whose link was retired, and the `forwarded`
    /// series of its instances `ids` that left the table.
    pub fn forget_backend(&self, addr: std::net::SocketAddr, ids: &[String]) {
        let label = BackendLabel {
            backend: addr.to_string(),
        };
        self.backend_up.remove(&label);
        self.link_forward_credits.remove(&label);
        self.backend_sessions.remove(&label);
        let mut cache = self
            .forwarded_by_target
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        cache.retain(|(service, instance), _| {
            let gone = ids.iter().any(|id| **id == **instance);
            if gone {
                self.forwarded.remove(&RouteLabels {
                    service: service.to_string(),
                    instance: instance.to_string(),
                });
            }
            !gone
        });
    }

    /// The `forwarded` counter of a routed instance (a label is built once per instance).
    pub fn forwarded_to(&self, target: &waygate_routing::TargetInstance) -> Counter {
        let key = (target.service.clone(), target.instance_id.clone());
        let mut cache = self
            .forwarded_by_target
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| {
                self.forwarded
                    .get_or_create(&RouteLabels {
                        service: target.service.to_string(),
                        instance: target.instance_id.to_string(),
                    })
                    .clone()
            })
            .clone()
    }

    /// The channel series of every configured kind and class (at 0), for the same reason as
    /// [`preset`](Self::preset).
    pub fn preset_channels<'a>(&self, kinds: impl IntoIterator<Item = &'a str>) {
        for kind in kinds {
            for class in waygate_transport::TrafficClass::ALL {
                let labels = |result: &str| ChannelLabels {
                    kind: kind.to_owned(),
                    class: class.as_str().to_owned(),
                    result: result.to_owned(),
                };
                let _ = self.channel_publishes.get_or_create(&labels("accepted"));
                let _ = self.channel_deliveries.get_or_create(&labels("delivered"));
                let _ = self
                    .channel_delivery_seconds
                    .get_or_create(&ChannelClassLabels {
                        kind: kind.to_owned(),
                        class: class.as_str().to_owned(),
                    });
            }
        }
    }

    /// Creates the series a dashboard or an alert expects from the start (at 0), so the
    /// first increment is seen by `rate()`: per bound transport, per traffic class, per
    /// refusal code.
    pub fn preset(&self, transports: impl IntoIterator<Item = waygate_transport::TransportKind>) {
        for kind in transports {
            let label = Self::transport(kind);
            let _ = self.connections_accepted.get_or_create(&label);
            let _ = self.connections_open.get_or_create(&label);
            let _ = self.accept_loop_restarts.get_or_create(&label);
        }
        for class in [
            waygate_transport::TrafficClass::Critical,
            waygate_transport::TrafficClass::Normal,
            waygate_transport::TrafficClass::BestEffort,
        ] {
            let label = ClassLabel {
                class: class.as_str().into(),
            };
            let _ = self.pushed.get_or_create(&label);
            let _ = self.push_dropped.get_or_create(&label);
        }
        for code in [
            waygate_transport::CloseCode::Busy,
            waygate_transport::CloseCode::Unavailable,
            waygate_transport::CloseCode::NoRoute,
            waygate_transport::CloseCode::Internal,
        ] {
            let label = CodeLabel {
                code: code.as_str().into(),
            };
            let _ = self.upstream_refused.get_or_create(&label);
        }
    }

    /// Label helper.
    pub fn transport(kind: waygate_transport::TransportKind) -> TransportLabel {
        TransportLabel {
            transport: kind.as_str().to_string(),
        }
    }
}

/// The same exposition in the Prometheus text format 0.0.4, for scrapers and tools that do
/// not ask for OpenMetrics (`promtool check metrics`, `curl`): a counter family is named with
/// its `_total` suffix in `# HELP` and `# TYPE` (OpenMetrics names the family without it),
/// `# UNIT` and `# EOF` go, `unknown` becomes `untyped`. Samples are unchanged.
pub fn openmetrics_to_prometheus_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.insert(name.to_owned());
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len() + 16 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                let tail = if prefix == "# TYPE " && tail == "unknown" {
                    "untyped"
                } else {
                    tail
                };
                out.push_str(prefix);
                out.push_str(name);
                out.push_str(suffix);
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_names_counters_with_total_and_drops_openmetrics_only_lines() {
        let om = "# HELP a_requests Requests.\n# TYPE a_requests counter\n\
                  a_requests_total{x=\"1\"} 3\n# HELP b_live Live.\n# TYPE b_live gauge\n\
                  # UNIT b_live seconds\nb_live 2\n# TYPE c unknown\nc 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus_text(om),
            "# HELP a_requests_total Requests.\n# TYPE a_requests_total counter\n\
             a_requests_total{x=\"1\"} 3\n# HELP b_live Live.\n# TYPE b_live gauge\n\
             b_live 2\n# TYPE c untyped\nc 1\n"
        );
    }

    #[test]
    fn an_edge_registry_translates_with_one_type_line_per_family() {
        let m = EdgeMetrics::new();
        m.migrations.inc();
        let text = openmetrics_to_prometheus_text(&m.encode());
        assert!(
            text.contains("# TYPE waygate_migrations_total counter\nwaygate_migrations_total 1\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF"));
        let types = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!(types, helps);
    }
}
