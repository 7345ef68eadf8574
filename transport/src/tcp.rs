//! TCP and TLS-over-TCP: the listener and the client connector. Frames are varint
//! length-delimited ([`crate::stream::StreamConnection`]).

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::net::{TcpListener as TokioTcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::conn::{
    BoxConnection, ConnConfig, ConnId, ConnInfo, Listener, ListenerStats, TransportKind,
};
use crate::error::TransportError;
use crate::stream::StreamConnection;
use crate::tls::{server_name, ClientTls, TlsIdentity};

/// Ready connections waiting for `accept`.
const ACCEPT_BACKLOG: usize = 1024;

/// A TCP (or TLS) listener.
pub struct TcpListener {
    local: SocketAddr,
    kind: TransportKind,
    ready: mpsc::Receiver<BoxConnection>,
    stats: Arc<ListenerStats>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for TcpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpListener")
            .field("local", &self.local)
            .field("kind", &self.kind)
            .finish()
    }
}

impl TcpListener {
    /// Binds `addr`; with `tls`, every connection is wrapped in TLS first.
    pub async fn bind(
        addr: SocketAddr,
        tls: Option<&TlsIdentity>,
        config: ConnConfig,
    ) -> Result<Self, TransportError> {
        let listener = TokioTcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let acceptor = tls
            .map(|id| {
                id.server_config(&[])
                    .map(|c| TlsAcceptor::from(Arc::new(c)))
            })
            .transpose()?;
        let kind = if acceptor.is_some() {
            TransportKind::Tls
        } else {
            TransportKind::Tcp
        };
        let (tx, ready) = mpsc::channel(ACCEPT_BACKLOG);
        let stats = Arc::new(ListenerStats::default());
        let task = tokio::spawn(accept_loop(
            listener,
            local,
            acceptor,
            config,
            tx,
            stats.clone(),
        ));
        Ok(Self {
            local,
            kind,
            ready,
            stats,
            task,
        })
    }

    /// Counters of this listener.
    pub fn stats(&self) -> Arc<ListenerStats> {
        self.stats.clone()
    }
}

impl Drop for TcpListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TokioTcpListener,
    local: SocketAddr,
    acceptor: Option<TlsAcceptor>,
    config: ConnConfig,
    tx: mpsc::Sender<BoxConnection>,
    stats: Arc<ListenerStats>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(v) => v,
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(%local, error = %e, "tcp accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                continue;
            }
        };
        if tx.is_closed() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let info = ConnInfo {
            id: ConnId::next(),
            kind: if acceptor.is_some() {
                TransportKind::Tls
            } else {
                TransportKind::Tcp
            },
            peer,
            local,
        };
        match &acceptor {
            None => {
                ListenerStats::bump(&stats.accepted);
                let conn: BoxConnection = Box::new(StreamConnection::new(stream, info, &config));
                if tx.send(conn).await.is_err() {
                    return;
                }
            }
            Some(acceptor) => {
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                let config = config.clone();
                let stats = stats.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(config.handshake_timeout, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => {
                            ListenerStats::bump(&stats.accepted);
                            let conn: BoxConnection =
                                Box::new(StreamConnection::new(tls, info, &config));
                            let _ = tx.send(conn).await;
                        }
                        Ok(Err(e)) => {
                            ListenerStats::bump(&stats.handshake_failed);
                            tracing::debug!(%peer, error = %e, "tls handshake failed");
                        }
                        Err(_) => {
                            ListenerStats::bump(&stats.handshake_failed);
                            tracing::debug!(%peer, "tls handshake timed out");
                        }
                    }
                });
            }
        }
    }
}

#[async_trait]
impl Listener for TcpListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn kind(&self) -> TransportKind {
        self.kind
    }

    async fn accept(&mut self) -> Option<BoxConnection> {
        self.ready.recv().await
    }
}

/// Connects over plain TCP.
pub async fn connect_tcp(
    addr: SocketAddr,
    config: &ConnConfig,
) -> Result<BoxConnection, TransportError> {
    let stream = tokio::time::timeout(config.handshake_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| TransportError::HandshakeTimeout)??;
    let _ = stream.set_nodelay(true);
    let info = ConnInfo {
        id: ConnId::next(),
        kind: TransportKind::Tcp,
        peer: addr,
        local: stream.local_addr()?,
    };
    Ok(Box::new(StreamConnection::new(stream, info, config)))
}

/// Connects over TLS, verifying the server as `host` against `tls`'s roots.
pub async fn connect_tls(
    addr: SocketAddr,
    host: &str,
    tls: &ClientTls,
    config: &ConnConfig,
) -> Result<BoxConnection, TransportError> {
    let connector = TlsConnector::from(Arc::new(tls.client_config(&[])?));
    let name = server_name(host)?;
    let stream = tokio::time::timeout(config.handshake_timeout, async {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let local = tcp.local_addr()?;
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| TransportError::Handshake(e.to_string()))?;
        Ok::<_, TransportError>((tls, local))
    })
    .await
    .map_err(|_| TransportError::HandshakeTimeout)??;
    let info = ConnInfo {
        id: ConnId::next(),
        kind: TransportKind::Tls,
        peer: addr,
        local: stream.1,
    };
    Ok(Box::new(StreamConnection::new(stream.0, info, config)))
}
