//! The announcement log in Redis (PROTOCOL.md §12.5): one stream per channel epoch,
//! `P:{T}:ann:<channel>:<epoch>` (T: the channel name's store tag, so each stream is one
//! Redis Cluster slot), entry id `<offset>-1`, field `e` = the encoded PUBLICATION event;
//! capped at the kind's history length (`MAXLEN`) and expiring after its history TTL.
//! Every edge reads it, so a member whose edge died recovers the announcements it missed on
//! the next one. Withdrawn offsets (an append that failed or timed out, which may still
//! land) are a set beside the stream, `P:{T}:annw:<channel>:<epoch>`: a withdrawal deletes
//! the entry if it is there, and an append of a withdrawn offset adds nothing.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use waygate_channels::AnnouncementRecord;
use waygate_protocol::channel::ChannelPosition;
use waygate_session::resume::{hex_id, player_store_tag};

use super::conn::{ms, Conn};
use crate::announcements::{AnnouncementLog, AnnouncementLogError};

/// KEYS: the stream, its withdrawn set. ARGV: max length, entry id, event, ttl ms, offset.
/// Appends the entry (an entry with that id already there is the same announcement written
/// by an append that timed out: kept; a withdrawn offset: nothing added) and sets the
/// stream's expiry. Returns 1.
const APPEND_LUA: &str = r#"
if redis.call('SISMEMBER', KEYS[2], ARGV[5]) == 1 then return 1 end
local r = redis.pcall('XADD', KEYS[1], 'MAXLEN', ARGV[1], ARGV[2], 'e', ARGV[3])
if type(r) == 'table' and r.err then
  if #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) == 0 then return r end
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"#;

/// KEYS: the stream, its withdrawn set. ARGV: offset, ttl ms. Withdraws the offset: its
/// entry goes if it landed, and a later append of it adds nothing. Returns 1.
const WITHDRAW_LUA: &str = r#"
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1] .. '-1')
return 1
"#;

/// Redis [`AnnouncementLog`] (module docs).
#[derive(Debug, Clone)]
pub struct RedisAnnouncementLog {
    conn: Conn,
}

impl RedisAnnouncementLog {
    pub(super) fn from_conn(conn: Conn) -> Self {
        Self { conn }
    }

    fn key(&self, channel: &str, epoch: u64) -> String {
        self.key_of("ann", channel, epoch)
    }

    /// The withdrawn set of a stream (the same slot).
    fn withdrawn_key(&self, channel: &str, epoch: u64) -> String {
        self.key_of("annw", channel, epoch)
    }

    fn key_of(&self, what: &str, channel: &str, epoch: u64) -> String {
        format!(
            "{}:{{{}}}:{what}:{channel}:{epoch}",
            self.conn.config.prefix,
            hex_id(&player_store_tag(channel))
        )
    }
}

fn unavailable(e: impl std::fmt::Display) -> AnnouncementLogError {
    AnnouncementLogError::Unavailable(e.to_string())
}

impl RedisAnnouncementLog {
    /// Runs `script` once per record in one pipeline (per slot on a cluster), with KEYS the
    /// record's stream and withdrawn set and the ARGV `args` gives; `Ok` if every run did.
    async fn run_each(
        &self,
        records: &[AnnouncementRecord],
        script: &str,
        args: impl Fn(&mut redis::Pipeline, &AnnouncementRecord),
    ) -> Result<(), AnnouncementLogError> {
        let replies = self
            .conn
            .pipeline_each(
                records,
                |r| (self.key(&r.channel, r.position.epoch), false),
                |pipe, r| {
                    let cmd = pipe
                        .cmd("EVAL")
                        .arg(script)
                        .arg(2)
                        .arg(self.key(&r.channel, r.position.epoch))
                        .arg(self.withdrawn_key(&r.channel, r.position.epoch));
                    args(cmd, r);
                },
            )
            .await
            .map_err(unavailable)?;
        for reply in replies {
            reply.map_err(unavailable)?;
        }
        Ok(())
    }
}

#[async_trait]
impl AnnouncementLog for RedisAnnouncementLog {
    async fn append(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
        self.run_each(records, APPEND_LUA, |cmd, r| {
            cmd.arg(r.keep.max(1))
                .arg(format!("{}-1", r.position.offset))
                .arg(&r.event[..])
                .arg(ms(r.ttl))
                .arg(r.position.offset);
        })
        .await
    }

    async fn withdraw(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
        self.run_each(records, WITHDRAW_LUA, |cmd, r| {
            cmd.arg(r.position.offset).arg(ms(r.ttl).max(1));
        })
        .await
    }

    async fn after(
        &self,
        channel: &str,
        since: ChannelPosition,
        limit: usize,
    ) -> Result<Vec<AnnouncementRecord>, AnnouncementLogError> {
        let key = self.key(channel, since.epoch);
        let start = format!("{}-0", since.offset.saturating_add(1));
        let entries: Vec<(String, Vec<Vec<u8>>)> = self
            .conn
            .run(|mut m| async move {
                redis::cmd("XRANGE")
                    .arg(key)
                    .arg(start)
                    .arg("+")
                    .arg("COUNT")
                    .arg(limit)
                    .query_async(&mut m)
                    .await
            })
            .await
            .map_err(unavailable)?;
        let channel: std::sync::Arc<str> = channel.into();
        let mut out = Vec::with_capacity(entries.len());
        for (id, fields) in entries {
            let offset = id
                .split('-')
                .next()
                .and_then(|o| o.parse::<u64>().ok())
                .ok_or_else(|| AnnouncementLogError::Corrupt(format!("entry id {id}")))?;
            let event = match fields.as_slice() {
                [f, v] if f.as_slice() == b"e" => Bytes::from(v.clone()),
                _ => {
                    return Err(AnnouncementLogError::Corrupt(format!(
                        "entry {id} has no event"
                    )))
                }
            };
            out.push(AnnouncementRecord {
                channel: channel.clone(),
                position: ChannelPosition {
                    epoch: since.epoch,
                    offset,
                },
                event,
                ttl: Duration::ZERO,
                keep: 0,
            });
        }
        Ok(out)
    }
}
