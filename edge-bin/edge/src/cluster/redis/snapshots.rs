//! The warm tier of session snapshots (SPEC S5, S7): [`RedisSnapshotStore`] writes fenced
//! snapshots that expire after the linger time (and makes a detached owner record expire
//! with them), and takes a snapshot at most once across all edges (compare the resume-token
//! hash and delete in one script).

use std::time::Duration;

use async_trait::async_trait;
use redis::{AsyncCommands as _, Script};
use waygate_protocol::frame::SessionId;
use waygate_session::resume::{hex_id, player_store_tag, session_store_tag, ResumeHash};
use waygate_session::store::{ResumeKeys, Snapshot, SnapshotStore, StoreError, TakeOutcome};

use super::conn::{ms, Conn};
use super::{RedisConfig, RedisError};

/// KEYS: fence, snap, owner. ARGV: fencing, ttl ms, hash hex, prev hash hex or '', data,
/// "<fencing> <session hex> ", last resume nonce. Returns 1 (written) or 0 (fenced: the player or the stored
/// snapshot is newer). A written snapshot's session, if it owns the player, gets its owner
/// record's expiry set to the snapshot's (the linger time starts now).
const PUT_LUA: &str = r#"
local f = tonumber(ARGV[1])
local c = redis.call('GET', KEYS[1])
if c and tonumber(c) > f then return 0 end
local sf = redis.call('HGET', KEYS[2], 'f')
if sf and tonumber(sf) > f then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'f', ARGV[1], 'h', ARGV[3], 'p', ARGV[4], 'n', ARGV[7], 'd', ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
local cur = redis.call('GET', KEYS[3])
if cur and string.sub(cur, 1, #ARGV[6]) == ARGV[6] then
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return 1
"#;

/// KEYS: snap. ARGV: hash hex. Returns {0} not found, {2} mismatch, {1, data} taken.
const TAKE_LUA: &str = r#"
local v = redis.call('HMGET', KEYS[1], 'h', 'p', 'd')
if not v[3] then return {0, false} end
if v[1] == ARGV[1] or (v[2] and v[2] ~= '' and v[2] == ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return {1, v[3]}
end
return {2, false}
"#;

/// KEYS: snap. ARGV: fencing or ''. Returns 1 if deleted.
const DELETE_LUA: &str = r#"
if ARGV[1] == '' then return redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[1], 'f') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// The PUT script's KEYS and ARGV for one snapshot.
struct PutArgs {
    keys: [String; 3],
    args: [Vec<u8>; 7],
}

/// The stored form of a snapshot (field `d`): CBOR, payloads as byte strings.
fn encode(snapshot: &Snapshot) -> Result<Vec<u8>, RedisError> {
    let mut out = Vec::with_capacity(256);
    ciborium::into_writer(snapshot, &mut out)
        .map_err(|e| RedisError::Invalid(format!("snapshot: {e}")))?;
    Ok(out)
}

/// Reads a stored snapshot: CBOR, or the JSON an edge before 0.2.1 wrote (a rolling upgrade
/// resumes its sessions too).
fn decode_any(data: &[u8]) -> Result<Snapshot, String> {
    if data.first() == Some(&b'{') {
        serde_json::from_slice(data).map_err(|e| e.to_string())
    } else {
        ciborium::from_reader(data).map_err(|e| e.to_string())
    }
}

fn put_outcome(n: u8) -> Result<(), RedisError> {
    if n == 1 {
        Ok(())
    } else {
        Err(RedisError::Fenced)
    }
}

/// Redis [`SnapshotStore`] (warm tier, SPEC S7).
///
/// `put` is fenced too: a snapshot whose fencing token is older than the player's counter
/// (or than the stored snapshot's) is refused with [`StoreError::Fenced`],
/// so a stale owner cannot overwrite what a newer one wrote.
#[derive(Debug)]
pub struct RedisSnapshotStore {
    conn: Conn,
}

/// The snapshot scripts (hashed once; loaded into Redis on first use).
struct Scripts {
    put: Script,
    take: Script,
    delete: Script,
}

fn scripts() -> &'static Scripts {
    static S: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    S.get_or_init(|| Scripts {
        put: Script::new(PUT_LUA),
        take: Script::new(TAKE_LUA),
        delete: Script::new(DELETE_LUA),
    })
}

