//! Client endpoints as URLs — `tcp://host:port`, `tls://`, `ws://host:port/path`, `wss://`,
//! `quic://`, `kcp://` — and one `connect` for all of them. MIGRATE targets (PROTOCOL.md
//! §3.7) use the same syntax.

use std::fmt;
use std::net::SocketAddr;

use crate::conn::{BoxConnection, ConnConfig, TransportKind};
use crate::error::TransportError;
use crate::kcp::{connect_kcp, KcpConfig};
use crate::quic::{connect_quic, QuicConfig};
use crate::tcp::{connect_tcp, connect_tls};
use crate::tls::ClientTls;
use crate::ws::connect_ws;

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The transport.
    pub kind: TransportKind,
    /// Host name or IP literal (TLS server name, WebSocket Host header).
    pub host: String,
    /// Resolved address.
    pub addr: SocketAddr,
    /// WebSocket path (`/` otherwise).
    pub path: String,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        write!(f, "{}://{}:{}", self.kind.as_str(), host, self.addr.port())?;
        if matches!(self.kind, TransportKind::Ws | TransportKind::Wss) && self.path != "/" {
            f.write_str(&self.path)?;
        }
        Ok(())
    }
}

impl Endpoint {
    /// An endpoint for `kind` at `addr` (host = the IP).
    pub fn new(kind: TransportKind, addr: SocketAddr) -> Self {
        Self {
            kind,
            host: addr.ip().to_string(),
            addr,
            path: "/".into(),
        }
    }

    /// Parses `scheme://host:port[/path]`. Hosts must be IP literals or `localhost`
    /// (no DNS lookups here; resolve names before).
    pub fn parse(url: &str) -> Result<Self, TransportError> {
        let bad = |what: &str| TransportError::Config(format!("endpoint `{url}`: {what}"));
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("missing scheme://"))?;
        let kind = TransportKind::ALL
            .into_iter()
            .find(|k| k.as_str() == scheme)
            .ok_or_else(|| bad("unknown scheme (tcp, tls, ws, wss, quic, kcp)"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = if let Some(stripped) = authority.strip_prefix('[') {
            let (h, p) = stripped
                .split_once("]:")
                .ok_or_else(|| bad("expected [v6]:port"))?;
            (h, p)
        } else {
            authority
                .rsplit_once(':')
                .ok_or_else(|| bad("missing :port"))?
        };
        let port: u16 = port.parse().map_err(|_| bad("invalid port"))?;
        let ip: std::net::IpAddr = if host == "localhost" {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            host.parse()
                .map_err(|_| bad("host must be an IP literal or localhost"))?
        };
        Ok(Self {
            kind,
            host: host.to_string(),
            addr: SocketAddr::new(ip, port),
            path: path.to_string(),
        })
    }
}

/// Everything a client needs besides the endpoint.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// Limits and timeouts.
    pub conn: ConnConfig,
    /// Trusted CAs for tls, wss and QUIC (required for those).
    pub tls: Option<ClientTls>,
    /// QUIC settings.
    pub quic: QuicConfig,
    /// KCP settings.
    pub kcp: KcpConfig,
}

/// Connects to `endpoint`.
pub async fn connect(
    endpoint: &Endpoint,
    options: &ConnectOptions,
) -> Result<BoxConnection, TransportError> {
    let need_tls = || {
        options
            .tls
            .as_ref()
            .ok_or_else(|| TransportError::Config(format!("{endpoint}: needs trusted CAs (tls)")))
    };
    match endpoint.kind {
        TransportKind::Tcp => connect_tcp(endpoint.addr, &options.conn).await,
        TransportKind::Tls => {
            connect_tls(endpoint.addr, &endpoint.host, need_tls()?, &options.conn).await
        }
        TransportKind::Ws => {
            connect_ws(
                endpoint.addr,
                &endpoint.host,
                &endpoint.path,
                None,
                &options.conn,
            )
            .await
        }
        TransportKind::Wss => {
            connect_ws(
                endpoint.addr,
                &endpoint.host,
                &endpoint.path,
                Some(need_tls()?),
                &options.conn,
            )
            .await
        }
        TransportKind::Quic => {
            connect_quic(
                endpoint.addr,
                &endpoint.host,
                need_tls()?,
                &options.quic,
                &options.conn,
            )
            .await
        }
        TransportKind::Kcp => connect_kcp(endpoint.addr, &options.kcp, &options.conn).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display() {
        let e = Endpoint::parse("wss://localhost:7443/game").unwrap();
        assert_eq!(e.kind, TransportKind::Wss);
        assert_eq!(e.host, "localhost");
        assert_eq!(e.addr, "127.0.0.1:7443".parse().unwrap());
        assert_eq!(e.path, "/game");
        assert_eq!(e.to_string(), "wss://localhost:7443/game");
        let v6 = Endpoint::parse("quic://[::1]:7444").unwrap();
        assert_eq!(v6.addr, "[::1]:7444".parse().unwrap());
        assert_eq!(v6.to_string(), "quic://[::1]:7444");
        for bad in [
            "7000",
            "ftp://1.2.3.4:1",
            "tcp://1.2.3.4",
            "tcp://example.com:80",
            "tcp://1.2.3.4:99999",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
