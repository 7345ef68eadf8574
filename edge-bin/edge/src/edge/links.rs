//! One `LinkClient` per backend address, opened for every instance of the current table.

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
}