impl RedisSnapshotStore {
    pub(super) fn from_conn(conn: Conn) -> Self {
        Self { conn }
    }

    /// A store alone (see [`RedisStores`](super::RedisStores) for all three sharing a connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self {
            conn: Conn::new(config)?,
        })
    }

    /// Writes `snapshot` unless it is fenced; see [`SnapshotStore::put`].
    pub async fn put_fenced(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), RedisError> {
        let put = self.put_args(snapshot, ttl)?;
        let mut inv = scripts().put.prepare_invoke();
        for k in &put.keys {
            inv.key(k);
        }
        for a in &put.args {
            inv.arg(a);
        }
        let n: u8 = self
            .conn
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        put_outcome(n)
    }

    /// The PUT script's keys and arguments for `snapshot`.
    fn put_args(&self, snapshot: &Snapshot, ttl: Duration) -> Result<PutArgs, RedisError> {
        let c = &self.conn;
        // The script touches the player's fence and owner records and the snapshot: one
        // slot only if the session id carries the player's store tag (as minted).
        if session_store_tag(&snapshot.session_id) != player_store_tag(&snapshot.player_id) {
            return Err(RedisError::Invalid(format!(
                "session {} does not carry the store tag of player {:?}",
                hex_id(&snapshot.session_id),
                snapshot.player_id
            )));
        }
        let data = encode(snapshot)?;
        Ok(PutArgs {
            keys: [
                c.player_key("fence", &snapshot.player_id),
                c.session_key("snap", &snapshot.session_id),
                c.player_key("owner", &snapshot.player_id),
            ],
            args: [
                snapshot.fencing.to_string().into_bytes(),
                ms(ttl).to_string().into_bytes(),
                hex_id(&snapshot.resume_hash.0).into_bytes(),
                snapshot
                    .prev_resume_hash
                    .map_or(String::new(), |h| hex_id(&h.0))
                    .into_bytes(),
                data,
                format!("{} {} ", snapshot.fencing, hex_id(&snapshot.session_id)).into_bytes(),
                snapshot.last_resume_nonce.to_string().into_bytes(),
            ],
        })
    }

    /// Writes many snapshots in one round trip (one pipeline of the PUT script, one per
    /// hash tag on a cluster): the write-through's group commit. One result per snapshot.
    pub async fn put_many_fenced(
        &self,
        snapshots: &[Snapshot],
        ttl: Duration,
    ) -> Vec<Result<(), RedisError>> {
        let mut results: Vec<Result<(), RedisError>> = Vec::with_capacity(snapshots.len());
        let mut puts = Vec::with_capacity(snapshots.len());
        for (i, s) in snapshots.iter().enumerate() {
            match self.put_args(s, ttl) {
                Ok(p) => {
                    results.push(Ok(()));
                    puts.push((i, p));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let hash = scripts().put.get_hash().to_owned();
        let replies = self
            .conn
            .pipeline_each(
                &puts,
                |(_, p)| p.keys[1].clone(),
                |pipe, (_, p)| {
                    pipe.cmd("EVALSHA")
                        .arg(&hash)
                        .arg(p.keys.len())
                        .arg(&p.keys[..])
                        .arg(&p.args[..]);
                },
            )
            .await;
        let replies = match replies {
            Ok(r) => r,
            Err(e) => {
                for (i, _) in &puts {
                    results[*i] = Err(e.clone());
                }
                return results;
            }
        };
        for ((i, _), reply) in puts.iter().zip(replies) {
            results[*i] = match reply.and_then(|v| Ok(redis::from_redis_value::<u8>(v)?)) {
                Ok(n) => put_outcome(n),
                // A Redis that lost its scripts (restarted, failed over): load it again
                // through the one-by-one path, which does.
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    self.put_fenced(&snapshots[*i], ttl).await
                }
                Err(e) => Err(e.into()),
            };
        }
        results
    }

    fn decode(session_id: &SessionId, data: &[u8]) -> Result<Snapshot, RedisError> {
        let s: Snapshot = decode_any(data)
            .map_err(|e| RedisError::Corrupt(format!("snapshot {}: {e}", hex_id(session_id))))?;
        if s.session_id != *session_id {
            return Err(RedisError::Corrupt(format!(
                "snapshot under {} holds {}",
                hex_id(session_id),
                hex_id(&s.session_id)
            )));
        }
        Ok(s)
    }
}

#[async_trait]
impl SnapshotStore for RedisSnapshotStore {
    async fn put(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), StoreError> {
        Ok(self.put_fenced(snapshot, ttl).await?)
    }

    async fn put_many(&self, snapshots: &[Snapshot], ttl: Duration) -> Vec<Result<(), StoreError>> {
        self.put_many_fenced(snapshots, ttl)
            .await
            .into_iter()
            .map(|r| r.map_err(StoreError::from))
            .collect()
    }

    async fn get(&self, session_id: &SessionId) -> Result<Option<Snapshot>, StoreError> {
        let key = self.conn.session_key("snap", session_id);
        let data: Option<Vec<u8>> = self
            .conn
            .run(|mut m| async move { m.hget(key, "d").await })
            .await?;
        Ok(data.map(|d| Self::decode(session_id, &d)).transpose()?)
    }

    async fn take(
        &self,
        session_id: &SessionId,
        resume_hash: &ResumeHash,
    ) -> Result<TakeOutcome, StoreError> {
        let c = &self.conn;
        let mut inv = scripts().take.prepare_invoke();
        inv.key(c.session_key("snap", session_id))
            .arg(hex_id(&resume_hash.0));
        let (code, data): (u8, Option<Vec<u8>>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        match (code, data) {
            (1, Some(j)) => Ok(TakeOutcome::Taken(Box::new(Self::decode(session_id, &j)?))),
            (2, _) => Ok(TakeOutcome::Mismatch),
            (0, _) => Ok(TakeOutcome::NotFound),
            (other, _) => Err(RedisError::Corrupt(format!("take answered {other}")).into()),
        }
    }

    /// One HMGET of the key fields: the snapshot's data (up to its replay buffer) is read
    /// only when the proof holds and it is taken.
    async fn resume_keys(&self, session_id: &SessionId) -> Result<Option<ResumeKeys>, StoreError> {
        let key = self.conn.session_key("snap", session_id);
        let (h, p, n): (Option<String>, Option<String>, Option<u64>) = self
            .conn
            .run(|mut m| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("h")
                    .arg("p")
                    .arg("n")
                    .query_async(&mut m)
                    .await
            })
            .await?;
        let Some(h) = h else {
            return Ok(None);
        };
        let parse = |hex: &str| {
            unhex32(hex).ok_or_else(|| {
                StoreError::from(RedisError::Corrupt(format!(
                    "snapshot {} resume key {hex:?}",
                    hex_id(session_id)
                )))
            })
        };
        Ok(Some(ResumeKeys {
            current: ResumeHash(parse(&h)?),
            previous: match p.as_deref() {
                None | Some("") => None,
                Some(p) => Some(ResumeHash(parse(p)?)),
            },
            last_nonce: n.unwrap_or(0),
        }))
    }

    async fn delete(
        &self,
        session_id: &SessionId,
        fencing: Option<u64>,
    ) -> Result<bool, StoreError> {
        let c = &self.conn;
        let mut inv = scripts().delete.prepare_invoke();
        inv.key(c.session_key("snap", session_id))
            .arg(fencing.map_or(String::new(), |f| f.to_string()));
        let n: u8 = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }
}

/// 32 bytes from 64 hex digits.
fn unhex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
