//! TCP and TLS-over-TCP: the listener and the client connector. Frames are varint
//! length-delimited ([`crate::stream::StreamConnection`]).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::conn::{BoxConnection, ConnConfig, ConnId, ConnInfo, PreAuth, TransportKind};
use crate::error::TransportError;
use crate::listener::{accept_tcp, admit, reject_bytes, within_phase, Admit, TransportListener};
use crate::stream::StreamConnection;
use crate::tls::{server_name, ClientTls, TlsIdentity};

/// Binds a TCP listener at `addr`; with `tls`, every connection is wrapped in TLS first.
pub async fn listen(
    addr: SocketAddr,
    tls: Option<&TlsIdentity>,
    config: ConnConfig,
) -> Result<TransportListener, TransportError> {
    let listener = crate::listener::bind_tcp(addr)?;
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
    Ok(TransportListener::start(
        local,
        kind,
        move |handoff| async move {
            loop {
                let (stream, peer) = accept_tcp(&listener, config.send_buffer).await;
                if handoff.is_closed() {
                    return;
                }
                let permit = match admit(config.admission.as_ref(), peer, &handoff.stats) {
                    Admit::Go(permit) => permit,
                    Admit::Refuse {
                        code,
                        retry_after_ms,
                    } => {
                        // Plain TCP can answer at once (never a silent drop); TLS cannot
                        // before its handshake, so it is closed (counted).
                        if acceptor.is_none() {
                            let _ = stream.try_write(&reject_bytes(code, retry_after_ms));
                        }
                        continue;
                    }
                };
                let info = ConnInfo {
                    id: ConnId::next(),
                    kind,
                    peer,
                    local,
                    accepted_at: std::time::Instant::now(),
                };
                match &acceptor {
                    None => {
                        let conn = StreamConnection::new(stream, info, &config)
                            .accepted(PreAuth::accepted(permit));
                        if !handoff.ready(Box::new(conn)).await {
                            return;
                        }
                    }
                    Some(acceptor) => {
                        let acceptor = acceptor.clone();
                        let config = config.clone();
                        handoff.spawn_handshake(peer, config.handshake_timeout, async move {
                            let tls = within_phase(
                                permit.as_ref(),
                                waygate_backpressure::Phase::Tls,
                                async {
                                    acceptor
                                        .accept(stream)
                                        .await
                                        .map_err(|e| TransportError::Handshake(e.to_string()))
                                },
                            )
                            .await?;
                            let conn = StreamConnection::new(tls, info, &config)
                                .accepted(PreAuth::accepted(permit));
                            Ok(Box::new(conn) as BoxConnection)
                        });
                    }
                }
            }
        },
    ))
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
        accepted_at: std::time::Instant::now(),
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
        accepted_at: std::time::Instant::now(),
    };
    Ok(Box::new(StreamConnection::new(stream.0, info, config)))
}
