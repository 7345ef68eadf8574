//! Many edges: the etcd registration and load feed, kicks from other edges over Redis,
//! cross-edge pushes, and the ownership/presence re-assert sweep.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use waygate_protocol::frame::SessionId;
use waygate_session::host::SupersededKick;
use waygate_session::resume::hex_id;
use waygate_transport::TransportKind;

use super::Shared;
use crate::cluster::etcd::{EdgeInfo, Load};
use crate::cluster::redis::{DeliveryResult, PushDelivery, PushMessage, Reassert};

/// How often an edge announces its resume-key secrets in Redis and compares them with the
/// other edges' (an announcement older than three of these is of an edge gone).
const RESUME_KEY_CHECK: Duration = Duration::from_secs(10);

impl Shared {
    /// The address clients use to reach this edge (etcd registration, MIGRATE target).
    pub(super) fn advertise(&self) -> String {
        if !self.config.cluster.advertise.is_empty() {
            return self.config.cluster.advertise.clone();
        }
        self.addrs
            .get(&TransportKind::Tcp)
            .or_else(|| self.addrs.values().next())
            .map(|a| {
                let kind = self
                    .addrs
                    .iter()
                    .find(|(_, x)| *x == a)
                    .map_or("tcp", |(k, _)| k.as_str());
                format!("{kind}://{a}")
            })
            .unwrap_or_default()
    }

    /// Where a drained edge sends its clients: the configured target, else the least-loaded
    /// other active edge registered in etcd.
    pub(super) fn drain_target(&self) -> String {
        if !self.config.drain.target.is_empty() {
            return self.config.drain.target.clone();
        }
        let Some(etcd) = &self.etcd else {
            return String::new();
        };
        let others: Vec<EdgeInfo> = etcd
            .edges()
            .into_iter()
            .filter(|e| e.id != self.config.edge_id)
            .collect();
        crate::cluster::etcd::pick_least_loaded(&others)
            .map(|e| e.address.clone())
            .unwrap_or_default()
    }
}

