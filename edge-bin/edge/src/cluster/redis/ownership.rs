//! Single login across edges (SPEC S6): [`RedisOwnership`] keeps one owner record per
//! player with a fencing token from a per-player counter that only grows, releases only for
//! the current owner, publishes a [`KickNotice`] to the previous owner's edge on takeover, and
//! re-asserts live sessions ([`Reassert`]) after Redis lost them or a kick was missed.

use async_trait::async_trait;
use redis::{AsyncCommands as _, Script};
use tokio::sync::{mpsc, watch};
use waygate_protocol::frame::SessionId;
use waygate_session::resume::hex_id;
use waygate_session::store::{ClaimGrant, Owner, OwnershipRegistry, StoreError};

use super::conn::{check_edge, ms, parse_hex, subscribe_loop, Conn};
use super::{RedisConfig, RedisError};

/// Lua helper shared by the scripts: the next fencing token of a player, with the
/// counter's TTL. The token is the larger of the counter + 1 and the server clock in
/// microseconds, so it keeps growing when the counter is gone: expired, lost with a
/// restart without persistence, or lost in a failover to a replica that had not received
/// the last claims (asynchronous replication; the clocks of the old and the new primary
/// need only agree to within the failover time).
const NEXT_FENCE_LUA: &str = r#"
local function next_fence(key, ttl)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local c = tonumber(redis.call('GET', key) or '0')
  local f = math.max(c + 1, now)
  redis.call('SET', key, string.format('%d', f))
  if tonumber(ttl) > 0 then redis.call('PEXPIRE', key, ttl) end
  return f
end
"#;

/// KEYS: fence, owner. ARGV: session hex, edge, owner ttl ms, fence ttl ms, kick channel
/// prefix, kick channel suffix, player. Returns {fencing, previous owner record or nil}.
const CLAIM_LUA: &str = r#"
local f = next_fence(KEYS[1], ARGV[4])
local fs = string.format('%d', f)
local prev = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], fs .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
if prev then
  local pedge = string.match(prev, '^%d+ %x+ (.+)$')
  if pedge and pedge ~= ARGV[2] then
    redis.call('PUBLISH', ARGV[5] .. pedge .. ARGV[6],
      prev .. '\n' .. fs .. '\n' .. ARGV[2] .. '\n' .. ARGV[7])
  end
end
return {f, prev or false}
"#;

/// KEYS: owner. ARGV: "<fencing> <session hex> ". Deletes the owner record if it starts so.
pub(super) const RELEASE_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// KEYS: fence, owner. ARGV: session hex, edge, fencing, owner ttl ms, fence ttl ms.
/// Returns {1} (owner again, TTL refreshed) or {0, current owner record or nil}.
const REASSERT_LUA: &str = r#"
local f = tonumber(ARGV[3])
local c = redis.call('GET', KEYS[1])
if c and tonumber(c) > f then return {0, redis.call('GET', KEYS[2]) or false} end
local cur = redis.call('GET', KEYS[2])
if cur then
  local csid = string.match(cur, '^%d+ (%x+) ')
  if csid ~= ARGV[1] then return {0, cur} end
end
if not c or tonumber(c) < f then redis.call('SET', KEYS[1], ARGV[3]) end
if tonumber(ARGV[5]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[5]) end
redis.call('SET', KEYS[2], ARGV[3] .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[4])
return {1, false}
"#;

/// Result of [`RedisOwnership::reassert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reassert {
    /// The session owns the player (again); the owner record's TTL is refreshed.
    Owner,
    /// Someone newer owns the player (or claimed it since): kick the local session.
    Superseded(Option<Owner>),
}

/// A takeover notice for the edge that held the previous owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KickNotice {
    /// The player.
    pub player_id: String,
    /// The session to kick on the receiving edge.
    pub session_id: SessionId,
    /// That session's fencing token (kick only if the local session is not newer).
    pub fencing: u64,
    /// The new owner's fencing token.
    pub new_fencing: u64,
    /// The edge that took over.
    pub by_edge: String,
}

