//! UDP sockets for the QUIC and KCP listeners, with kernel buffers sized for bursts: a
//! wave of handshakes (a reconnect storm after a network blip) must not overflow the
//! default ~200 KiB receive buffer, or every lost handshake packet waits out a
//! retransmission timer that doubles each time.

use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};

/// Receive and send buffer asked of the kernel (it may cap it at `net.core.rmem_max`).
pub const UDP_BUFFER_BYTES: usize = 4 * 1024 * 1024;

/// A bound, non-blocking UDP socket with large buffers.
pub fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // Best effort: a capped buffer is still better than failing to start.
    let _ = socket.set_recv_buffer_size(UDP_BUFFER_BYTES);
    let _ = socket.set_send_buffer_size(UDP_BUFFER_BYTES);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}
