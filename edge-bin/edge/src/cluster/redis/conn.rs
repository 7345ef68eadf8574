//! The connection the Redis backends share: a `ConnectionManager` that reconnects by itself,
//! every call bounded by [`RedisConfig::op_timeout`], key and channel names under the prefix,
//! and the pub/sub subscription loop (kicks, pushes, push replies) kept up with backoff.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use redis::aio::ConnectionManager;
use tokio::sync::watch;

use super::{RedisConfig, RedisError};

/// Shared connection, key names and the per-call bound.
#[derive(Clone)]
pub(super) struct Conn {
    client: redis::Client,
    manager: ConnectionManager,
    pub(super) config: Arc<RedisConfig>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("url", &self.config.url)
            .finish_non_exhaustive()
    }
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Conn {
    pub(super) fn new(config: RedisConfig) -> Result<Self, RedisError> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| RedisError::Invalid(format!("redis url: {e}")))?;
        let mc = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.op_timeout))
            .set_response_timeout(Some(config.op_timeout))
            .set_number_of_retries(4)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), mc)?;
        Ok(Self {
            client,
            manager,
            config: Arc::new(config),
        })
    }

    /// Runs `f` on a clone of the managed connection, bounded by the op timeout.
    pub(super) async fn run<T, F, Fut>(&self, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match tokio::time::timeout(self.config.op_timeout, f(self.manager.clone())).await {
            Ok(r) => r.map_err(RedisError::from),
            Err(_) => Err(RedisError::Timeout),
        }
    }

    pub(super) fn key(&self, kind: &str, id: &str) -> String {
        format!("{}:{kind}:{id}", self.config.prefix)
    }

    pub(super) fn edge_channel(&self, edge: &str, what: &str) -> String {
        format!("{}:edge:{edge}:{what}", self.config.prefix)
    }

    pub(super) fn fence_ttl_ms(&self) -> u64 {
        self.config.fence_ttl.map_or(0, ms)
    }

    pub(super) async fn ping(&self) -> Result<(), RedisError> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }
}

pub(super) fn check_edge(edge: &str) -> Result<(), RedisError> {
    if edge.is_empty() || edge.contains(['\n', ' ']) {
        return Err(RedisError::Invalid(format!(
            "edge id {edge:?} must be non-empty without spaces or newlines"
        )));
    }
    Ok(())
}

pub(super) fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Keeps a pub/sub subscription to `channel` up (reconnecting with backoff) and calls
/// `on_msg` for every message. `up` tracks whether the subscription is live. Never returns.
pub(super) async fn subscribe_loop<F, Fut>(
    conn: Conn,
    channel: String,
    up: Option<watch::Sender<bool>>,
    on_msg: F,
) where
    F: Fn(redis::Msg) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let set_up = |v: bool| {
        if let Some(up) = &up {
            up.send_replace(v);
        }
    };
    let mut backoff = Duration::from_millis(50);
    loop {
        let subscribed = tokio::time::timeout(conn.config.op_timeout, async {
            let mut ps = conn.client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        })
        .await;
        match subscribed {
            Ok(Ok(mut ps)) => {
                backoff = Duration::from_millis(50);
                set_up(true);
                tracing::debug!(%channel, "redis subscription up");
                let mut stream = ps.on_message();
                while let Some(msg) = stream.next().await {
                    on_msg(msg).await;
                }
                set_up(false);
                tracing::warn!(%channel, "redis subscription lost; reconnecting");
            }
            Ok(Err(e)) => tracing::debug!(%channel, error = %e, "redis subscribe failed"),
            Err(_) => tracing::debug!(%channel, "redis subscribe timed out"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_ids_are_checked() {
        assert!(check_edge("a b").is_err() && check_edge("").is_err() && check_edge("e-1").is_ok());
    }
}