impl KickNotice {
    fn parse(payload: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(payload).ok()?;
        let mut lines = s.splitn(4, '\n');
        let prev = parse_owner(lines.next()?)?;
        let new_fencing = lines.next()?.parse().ok()?;
        let by_edge = lines.next()?.to_owned();
        let player_id = lines.next()?.to_owned();
        Some(Self {
            player_id,
            session_id: prev.session_id,
            fencing: prev.fencing,
            new_fencing,
            by_edge,
        })
    }
}

fn parse_owner(record: &str) -> Option<Owner> {
    let mut parts = record.splitn(3, ' ');
    let fencing = parts.next()?.parse().ok()?;
    let session_id = parse_hex::<16>(parts.next()?)?;
    let edge = parts.next()?.to_owned();
    Some(Owner {
        session_id,
        edge,
        fencing,
    })
}

fn owner_from(record: Option<String>) -> Result<Option<Owner>, RedisError> {
    record
        .map(|r| parse_owner(&r).ok_or_else(|| RedisError::Corrupt(format!("owner {r:?}"))))
        .transpose()
}

/// Redis [`OwnershipRegistry`] (SPEC S6).
#[derive(Debug)]
pub struct RedisOwnership {
    pub(super) conn: Conn,
    claim: Script,
    release: Script,
    reassert: Script,
}

impl RedisOwnership {
    pub(super) fn from_conn(conn: Conn) -> Self {
        Self {
            conn,
            claim: Script::new(&format!("{NEXT_FENCE_LUA}{CLAIM_LUA}")),
            release: Script::new(RELEASE_LUA),
            reassert: Script::new(REASSERT_LUA),
        }
    }

    /// A registry alone (see [`RedisStores`](super::RedisStores) for all three sharing a
    /// connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self::from_conn(Conn::new(config)?))
    }

    /// Makes `session_id` on `edge` the owner again if nobody newer claimed the player,
    /// refreshing the owner record's TTL to [`RedisConfig::owner_ttl`]. Call it for every
    /// live (attached, not lingering) session at once after Redis comes back (it restores
    /// records Redis lost and raises the counter to at least `fencing`) and periodically
    /// (e.g. every 30 s, well under `owner_ttl`). On [`Reassert::Superseded`] kick the
    /// local session: this also catches kicks missed while the kick subscription was down.
    pub async fn reassert(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
        fencing: u64,
    ) -> Result<Reassert, RedisError> {
        check_edge(edge)?;
        let c = &self.conn;
        let (fence, owner) = (
            c.player_key("fence", player_id),
            c.player_key("owner", player_id),
        );
        let mut inv = self.reassert.prepare_invoke();
        inv.key(fence)
            .key(owner)
            .arg(hex_id(session_id))
            .arg(edge)
            .arg(fencing)
            .arg(ms(c.config.owner_ttl))
            .arg(c.fence_ttl_ms());
        let (ok, cur): (u8, Option<String>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        if ok == 1 {
            Ok(Reassert::Owner)
        } else {
            Ok(Reassert::Superseded(owner_from(cur)?))
        }
    }

    /// Subscribes to takeover notices for sessions of `edge_id` (published by
    /// [`OwnershipRegistry::claim`] on another edge). The background task reconnects by
    /// itself and ends when the returned receiver is dropped. Pub/sub is at-most-once:
    /// notices published while the subscription is down are lost; the periodic
    /// [`RedisOwnership::reassert`] sweep catches those.
    pub fn subscribe_kicks(&self, edge_id: &str) -> mpsc::Receiver<KickNotice> {
        self.subscribe_kicks_with_status(edge_id).0
    }

    /// Like [`subscribe_kicks`](Self::subscribe_kicks), but also reports (through
    /// `subscribed`) whether the subscription is currently up.
    pub fn subscribe_kicks_with_status(
        &self,
        edge_id: &str,
    ) -> (mpsc::Receiver<KickNotice>, watch::Receiver<bool>) {
        let s = self.kick_subscription(edge_id);
        (s.notices, s.up)
    }

    /// Like [`subscribe_kicks`](Self::subscribe_kicks), with the subscription's state:
    /// whether it is up, and a count that rises whenever notices may have been missed (the
    /// subscription was made again after its first time, so what was published meanwhile
    /// went nowhere, or its full queue dropped notices). A rise means: re-assert ownership
    /// now ([`RedisOwnership::reassert`]) rather than at the next periodic sweep.
    pub fn kick_subscription(&self, edge_id: &str) -> KickSubscription {
        let (tx, rx) = mpsc::channel(4096);
        let (up_tx, up_rx) = watch::channel(false);
        let (missed_tx, missed_rx) = watch::channel(0u64);
        let channel = self.conn.edge_channel(edge_id, "kick");
        let conn = self.conn.clone();
        tokio::spawn(async move {
            let sink = tx.clone();
            let run = subscribe_loop(conn, channel, Some(up_tx), Some(missed_tx), move |msg| {
                let tx = sink.clone();
                async move {
                    // A full channel waits (the subscription's queue fills meanwhile,
                    // and beyond it notices are dropped and counted: SUBSCRIPTION_QUEUE); a
                    // closed one means the subscriber is gone and `tx.closed()` below ends
                    // the task.
                    match KickNotice::parse(msg.get_payload_bytes()) {
                        Some(k) => {
                            let _ = tx.send(k).await;
                        }
                        None => tracing::warn!("malformed kick notice ignored"),
                    }
                }
            });
            tokio::select! {
                _ = run => {}
                _ = tx.closed() => {}
            }
        });
        KickSubscription {
            notices: rx,
            up: up_rx,
            missed: missed_rx,
        }
    }
}

