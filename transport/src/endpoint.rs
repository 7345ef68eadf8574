//! Client endpoints as URLs — `tcp://host:port`, `tls://`, `ws://host:port/path`, `wss://`,
//! `quic://`, `kcp://` — and one `connect` for all of them. MIGRATE targets (PROTOCOL.md
//! §3.7) use the same syntax. Hosts are IP literals (`[v6]` in brackets) or DNS names,
//! resolved at each connect (every address tried in the resolver's order, IPv6 and IPv4).
//! TLS (tls, wss, quic) trusts the caller's CA, or the system's trust roots without one.

use std::fmt;
use std::net::SocketAddr;

use crate::conn::{BoxConnection, ConnConfig, TransportKind};
use crate::error::TransportError;
use crate::kcp::{connect_kcp_from, KcpConfig};
#[cfg(feature = "quic")]
use crate::quic::{connect_quic, QuicClientSockets, QuicConfig};
use crate::tcp::{connect_tcp, connect_tls};
use crate::tls::ClientTls;
#[cfg(feature = "ws")]
use crate::ws::connect_ws;

/// Where and how to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The transport.
    pub kind: TransportKind,
    /// Host name or IP literal (TLS server name, WebSocket Host header).
    pub host: String,
    /// The address for an IP literal host; for a DNS name, the port with an unspecified
    /// address (the name is resolved at each connect, [`Endpoint::is_name`]).
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

    /// Whether the host is a DNS name (resolved at connect) rather than an IP literal.
    pub fn is_name(&self) -> bool {
        self.host.parse::<std::net::IpAddr>().is_err()
    }

    /// The addresses to try, in order: the IP literal, or every address the name resolves
    /// to (bounded by `timeout`).
    pub async fn resolve(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Vec<SocketAddr>, TransportError> {
        if !self.is_name() {
            return Ok(vec![self.addr]);
        }
        let lookup = tokio::net::lookup_host((self.host.as_str(), self.addr.port()));
        let found = tokio::time::timeout(timeout, lookup)
            .await
            .map_err(|_| TransportError::HandshakeTimeout)?
            .map_err(|e| TransportError::Handshake(format!("cannot resolve {}: {e}", self.host)))?;
        let mut addrs: Vec<SocketAddr> = Vec::new();
        for a in found {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
        if addrs.is_empty() {
            return Err(TransportError::Handshake(format!(
                "{} resolves to no address",
                self.host
            )));
        }
        Ok(addrs)
    }

    /// Parses `scheme://host:port[/path]`. A host is an IP literal (IPv6 in brackets) or a
    /// DNS name (letters, digits, `-` and `.`; resolved at connect).
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
        let ip: std::net::IpAddr = match host.parse() {
            Ok(ip) => ip,
            Err(_) if is_dns_name(host) => std::net::IpAddr::from([0, 0, 0, 0]),
            Err(_) => return Err(bad("host must be an IP literal or a DNS name")),
        };
        Ok(Self {
            kind,
            host: host.to_string(),
            addr: SocketAddr::new(ip, port),
            path: path.to_string(),
        })
    }
}

/// Whether `host` is a syntactically valid DNS name (RFC 1123 labels).
fn is_dns_name(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Everything a client needs besides the endpoint.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    /// Limits and timeouts.
    pub conn: ConnConfig,
    /// Trusted CAs for tls, wss and QUIC; `None`: the system's trust roots.
    pub tls: Option<ClientTls>,
    /// QUIC settings.
    #[cfg(feature = "quic")]
    pub quic: QuicConfig,
    /// Client sockets shared by QUIC connects (`None`: a socket per connection).
    #[cfg(feature = "quic")]
    pub quic_sockets: Option<QuicClientSockets>,
    /// KCP settings.
    pub kcp: KcpConfig,
    /// The address KCP client sockets bind to (`None`: the unspecified address).
    pub kcp_local_ip: Option<std::net::IpAddr>,
}

