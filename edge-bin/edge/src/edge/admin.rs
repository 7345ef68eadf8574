//! The admin API (`crate::admin::AdminApi`) over a running edge.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use waygate_transport::CloseCode;

use super::{now_std, Shared};
use crate::admin::AdminApi;

/// The admin API over a running edge.
pub(super) struct EdgeAdmin(pub(super) Arc<Shared>);

#[async_trait]
impl AdminApi for EdgeAdmin {
    fn health(&self) -> Value {
        let s = &self.0;
        json!({
            "status": "ok",
            "edge_id": s.config.edge_id,
            "uptime_secs": s.started.elapsed().as_secs(),
            "sessions": s.session_layer().registry.len(),
            "draining": s.draining.load(Ordering::Acquire),
            "route_epoch": s.epoch.load(Ordering::Relaxed),
            "overload_level": s.governor.level.load(Ordering::Acquire),
            "event_loop_lag_ms": s.governor.last_loop_lag_ms(),
            "session_cap": s.governor.session_cap,
            "listeners": s.addrs.iter().map(|(k, a)| (k.as_str().to_string(), a.to_string())).collect::<BTreeMap<_, _>>(),
        })
    }

    fn ready(&self) -> Result<(), String> {
        if self.0.draining.load(Ordering::Acquire) {
            return Err("draining".into());
        }
        match self.0.router.lock() {
            Ok(r) if r.epoch().is_some() => Ok(()),
            _ => Err("no route table".into()),
        }
    }

    fn metrics_text(&self) -> String {
        let s = &self.0;
        s.metrics
            .draining
            .set(i64::from(s.draining.load(Ordering::Acquire)));
        s.metrics.encode()
    }

    fn routes(&self) -> Value {
        let s = &self.0;
        let table = s.router.lock().ok().and_then(|r| {
            r.table()
                .map(|t| serde_json::to_value(t.as_ref()).unwrap_or(Value::Null))
        });
        let staleness = s
            .source
            .as_ref()
            .and_then(|src| src.status().staleness(now_std()))
            .map(|d| d.as_secs_f64());
        json!({
            "epoch": s.epoch.load(Ordering::Relaxed),
            "source": s.source_kind,
            "staleness_secs": staleness,
            "table": table,
        })
    }

    async fn session(&self, player: &str) -> Option<Value> {
        let s = &self.0;
        let sid = s.session_layer().registry.session_of(player)?;
        let entry = s
            .entries
            .lock()
            .ok()
            .and_then(|e| e.by_id.get(&sid).cloned());
        Some(json!({
            "player_id": player,
            "session_id": waygate_session::resume::hex_id(&sid),
            "handle": entry.as_ref().map(|e| e.meta.handle),
            "fencing": entry.as_ref().map(|e| e.meta.fencing),
            "keys": entry.as_ref().map(|e| (*e.keys).clone()),
            "backends": entry.as_ref().map(|e| e.links.iter().map(|a| a.to_string()).collect::<Vec<_>>()),
        }))
    }

    async fn drain(&self) -> Value {
        let s = &self.0;
        let already = s.draining.swap(true, Ordering::AcqRel);
        let deadline = Duration::from_millis(s.config.drain.deadline_ms);
        let mut migrated = 0usize;
        let mut target = s.config.drain.target.clone();
        if !already {
            // No new players from etcd's least-loaded pick any more.
            if let Some(reg) = &s.etcd_registry {
                if let Err(e) = reg.shutdown().await {
                    tracing::warn!(error = %e, "etcd registration not revoked");
                }
            }
            target = s.drain_target();
            let ids = s.session_layer().registry.session_ids();
            migrated = s.migrate_away(&ids, &target, deadline).await;
            tracing::warn!(migrated, "drain started");
        }
        json!({
            "draining": true,
            "already_draining": already,
            "migrated": migrated,
            "target": target,
            "sessions": s.session_layer().registry.len(),
            "deadline_ms": s.config.drain.deadline_ms,
        })
    }

    async fn drop_link(&self, player: &str) -> bool {
        let registry = &self.0.session_layer().registry;
        match registry.session_of(player) {
            Some(sid) => registry.drop_link(&sid),
            None => false,
        }
    }

    async fn kick(&self, player: &str) -> bool {
        let registry = &self.0.session_layer().registry;
        match registry.session_of(player) {
            Some(sid) => registry.close(&sid, CloseCode::Kicked),
            None => false,
        }
    }

    async fn ban(&self, player: &str, for_secs: Option<u64>) -> bool {
        let now = (self.0.session_layer().unix_now)();
        let until = for_secs.map(|s| now.saturating_add(s));
        self.0.revocations.revoke(player, until, now);
        tracing::info!(%player, ?for_secs, "player banned on this edge");
        let registry = &self.0.session_layer().registry;
        match registry.session_of(player) {
            Some(sid) => registry.close(&sid, CloseCode::AuthRejected),
            None => false,
        }
    }

    fn unban(&self, player: &str) -> bool {
        self.0.revocations.lift(player)
    }
}

/// Times a drain offers MIGRATE to a session before giving up on it (100 ms apart).
const MIGRATE_ATTEMPTS: usize = 5;

impl Shared {
    /// Moves `ids` to `target` for a drain; returns how many were told. With Redis, a hard
    /// migration (S8): hold upstream, let replies in flight land here and be written
    /// through, then MIGRATE (its rotated token is written first), so the client restores
    /// on the target from the warm tier with nothing lost.
    pub(super) async fn migrate_away(
        &self,
        ids: &[waygate_protocol::frame::SessionId],
        target: &str,
        deadline: Duration,
    ) -> usize {
        let registry = self.session_layer().registry.clone();
        if self.redis.is_some() {
            for sid in ids {
                // Quiesced (the command reached the session's mailbox), nothing of it is
                // forwarded here any more: what waits in its held line (§9.5) is
                // withdrawn, neither sent nor answered (the client resends its sequenced
                // messages after the move; best-effort ones may be lost, §3.9), so each
                // reaches its backend once, from the next edge.
                if !registry.quiesce(sid) {
                    continue;
                }
                let withdrawn = match self.entries.lock() {
                    Ok(mut e) => e.start_moving(sid),
                    Err(_) => Vec::new(),
                };
                let resent = withdrawn.iter().filter(|m| m.seq != 0).count();
                self.metrics.forwards_withdrawn.inc_by(resent as u64);
            }
            tokio::time::sleep(Duration::from_millis(self.config.cluster.quiesce_ms)).await;
        }
        // A session whose mailbox is full (or that ended) is not told at once: tried again
        // a few times, so a quiesced session is not left on this edge, its withdrawn
        // messages unanswered, until the drain's deadline.
        let mut left: Vec<_> = ids.to_vec();
        for attempt in 0..MIGRATE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            left.retain(|sid| !registry.migrate(sid, target, deadline));
            if left.is_empty() {
                break;
            }
        }
        ids.len() - left.len()
    }
}