/// A subscription to an edge's takeover notices ([`RedisOwnership::kick_subscription`]).
#[derive(Debug)]
pub struct KickSubscription {
    /// The notices, in the order published.
    pub notices: mpsc::Receiver<KickNotice>,
    /// Whether the subscription is up.
    pub up: watch::Receiver<bool>,
    /// Rises whenever notices may have been missed (made again after its first time, or
    /// notices dropped by its full queue).
    pub missed: watch::Receiver<u64>,
}

#[async_trait]
impl OwnershipRegistry for RedisOwnership {
    async fn claim(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<ClaimGrant, StoreError> {
        check_edge(edge)?;
        let c = &self.conn;
        let mut inv = self.claim.prepare_invoke();
        inv.key(c.player_key("fence", player_id))
            .key(c.player_key("owner", player_id))
            .arg(hex_id(session_id))
            .arg(edge)
            .arg(ms(c.config.owner_ttl))
            .arg(c.fence_ttl_ms())
            .arg(format!("{}:edge:", c.config.prefix))
            .arg(":kick")
            .arg(player_id);
        let (fencing, prev): (u64, Option<String>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(ClaimGrant {
            fencing,
            previous: owner_from(prev)?,
        })
    }

    async fn release(
        &self,
        player_id: &str,
        session_id: &SessionId,
        fencing: u64,
    ) -> Result<bool, StoreError> {
        let c = &self.conn;
        let mut inv = self.release.prepare_invoke();
        inv.key(c.player_key("owner", player_id))
            .arg(format!("{fencing} {} ", hex_id(session_id)));
        let n: u8 = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }

    async fn owner(&self, player_id: &str) -> Result<Option<Owner>, StoreError> {
        let key = self.conn.player_key("owner", player_id);
        let rec: Option<String> = self
            .conn
            .run(|mut m| async move { m.get(key).await })
            .await?;
        Ok(owner_from(rec)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_records_and_kick_notices_parse() {
        let o = parse_owner(&format!("12 {} edge a", hex_id(&[7; 16]))).expect("owner");
        assert_eq!(
            (o.fencing, o.session_id, o.edge.as_str()),
            (12, [7; 16], "edge a")
        );
        assert!(parse_owner("x y z").is_none());
        let k = KickNotice::parse(
            format!("3 {} e1\n4\ne2\nplayer\nwith newline", hex_id(&[1; 16])).as_bytes(),
        )
        .expect("kick");
        assert_eq!(k.player_id, "player\nwith newline");
        assert_eq!((k.fencing, k.new_fencing, k.by_edge.as_str()), (3, 4, "e2"));
    }
}