/// Connects to `endpoint`: each address it resolves to in turn, until one connects (the
/// last failure is returned).
pub async fn connect(
    endpoint: &Endpoint,
    options: &ConnectOptions,
) -> Result<BoxConnection, TransportError> {
    let system;
    let tls = match &options.tls {
        Some(tls) => Some(tls),
        None if matches!(
            endpoint.kind,
            TransportKind::Tls | TransportKind::Wss | TransportKind::Quic
        ) =>
        {
            system = ClientTls::system_roots()?;
            Some(&system)
        }
        None => None,
    };
    let addrs = endpoint.resolve(options.conn.handshake_timeout).await?;
    connect_any(endpoint, &addrs, tls, options).await
}

/// Connects to `endpoint` at each of `addrs` in turn until one connects; the last failure
/// otherwise. (What [`connect`] does after resolving; `tls` as there.)
pub async fn connect_any(
    endpoint: &Endpoint,
    addrs: &[SocketAddr],
    tls: Option<&ClientTls>,
    options: &ConnectOptions,
) -> Result<BoxConnection, TransportError> {
    let mut last = None;
    for &addr in addrs {
        match connect_addr(endpoint, addr, tls, options).await {
            Ok(conn) => return Ok(conn),
            Err(e) => {
                tracing::debug!(%endpoint, %addr, error = %e, "address failed; trying the next");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or(TransportError::Closed))
}

async fn connect_addr(
    endpoint: &Endpoint,
    addr: SocketAddr,
    tls: Option<&ClientTls>,
    options: &ConnectOptions,
) -> Result<BoxConnection, TransportError> {
    let need_tls = || {
        tls.ok_or_else(|| TransportError::Config(format!("{endpoint}: needs trusted CAs (tls)")))
    };
    match endpoint.kind {
        TransportKind::Tcp => connect_tcp(addr, &options.conn).await,
        TransportKind::Tls => connect_tls(addr, &endpoint.host, need_tls()?, &options.conn).await,
        #[cfg(feature = "ws")]
        TransportKind::Ws => {
            connect_ws(addr, &endpoint.host, &endpoint.path, None, &options.conn).await
        }
        #[cfg(feature = "ws")]
        TransportKind::Wss => {
            connect_ws(
                addr,
                &endpoint.host,
                &endpoint.path,
                Some(need_tls()?),
                &options.conn,
            )
            .await
        }
        #[cfg(feature = "quic")]
        TransportKind::Quic => {
            let (host, tls) = (&endpoint.host, need_tls()?);
            match &options.quic_sockets {
                Some(shared) => {
                    shared
                        .connect(addr, host, tls, &options.quic, &options.conn)
                        .await
                }
                None => connect_quic(addr, host, tls, &options.quic, &options.conn).await,
            }
        }
        TransportKind::Kcp => {
            connect_kcp_from(options.kcp_local_ip, addr, &options.kcp, &options.conn).await
        }
        #[cfg(not(all(feature = "ws", feature = "quic")))]
        kind => {
            Err(TransportError::Config(format!(
            "{endpoint}: this build leaves out {kind} (cargo feature `{}` of waygate-transport)",
            if kind == TransportKind::Quic { "quic" } else { "ws" }
        )))
        }
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
        assert!(e.is_name(), "localhost is resolved like any name");
        assert_eq!(e.path, "/game");
        assert_eq!(e.to_string(), "wss://localhost:7443/game");
        let v6 = Endpoint::parse("quic://[::1]:7444").unwrap();
        assert_eq!(v6.addr, "[::1]:7444".parse().unwrap());
        assert_eq!(v6.to_string(), "quic://[::1]:7444");
        let name = Endpoint::parse("wss://game.example.com:443/play").unwrap();
        assert!(name.is_name());
        assert_eq!(name.addr.port(), 443);
        assert_eq!(name.to_string(), "wss://game.example.com:443/play");
        assert!(!v6.is_name());
        for bad in [
            "7000",
            "ftp://1.2.3.4:1",
            "tcp://1.2.3.4",
            "tcp://exa_mple.com:80",
            "tcp://-bad.example:80",
            "tcp://1.2.3.4:99999",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
