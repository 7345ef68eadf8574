//! Starts the client listeners an [`EdgeConfig`] enables, with the TLS identity from files
//! or a generated development CA (T6). Every listener is a `BoxListener`: nothing after this
//! point knows which transport a connection came from.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use waygate_transport::tls::TlsIdentity;
use waygate_transport::{kcp, quic, tcp, ws, BoxListener, TransportError, TransportKind};

use crate::config::EdgeConfig;

/// The bound listeners and what clients need to reach them.
pub struct BoundListeners {
    /// One per enabled transport.
    pub listeners: Vec<BoxListener>,
    /// Bound address per transport (port 0 in the config becomes the real port here).
    pub addrs: BTreeMap<TransportKind, SocketAddr>,
    /// The TLS identity in use (its `dev_ca_pem` is set when it was generated).
    pub tls: TlsIdentity,
    /// Counters of every listener (handshakes failed, bad frames, refusals), for metrics.
    pub stats: Vec<(
        TransportKind,
        std::sync::Arc<waygate_transport::conn::ListenerStats>,
    )>,
    /// The KCP endpoint's counters (cookies, bad MACs, BUSY, RESETs...), when KCP is on.
    pub kcp_stats: Option<std::sync::Arc<waygate_transport::kcp::KcpStats>>,
}

impl std::fmt::Debug for BoundListeners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundListeners")
            .field("addrs", &self.addrs)
            .finish()
    }
}

/// Loads or generates the TLS identity and writes the dev CA where configured.
pub fn tls_identity(config: &EdgeConfig) -> Result<TlsIdentity, TransportError> {
    let id = match (&config.tls.cert, &config.tls.key) {
        (Some(cert), Some(key)) => TlsIdentity::from_pem_files(cert, key)?,
        _ => TlsIdentity::generate_dev(&config.tls.dev_names)?,
    };
    if let (Some(path), Some(pem)) = (&config.tls.dev_ca_out, &id.dev_ca_pem) {
        std::fs::write(path, pem).map_err(|e| {
            TransportError::Config(format!("writing dev CA to {}: {e}", path.display()))
        })?;
    }
    Ok(id)
}

/// Binds every enabled listener; each asks `admission` (if any) before any handshake work;
/// KCP opens connect tokens with `connect_keys` (sealed sessions).
pub async fn bind_all(
    config: &EdgeConfig,
    admission: Option<std::sync::Arc<dyn waygate_transport::listener::AdmissionGate>>,
    connect_keys: Option<std::sync::Arc<dyn waygate_transport::kcp::seal::ConnectKeys>>,
) -> Result<BoundListeners, TransportError> {
    let tls = tls_identity(config)?;
    let mut conn = config.conn_config();
    conn.admission = admission;
    conn.connect_keys = connect_keys;
    let l = &config.listeners;
    let mut listeners: Vec<BoxListener> = Vec::new();
    let mut stats = Vec::new();
    let mut kcp_stats = None;
    let mut add = |l: waygate_transport::TransportListener, listeners: &mut Vec<BoxListener>| {
        stats.push((waygate_transport::Listener::kind(&l), l.stats()));
        listeners.push(Box::new(l));
    };
    if l.tcp.enabled {
        add(
            tcp::listen(l.tcp.addr, None, conn.clone()).await?,
            &mut listeners,
        );
    }
    if l.tls.enabled {
        add(
            tcp::listen(l.tls.addr, Some(&tls), conn.clone()).await?,
            &mut listeners,
        );
    }
    if l.ws.enabled {
        add(
            ws::listen(l.ws.addr, None, conn.clone()).await?,
            &mut listeners,
        );
    }
    if l.wss.enabled {
        add(
            ws::listen(l.wss.addr, Some(&tls), conn.clone()).await?,
            &mut listeners,
        );
    }
    if l.quic.enabled {
        let q = quic::listen(l.quic.addr, &tls, &config.quic, conn.clone())?;
        add(q, &mut listeners);
    }
    if l.kcp.enabled {
        let k = kcp::listen(l.kcp.addr, &config.kcp, conn.clone()).await?;
        kcp_stats = Some(k.stats());
        listeners.push(Box::new(k));
    }
    let addrs = listeners
        .iter()
        .map(|l| (l.kind(), l.local_addr()))
        .collect();
    Ok(BoundListeners {
        listeners,
        addrs,
        tls,
        stats,
        kcp_stats,
    })
}
