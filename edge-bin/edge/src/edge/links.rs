//! One `LinkClient` per backend address, opened for every instance of the current table.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use super::Shared;
use crate::link::{LinkClient, LinkConfig};

impl Shared {
    /// Records the instances of the current table and opens a link to every backend
    /// address (an edge keeps one link per backend, up before the first message).
    pub(super) fn learn_instances(&self) {
        let table = match self.router.lock() {
            Ok(router) => router.table().cloned(),
            Err(_) => None,
        };
        let Some(table) = table else { return };
        let mut addrs = Vec::new();
        if let Ok(mut map) = self.instance_addrs.lock() {
            for service in &table.services {
                for i in &service.instances {
                    if let Ok(addr) = i.address.parse::<SocketAddr>() {
                        map.insert(i.id.clone(), addr);
                        addrs.push(addr);
                    }
                }
            }
        }
        for addr in addrs {
            self.link(addr);
        }
    }

    pub(super) fn link(&self, addr: SocketAddr) -> LinkClient {
        let mut links = match self.links.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        links
            .entry(addr)
            .or_insert_with(|| {
                let config = LinkConfig {
                    edge_id: self.config.edge_id.clone(),
                    push_credits: self.config.links.push_credits,
                    heartbeat: Duration::from_millis(self.config.links.heartbeat_ms),
                    busy_retry_after_ms: self.config.links.busy_retry_after_ms,
                    secret: self.link_secret.clone(),
                    tls: self.link_tls.clone(),
                    ..LinkConfig::default()
                };
                let (client, _task) =
                    LinkClient::spawn(addr, config, self.epoch.clone(), self.link_events.clone());
                client
            })
            .clone()
    }

    /// Retires the links to backend addresses the route table no longer names once nothing
    /// here uses them: no session opened on them and no binding to an instance at that
    /// address. Their task ends and their metric series go. Before, every address a table
    /// ever named kept its link for good (a task reconnecting to a gone backend, with its
    /// series), so an edge in front of autoscaled backends grew with every instance ever
    /// started.
    pub(super) fn retire_unused_links(&self) {
        let instances: Vec<(String, SocketAddr)> = match self.instance_addrs.lock() {
            Ok(m) => m.iter().map(|(id, a)| (id.clone(), *a)).collect(),
            Err(_) => return,
        };
        let mut kept: HashSet<SocketAddr> = HashSet::new();
        let mut table_ids: HashSet<String> = HashSet::new();
        {
            let Ok(router) = self.router.lock() else {
                return;
            };
            let Some(table) = router.table() else { return };
            for service in &table.services {
                for i in &service.instances {
                    table_ids.insert(i.id.clone());
                    if let Ok(addr) = i.address.parse::<SocketAddr>() {
                        kept.insert(addr);
                    }
                }
            }
            for (id, addr) in &instances {
                if router.bindings().count_on(id) > 0 {
                    kept.insert(*addr);
                }
            }
        }
        let candidates: Vec<SocketAddr> = match self.links.lock() {
            Ok(l) => l.keys().filter(|a| !kept.contains(a)).copied().collect(),
            Err(_) => return,
        };
        if candidates.is_empty() {
            return;
        }
        let unused: Vec<SocketAddr> = match self.entries.lock() {
            Ok(e) => candidates
                .into_iter()
                .filter(|a| e.sessions_on_link(a) == 0)
                .collect(),
            Err(_) => return,
        };
        let retired: Vec<_> = match self.links.lock() {
            Ok(mut l) => unused.iter().filter_map(|a| l.remove(a)).collect(),
            Err(_) => return,
        };
        let gone: HashSet<SocketAddr> = retired.iter().map(|c| c.addr()).collect();
        let mut gone_ids = Vec::new();
        if let Ok(mut m) = self.instance_addrs.lock() {
            m.retain(|id, a| {
                let drop = gone.contains(a) && !table_ids.contains(id);
                if drop {
                    gone_ids.push(id.clone());
                }
                !drop
            });
        }
        for link in retired {
            tracing::info!(addr = %link.addr(), "backend left the route table and is unused: link retired");
            link.retire();
            self.metrics.forget_backend(link.addr(), &gone_ids);
        }
    }
}
