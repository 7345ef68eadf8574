//! KCP engine parameters and endpoint limits, with the "fast" and "normal" presets (T4).

use serde::{Deserialize, Serialize};

use crate::error::TransportError;

/// KCP header size: the smallest valid segment.
pub const KCP_OVERHEAD: usize = 24;
/// A KCP message has at most this many fragments (the reference ikcp refuses 128).
pub const MAX_FRAGMENTS: usize = 127;

/// Named parameter sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KcpPreset {
    /// Combat traffic: no delay, 10 ms interval, fast resend after 2 skips, no congestion
    /// window, 256-segment windows.
    Fast,
    /// Everything else: standard RTO, 40 ms interval, congestion control, 128-segment windows.
    Normal,
}

impl KcpPreset {
    /// The preset's configuration.
    pub fn config(self) -> KcpConfig {
        match self {
            Self::Fast => KcpConfig::fast(),
            Self::Normal => KcpConfig::normal(),
        }
    }
}

/// Parameters of the KCP engine (the same on both ends is best, but not required) and limits
/// of the endpoint. Every field is public and (de)serializable so the edge config can set
/// it; missing fields take the [`KcpConfig::fast`] values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KcpConfig {
    /// ikcp `nodelay`: minimum RTO 30 ms instead of 100 ms, gentler RTO backoff.
    pub nodelay: bool,
    /// ikcp `interval` in ms (10..=5000): how often in-flight data is re-examined.
    pub interval_ms: u32,
    /// ikcp `resend`: fast retransmit after this many later segments were acked (0 = off).
    pub resend: u32,
    /// ikcp `nc`: disable the congestion window (send at the full window).
    pub no_congestion_control: bool,
    /// Send window in segments.
    pub send_window: u16,
    /// Receive window in segments (the engine raises anything below 128 to 128).
    pub recv_window: u16,
    /// Largest datagram, KCP header included (the segment payload is `mtu - 24`, and 28
    /// bytes less in a sealed session).
    pub mtu: usize,
    /// Most sessions one listener holds; CONNECTs beyond it are answered BUSY.
    pub max_sessions: usize,
    /// How long a cookie stays valid, in whole seconds.
    pub cookie_lifetime_secs: u32,
    /// COOKIE replies per second per endpoint (token bucket rate).
    pub cookie_rate_per_sec: u32,
    /// Token bucket burst for COOKIE replies.
    pub cookie_burst: u32,
    /// BUSY and RESET replies per second per endpoint; beyond it they are not sent.
    pub reject_rate_per_sec: u32,
    /// The retry-after hint in BUSY replies, in ms.
    pub busy_retry_after_ms: u32,
    /// `send` waits while more than this many segments wait in the engine (unsent or
    /// unacknowledged). At least 127, so one message of the maximum size always fits.
    pub send_queue_segments: usize,
    /// Messages delivered to a connection but not yet read by it; beyond that the endpoint
    /// leaves messages in the engine, whose receive window then stops the peer.
    pub inbound_queue_messages: usize,
    /// Bytes of those messages: the same, counted in bytes (one message always goes when
    /// nothing is outstanding, whatever its size), so a client sending maximum-size
    /// messages faster than the edge reads holds this much here, not 64 of them.
    pub inbound_queue_bytes: usize,
    /// After a close, how long the session lingers to get its last data (the CLOSE frame)
    /// acknowledged before it is reset anyway, in ms.
    pub linger_ms: u64,
    /// Server role only: how long the ACK owed for a message just delivered may wait for a
    /// reply to carry it, in ms (0 = sent at once; a client endpoint always acks at once). Anything sent on the session within the delay carries
    /// the ACK in the same datagram (a PONG, an echo reply); otherwise the ACK leaves alone
    /// when the delay ends. At most 10 (a third of nodelay's 30 ms minimum RTO).
    pub ack_delay_ms: u64,
    /// Client: first retransmission interval of HELLO/CONNECT, in ms (doubles up to 8x).
    pub handshake_resend_ms: u64,
    /// Server: whether sessions must be sealed (PROTOCOL.md §8.9: a CONNECT carrying a
    /// connect token, every datagram authenticated and encrypted). `auto`: required when
    /// the listener is beyond loopback.
    pub packet_auth: PacketAuth,
}

/// Whether a KCP listener requires sealed sessions (see [`KcpConfig::packet_auth`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PacketAuth {
    /// Required unless the listener's address is a loopback address.
    #[default]
    Auto,
    /// A CONNECT without a connect token is refused (BUSY 205 `auth_rejected`).
    Required,
    /// Sealed when the client brings a connect token, plain otherwise.
    Optional,
}

