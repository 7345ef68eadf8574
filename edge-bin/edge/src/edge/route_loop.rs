//! The route loop: applies new tables from the source, heartbeats the router's health
//! tracker from link state, and carries out migrations (SESSION_CLOSE to the old instance).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use waygate_transport::CloseCode;

use super::{now_std, SessionEntry, Shared};

pub(super) fn apply_latest(shared: &Shared) {
    let Some(source) = &shared.source else { return };
    let update = source.watch().borrow().clone();
    let Some(table) = update.table else { return };
    let applied = match shared.router.lock() {
        Ok(mut router) => {
            if router.epoch().is_some_and(|e| table.epoch <= e) {
                return;
            }
            router.apply_table((*table).clone(), now_std())
        }
        Err(_) => return,
    };
    match applied {
        Ok(report) => {
            shared.epoch.store(table.epoch, Ordering::Release);
            shared.metrics.route_epoch.set(table.epoch as i64);
            shared.learn_instances();
            let bound = shared
                .router
                .lock()
                .map(|r| r.bindings().len())
                .unwrap_or(0);
            let moved = report.queued_migrations as f64 / bound.max(1) as f64;
            shared.metrics.route_keys_moved_ratio.set(moved.min(1.0));
            shared
                .metrics
                .pins_removed
                .inc_by(report.pins_dropped as u64);
            tracing::info!(epoch = table.epoch, ?report, "route table applied");
        }
        Err(e) => tracing::warn!(error = %e, "route table refused"),
    }
}

pub(super) async fn route_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut ticks = 0u64;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = shared
        .upgrade()
        .and_then(|s| s.source.as_ref().map(|src| src.watch()));
    loop {
        match watch.as_mut() {
            Some(w) => {
                tokio::select! {
                    _ = tick.tick() => {}
                    changed = w.changed() => if changed.is_err() { watch = None; },
                }
            }
            None => {
                tick.tick().await;
            }
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        apply_latest(&shared);
        if let Some(source) = &shared.source {
            let staleness = source
                .status()
                .staleness(now_std())
                .map_or(f64::INFINITY, |d| d.as_secs_f64());
            shared.metrics.route_staleness_seconds.set(staleness);
        }
        ticks += 1;
        if ticks % 10 == 1 {
            shared.retire_unused_links();
            shared.publish_backend_sessions();
        }
        // Link credits (B4) as the operator sees them.
        if let Ok(links) = shared.links.lock() {
            for link in links.values() {
                let label = crate::metrics::BackendLabel {
                    backend: link.addr().to_string(),
                };
                let credit = i64::try_from(link.credit()).unwrap_or(i64::MAX);
                shared
                    .metrics
                    .link_forward_credits
                    .get_or_create(&label)
                    .set(credit);
            }
        }
        // Health: an instance whose link is up is alive; the router declares the others
        // down after K missed heartbeats and migrates their players (R7).
        let up: Vec<SocketAddr> = shared
            .links
            .lock()
            .map(|l| l.values().filter(|c| c.is_up()).map(|c| c.addr()).collect())
            .unwrap_or_default();
        let alive: Vec<String> = shared
            .instance_addrs
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, a)| {
                        up.contains(a)
                            || !shared
                                .links
                                .lock()
                                .map(|l| l.contains_key(a))
                                .unwrap_or(false)
                    })
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default();
        let mut moved = Vec::new();
        if let Ok(mut router) = shared.router.lock() {
            let now = now_std();
            for id in &alive {
                router.heartbeat(id, now);
            }
            router.tick(now);
            while let Some(m) = router.poll_migration(now) {
                moved.push(m);
            }
        }
        for m in moved {
            shared.metrics.migrations.inc();
            tracing::info!(key = %m.key, from = %m.from, to = ?m.to, "binding migrated");
            let from_addr = shared
                .instance_addrs
                .lock()
                .ok()
                .and_then(|a| a.get(&m.from).copied());
            let entries: Vec<SessionEntry> = shared
                .entries
                .lock()
                .map(|e| {
                    e.by_id
                        .values()
                        .filter(|en| {
                            en.meta.player_id == m.key || en.keys.values().any(|k| k == &m.key)
                        })
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            if let Some(from) = from_addr {
                for entry in entries {
                    // Forgotten first, then closed: a forward routed there before the move
                    // that opens the session again after the close records the link again
                    // (`route_and_forward`), so the session's end closes it there.
                    if let Ok(mut e) = shared.entries.lock() {
                        e.remove_link(&entry.meta.session_id, from);
                    }
                    shared
                        .close_on_links(&entry, CloseCode::GoingAway, Some(from))
                        .await;
                }
            }
        }
    }
}

impl Shared {
    /// Gauges of the route plane (O1), once a second: sessions per backend instance (counted
    /// by the session table as sessions open and close on links), binding moves in flight,
    /// bound and pinned keys.
    fn publish_backend_sessions(&self) {
        let known: Vec<SocketAddr> = self
            .links
            .lock()
            .map(|l| l.keys().copied().collect())
            .unwrap_or_default();
        let counts: Vec<i64> = self.entries.lock().map_or_else(
            |_| vec![0; known.len()],
            |e| known.iter().map(|a| e.sessions_on_link(a)).collect(),
        );
        for (addr, n) in known.iter().zip(counts) {
            let label = crate::metrics::BackendLabel {
                backend: addr.to_string(),
            };
            self.metrics.backend_sessions.get_or_create(&label).set(n);
        }
        if let Ok(router) = self.router.lock() {
            let pending = i64::try_from(router.pending_migrations()).unwrap_or(i64::MAX);
            self.metrics.migrations_pending.set(pending);
            let bound = i64::try_from(router.bindings().len()).unwrap_or(i64::MAX);
            self.metrics.route_bindings.set(bound);
            let (players, rooms) = router.pinned();
            for (kind, n) in [("player", players), ("room", rooms)] {
                self.metrics
                    .pinned_keys
                    .get_or_create(&crate::metrics::PinKindLabel { kind: kind.into() })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}