/// Starts the etcd registration and load feed and the Redis tasks (kicks from other edges,
/// cross-edge pushes, the ownership/presence re-assert sweep). Returns their handles.
pub(super) async fn start_cluster_tasks(shared: &Arc<Shared>) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let c = &shared.config.cluster;
    let edge_id = shared.config.edge_id.clone();
    if let Some(etcd) = &shared.etcd {
        // Load reports of backend instances -> the router's least-loaded policy (R10).
        let mut loads = etcd.loads();
        let weak = Arc::downgrade(shared);
        tasks.push(tokio::spawn(async move {
            loop {
                {
                    let Some(shared) = weak.upgrade() else { return };
                    let map = loads.borrow_and_update().clone();
                    let locked = shared.router.lock();
                    if let Ok(mut router) = locked {
                        for (id, l) in map.iter() {
                            router.report_load(
                                id,
                                waygate_routing::LoadReport { players: l.players },
                            );
                        }
                    };
                }
                if loads.changed().await.is_err() {
                    return;
                }
            }
        }));
    }
    if let Some(reg) = &shared.etcd_registry {
        let info = EdgeInfo {
            id: edge_id.clone(),
            address: shared.advertise(),
            state: waygate_routing::InstanceState::Active,
            capacity: None,
            sessions: 0,
            msg_rate: 0.0,
        };
        let every = Duration::from_millis(c.report_ms);
        match reg
            .register_edge(&info, Duration::from_millis(c.lease_ttl_ms))
            .await
        {
            Ok(lease) => {
                let (load_tx, load_rx) = tokio::sync::watch::channel(Load::default());
                tasks.push(reg.spawn_reporter(lease, every, load_rx));
                let weak = Arc::downgrade(shared);
                tasks.push(crate::cluster::spawn_load_meter(
                    every,
                    load_tx,
                    move || {
                        let shared = weak.upgrade()?;
                        let layer = shared.session_layer();
                        Some((layer.registry.len(), layer.counters.messages()))
                    },
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "edge not registered in etcd (logins will not pick it)")
            }
        }
    }
    let Some(redis) = shared.redis.clone() else {
        return tasks;
    };
    // Do the edges read each other's sealed resume keys? Announced and compared every
    // `RESUME_KEY_CHECK` (every 2 s until Redis answers); a mismatch is an error in the log
    // (once per change) and `waygate_resume_key_mismatch`, which falls back to 0 once the
    // edges agree again (a rotation's steps rolled out).
    let (stores, weak) = (redis.clone(), Arc::downgrade(shared));
    let edge = edge_id.clone();
    tasks.push(tokio::spawn(async move {
        use crate::cluster::redis::ResumeKeyCheck;
        let mut last = None;
        loop {
            let found = match stores.check_resume_key(&edge, RESUME_KEY_CHECK * 3).await {
                Ok(found) => found,
                Err(e) => {
                    tracing::debug!(error = %e, "resume-key secrets not compared yet");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    continue;
                }
            };
            let Some(shared) = weak.upgrade() else { return };
            let mismatch = !matches!(found, ResumeKeyCheck::Agreed | ResumeKeyCheck::NoSecret);
            if last != Some(found) {
                match found {
                    ResumeKeyCheck::Differs => tracing::error!(
                        "another edge seals resume keys with a secret this edge does not read, \
                         or does not read this edge's (cluster.redis_resume_key_file and \
                         redis_resume_key_accepted_file): sessions do not resume between them"
                    ),
                    ResumeKeyCheck::SealedElsewhere => tracing::error!(
                        "the other edges seal resume keys (cluster.redis_resume_key_file) and \
                         this one has no secret: their sessions do not resume here"
                    ),
                    _ if last.is_some() => {
                        tracing::info!("the edges read each other's resume keys again")
                    }
                    _ => {}
                }
                last = Some(found);
            }
            shared.metrics.resume_key_mismatch.set(i64::from(mismatch));
            drop(shared);
            tokio::time::sleep(RESUME_KEY_CHECK).await;
        }
    }));
    // Takeovers on other edges kick our (older) sessions.
    let kick_subscription = redis.ownership.kick_subscription(&edge_id);
    let (mut kicks, missed) = (kick_subscription.notices, kick_subscription.missed);
    let weak = Arc::downgrade(shared);
    tasks.push(tokio::spawn(async move {
        while let Some(k) = kicks.recv().await {
            let Some(shared) = weak.upgrade() else { return };
            // Only the copy taken over (or an older one): a copy claimed here again since
            // the notice was sent stays (the session host holds its fencing token).
            let outcome = shared
                .session_layer()
                .registry
                .kick_superseded(&k.session_id, k.fencing);
            if outcome == SupersededKick::Kicked {
                tracing::debug!(session = %hex_id(&k.session_id), fencing = k.fencing, "taken over on another edge; kicked");
            }
        }
    }));
    // Pushes from other edges (F4).
    let weak = Arc::downgrade(shared);
    let server = redis
        .presence
        .serve_pushes(&edge_id, move |player: &str, m: PushMessage| {
            weak.upgrade()
                .and_then(|s| s.deliver_push_here(player, m.id, m.into()))
                // No session here: offline on this edge.
                .map_or(PushDelivery::Now(DeliveryResult::Offline), |d| {
                    d.map(DeliveryResult::from)
                })
        });
    tasks.push(tokio::spawn(async move {
        let _server = server;
        std::future::pending::<()>().await;
    }));
    // Re-assert ownership and presence every `reassert_ms`, and at once after Redis was
    // unreachable (it may have lost records; kicks published meanwhile were missed). Kick
    // notices can also be missed with Redis up: published while the subscription was
    // being made again, or dropped when its queue was full (`KickSubscription::missed`
    // rises). That makes the next sweep due within a second (at most one such sweep per
    // `MISSED_KICK_SWEEP_GAP`), so a copy taken over elsewhere ends then, not up to
    // `reassert_ms` later.
    const MISSED_KICK_SWEEP_GAP: Duration = Duration::from_secs(5);
    let weak = Arc::downgrade(shared);
    let every = Duration::from_millis(c.reassert_ms);
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sweep = Instant::now();
        let mut was_down = false;
        let mut missed_kicks = MissedKicks::default();
        loop {
            tick.tick().await;
            let Some(shared) = weak.upgrade() else { return };
            missed_kicks.observe(*missed.borrow());
            let probe = redis.presence.lookup(&edge_id).await;
            if probe.is_err() {
                if !was_down {
                    tracing::warn!("redis unreachable; ownership re-assert after it recovers");
                }
                was_down = true;
                continue;
            }
            let missed = missed_kicks.pending && last_sweep.elapsed() >= MISSED_KICK_SWEEP_GAP;
            if !was_down && !missed && last_sweep.elapsed() < every {
                continue;
            }
            let reason = if was_down {
                "redis_back"
            } else if missed {
                "missed_kicks"
            } else {
                "periodic"
            };
            if missed {
                tracing::info!("kick notices may have been missed; ownership re-assert now");
            }
            let live = shared.owned_sessions();
            let mut superseded = 0usize;
            let mut ok = true;
            for (player, sid, fencing) in &live {
                match redis
                    .ownership
                    .reassert(player, sid, &edge_id, *fencing)
                    .await
                {
                    Ok(Reassert::Owner) => {}
                    Ok(Reassert::Superseded(_)) => {
                        // `fencing` is what this sweep read, maybe seconds ago: a copy
                        // claimed here again since then is newer and stays.
                        let outcome = shared
                            .session_layer()
                            .registry
                            .kick_superseded(sid, *fencing);
                        if outcome == SupersededKick::Kicked {
                            tracing::info!(%player, session = %hex_id(sid), "ownership re-assert: superseded; kicked");
                            superseded += 1;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "re-assert failed");
                        ok = false;
                        break;
                    }
                }
            }
            let entries: Vec<(String, SessionId)> =
                live.into_iter().map(|(p, s, _)| (p, s)).collect();
            if ok && redis.presence.set_many(&edge_id, &entries).await.is_ok() {
                if was_down {
                    tracing::info!(
                        sessions = entries.len(),
                        superseded,
                        "redis back; ownership re-asserted"
                    );
                }
                was_down = false;
                // Owed until a sweep went through (a failed one is retried within seconds).
                missed_kicks.pending = false;
                last_sweep = Instant::now();
                shared
                    .metrics
                    .ownership_sweeps
                    .get_or_create(&crate::metrics::SweepLabel {
                        reason: reason.into(),
                    })
                    .inc();
            }
        }
    }));
    tasks
}

/// Whether a sweep is owed because kick notices may have been missed
/// (`KickSubscription::missed` rose since it was last looked at).
#[derive(Debug, Default)]
struct MissedKicks {
    /// The count as last seen.
    seen: u64,
    /// A sweep is owed (cleared once one went through).
    pending: bool,
}

impl MissedKicks {
    /// The subscription's missed count now.
    fn observe(&mut self, missed: u64) {
        if missed > self.seen {
            self.pending = true;
        }
        self.seen = missed;
    }
}

#[cfg(test)]
mod tests {
    use super::MissedKicks;

    #[test]
    fn a_rise_of_the_missed_count_owes_a_sweep() {
        let mut m = MissedKicks::default();
        m.observe(0);
        assert!(!m.pending, "nothing missed");
        m.observe(2);
        assert!(m.pending, "notices may have been missed");
        m.pending = false;
        m.observe(2);
        assert!(!m.pending, "the same count owes nothing more");
    }
}