impl PacketAuth {
    /// Whether a listener bound to `local` requires sealed sessions.
    pub fn required_at(self, local: std::net::SocketAddr) -> bool {
        match self {
            Self::Auto => !local.ip().is_loopback(),
            Self::Required => true,
            Self::Optional => false,
        }
    }
}

impl Default for KcpConfig {
    fn default() -> Self {
        Self::fast()
    }
}

impl KcpConfig {
    /// The "fast" preset (combat): nodelay, interval 10, resend 2, nc, windows 256/256,
    /// MTU 1200.
    pub fn fast() -> Self {
        Self {
            nodelay: true,
            interval_ms: 10,
            resend: 2,
            no_congestion_control: true,
            send_window: 256,
            recv_window: 256,
            mtu: 1200,
            max_sessions: 10_000,
            cookie_lifetime_secs: 10,
            cookie_rate_per_sec: 5_000,
            cookie_burst: 2_000,
            reject_rate_per_sec: 1_000,
            busy_retry_after_ms: 1_000,
            send_queue_segments: 512,
            inbound_queue_messages: 64,
            inbound_queue_bytes: 128 * 1024,
            linger_ms: 2_000,
            ack_delay_ms: 2,
            handshake_resend_ms: 200,
            packet_auth: PacketAuth::Auto,
        }
    }

    /// The "normal" preset: no nodelay, interval 40, no fast resend, congestion control,
    /// windows 128/128, MTU 1200.
    pub fn normal() -> Self {
        Self {
            nodelay: false,
            interval_ms: 40,
            resend: 0,
            no_congestion_control: false,
            send_window: 128,
            recv_window: 128,
            send_queue_segments: 256,
            ..Self::fast()
        }
    }

    /// Largest KCP segment payload (of a sealed session, whose datagrams carry
    /// [`super::seal::SEAL_OVERHEAD`] more bytes: the one limit for both kinds).
    pub fn mss(&self) -> usize {
        self.mtu
            .saturating_sub(KCP_OVERHEAD + super::seal::SEAL_OVERHEAD)
    }

    /// Largest message one KCP message can carry with this MTU (127 fragments).
    pub fn max_message_size(&self) -> usize {
        MAX_FRAGMENTS * self.mss()
    }

    /// Checks the values, and that frames of `max_frame_size` fit one KCP message.
    pub fn validate(&self, max_frame_size: usize) -> Result<(), TransportError> {
        let fail = |what: String| Err(TransportError::Config(format!("kcp: {what}")));
        if !(128..=65_000).contains(&self.mtu) {
            return fail(format!("mtu {} outside 128..=65000", self.mtu));
        }
        if !(10..=5000).contains(&self.interval_ms) {
            return fail(format!(
                "interval_ms {} outside 10..=5000",
                self.interval_ms
            ));
        }
        if self.send_window == 0 || self.recv_window == 0 {
            return fail("windows must be > 0".into());
        }
        if max_frame_size == 0 || max_frame_size > self.max_message_size() {
            return fail(format!(
                "max_frame_size {max_frame_size} must be 1..={} (127 x mss at mtu {})",
                self.max_message_size(),
                self.mtu
            ));
        }
        if self.send_queue_segments < MAX_FRAGMENTS {
            return fail("send_queue_segments must be >= 127".into());
        }
        if self.inbound_queue_messages == 0
            || self.inbound_queue_bytes == 0
            || self.max_sessions == 0
        {
            return fail(
                "inbound_queue_messages, inbound_queue_bytes and max_sessions must be > 0".into(),
            );
        }
        if self.cookie_rate_per_sec == 0 || self.cookie_burst == 0 {
            return fail("cookie rate and burst must be > 0".into());
        }
        if self.handshake_resend_ms == 0 {
            return fail("handshake_resend_ms must be > 0".into());
        }
        if self.ack_delay_ms > 10 {
            return fail(format!("ack_delay_ms {} above 10", self.ack_delay_ms));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use waygate_protocol::wire::DEFAULT_MAX_FRAME_SIZE;

    #[test]
    fn presets_are_valid_and_differ() {
        for preset in [KcpPreset::Fast, KcpPreset::Normal] {
            preset
                .config()
                .validate(DEFAULT_MAX_FRAME_SIZE)
                .expect("valid preset");
        }
        let fast = KcpConfig::fast();
        assert!(fast.nodelay && fast.no_congestion_control);
        assert_eq!((fast.interval_ms, fast.resend, fast.mtu), (10, 2, 1200));
        let normal = KcpConfig::normal();
        assert!(!normal.nodelay && !normal.no_congestion_control);
        assert_eq!((normal.interval_ms, normal.send_window), (40, 128));
        assert!(fast.validate(fast.max_message_size() + 1).is_err());
        assert!(KcpConfig {
            mtu: 20,
            ..KcpConfig::fast()
        }
        .validate(100)
        .is_err());
    }
}
