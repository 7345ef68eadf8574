//! Presence (SPEC F4): where a player is connected, as edge + session, with a TTL the edge
//! refreshes. [`RedisPresence`] also carries the cross-edge push (see `push`), which looks
//! players up here.

use redis::{AsyncCommands as _, Script};
use waygate_protocol::frame::SessionId;
use waygate_session::resume::hex_id;

use super::conn::{check_edge, ms, parse_hex, Conn};
use super::push::PushState;
use super::{RedisConfig, RedisError};

/// KEYS: presence. ARGV: "<session hex> ". Deletes the record if it is this session's.
/// KEYS: presence. ARGV: the whole record ("session-hex edge"). Deletes it only if it is
/// exactly that record: a newer session's, or the same session's written by another edge
/// (it moved there), stays.
const PRESENCE_REMOVE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// The presence removal script (hashed once; loaded into Redis on first use).
fn remove_script() -> &'static Script {
    static S: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    S.get_or_init(|| Script::new(PRESENCE_REMOVE_LUA))
}

/// Where a player is connected (SPEC F4: edge + session, never the player id alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    /// The edge holding the session.
    pub edge: String,
    /// The session.
    pub session_id: SessionId,
}

fn parse_presence(record: &str) -> Option<Presence> {
    let (sid, edge) = record.split_once(' ')?;
    Some(Presence {
        edge: edge.to_owned(),
        session_id: parse_hex::<16>(sid)?,
    })
}

/// Presence records and batched cross-edge push (SPEC F4).
pub struct RedisPresence {
    pub(super) conn: Conn,
    /// The sending side of cross-edge push.
    pub(super) push: PushState,
}

impl std::fmt::Debug for RedisPresence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPresence")
            .field("conn", &self.conn)
            .finish_non_exhaustive()
    }
}

impl RedisPresence {
    pub(super) fn from_conn(conn: Conn) -> Self {
        Self {
            conn,
            push: PushState::new(),
        }
    }

    /// Presence alone (see [`RedisStores`](super::RedisStores) for all three sharing a
    /// connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self::from_conn(Conn::new(config)?))
    }

    /// Records (or refreshes) that `player_id` is on `edge` in `session_id`, for
    /// [`RedisConfig::presence_ttl`]. Call on ACTIVE and periodically for live sessions.
    pub async fn set(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<(), RedisError> {
        check_edge(edge)?;
        let key = self.conn.player_key("presence", player_id);
        let val = format!("{} {edge}", hex_id(session_id));
        let ttl = ms(self.conn.config.presence_ttl);
        self.conn
            .run(|mut m| async move { m.pset_ex::<_, _, ()>(key, val, ttl).await })
            .await
    }

    /// Refreshes many presence records in one round trip (the periodic sweep; one per slot
    /// on a cluster, concurrently).
    pub async fn set_many(
        &self,
        edge: &str,
        entries: &[(String, SessionId)],
    ) -> Result<(), RedisError> {
        check_edge(edge)?;
        if entries.is_empty() {
            return Ok(());
        }
        let ttl = ms(self.conn.config.presence_ttl);
        let key = |(player, _): &(String, SessionId)| self.conn.player_key("presence", player);
        let replies = self
            .conn
            .pipeline_each(
                entries,
                |e| (key(e), false),
                |pipe, entry| {
                    pipe.cmd("SET")
                        .arg(key(entry))
                        .arg(format!("{} {edge}", hex_id(&entry.1)))
                        .arg("PX")
                        .arg(ttl);
                },
            )
            .await?;
        replies
            .into_iter()
            .try_for_each(|r| r.map(drop).map_err(RedisError::from))
    }

    /// Removes the presence record if it still names `session_id` on `edge` (a newer
    /// session's record stays, and so does the same session's written by another edge: a
    /// copy superseded here after the session moved must not remove where it lives now).
    /// Returns whether it did.
    pub async fn remove(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<bool, RedisError> {
        let mut inv = remove_script().prepare_invoke();
        inv.key(self.conn.player_key("presence", player_id))
            .arg(format!("{} {edge}", hex_id(session_id)));
        let n: u8 = self
            .conn
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }

    /// Where `player_id` is.
    pub async fn lookup(&self, player_id: &str) -> Result<Option<Presence>, RedisError> {
        Ok(self.lookup_many(&[player_id]).await?.pop().flatten())
    }

    /// Where each of `players` is, in order (one MGET; the cluster client splits it by slot).
    pub async fn lookup_many(&self, players: &[&str]) -> Result<Vec<Option<Presence>>, RedisError> {
        if players.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = players
            .iter()
            .map(|p| self.conn.player_key("presence", p))
            .collect();
        let recs: Vec<Option<String>> = self
            .conn
            .run(|mut m| async move { redis::cmd("MGET").arg(keys).query_async(&mut m).await })
            .await?;
        recs.into_iter()
            .map(|r| {
                r.map(|r| {
                    parse_presence(&r).ok_or_else(|| RedisError::Corrupt(format!("presence {r:?}")))
                })
                .transpose()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presence_records_parse() {
        let p = parse_presence(&format!("{} e9", hex_id(&[2; 16]))).expect("presence");
        assert_eq!(p.edge, "e9");
    }
}
