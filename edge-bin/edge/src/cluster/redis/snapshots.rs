//! The warm tier of session snapshots (SPEC S5, S7): [`RedisSnapshotStore`] writes fenced
//! snapshots that expire after the linger time (and makes a detached owner record expire
//! with them), and takes a snapshot at most once across all edges (compare the resume-token
//! hash and delete in one script).
//!
//! A snapshot is one Redis hash: the resume keys (`h`, `p`, `n`) and fencing token (`f`)
//! as fields of their own (with the edges' shared secret, `cluster.redis_resume_key_file`,
//! `h` and `p` are match tags and the keys themselves are only in `k` and `q`, sealed, and
//! not in `d`: [`ResumeKeySeal`](super::ResumeKeySeal)), the snapshot without its replay
//! entries and counters (`d`, postcard), the replay counters and upstream window (`c`), each replay entry in a field
//! `e<seq>`, the range of seqs those fields hold (`r`), and the ids of the session's last
//! pushes (`u`, postcard, when it has any) and the player id (`l`). The write-through
//! writes a delta when it can ([`SnapshotWrite::since`]): the entries added and `c`, and
//! `d` and `u` only if they changed, with the entry ranges before and after (which entries
//! to drop and to add follows from them: no entry is named), applied only if the stored
//! range is still the one the delta starts from (else the write is made whole). So one
//! message costs Redis its own bytes plus the session's small header, never the whole
//! replay buffer.
//! A group commit's deltas go in PUT_DELTAS calls, packed, the keys named in the script: on
//! one Redis one call for the group, on a cluster one per master (by the slot map the
//! connection keeps; one per hash tag, keys declared, until it has one or when a slot moved).

use std::time::Duration;

use async_trait::async_trait;
use redis::{AsyncCommands as _, Script};
use waygate_protocol::frame::SessionId;
use waygate_protocol::varint::put_varint;
use waygate_session::replay::{ReplayBuffer, ReplayCounters, ReplayEntry};
use waygate_session::resume::{hex_id, player_store_tag, session_store_tag, ResumeHash};
use waygate_session::seq::RecvWindow;
use waygate_session::store::{
    ResumeKeys, Snapshot, SnapshotStore, SnapshotWrite, StoreError, TakeOutcome,
};

use super::conn::{hash_tag, key_slot, ms, Conn};
use super::{RedisConfig, RedisError};

/// Lua shared by the write scripts. `expire_with_the_snapshot`: the snapshot expires after
/// the linger time, and so does the player's owner record if this session owns it (the
/// owner record starts with "<fencing> <session hex> ", the session hex ends the
/// snapshot's key). `apply_delta`: one delta of PUT_DELTAS (a table, see PUT_DELTAS),
/// given the stored record's fencing token and entry range (`f`, `r`, read by the caller),
/// answering 1 (applied), 0 (fenced: the player or the stored snapshot is newer) or 2 (the
/// stored record is not the one the delta starts from, or — `fence_required`, for keys the
/// call did not declare — the player has no fence: write it whole). It drops the entries
/// of the range it starts from that the new range does not hold, adds those of the new
/// range the old one did not hold (their values in seq order, as [`span_delta`] says),
/// sets the other fields given, replaces `c` (and `d` unless it is ''), and sets the
/// expiries as PUT does. Seqs are formatted with `%d` (exact below 2^53; a Lua number
/// concatenated as is would print 1e+15).
macro_rules! write_functions {
    () => {
        r#"
local function expire_with_the_snapshot(snap, owner, fencing, ttl)
  redis.call('PEXPIRE', snap, ttl)
  local o = fencing .. ' ' .. string.match(snap, '[^:]*$') .. ' '
  local cur = redis.call('GET', owner)
  if cur and string.sub(cur, 1, #o) == o then
    redis.call('PEXPIRE', owner, ttl)
  end
end
local function fmt(n) return string.format('%d', n) end
local function span(first, count)
  if count == 0 then return '' end
  return fmt(first) .. '-' .. fmt(first + count - 1)
end
-- Calls each(seq) for the seqs of [a, b] outside [c, d], increasing.
local function minus(a, b, c, d, each)
  if d < c then
    for s = a, b do each(s) end
    return
  end
  for s = a, math.min(b, c - 1) do each(s) end
  for s = math.max(a, d + 1), b do each(s) end
end
local function apply_delta(fence, snap, owner, stored_f, stored_r, d, ttl, fence_required)
  local c = redis.call('GET', fence)
  if not c and fence_required then return 2 end
  if c and tonumber(c) > d.f then return 0 end
  if not stored_f then return 2 end
  if tonumber(stored_f) > d.f then return 0 end
  if tonumber(stored_f) ~= d.f or stored_r ~= span(d.ff, d.fc) then return 2 end
  local fl, tl = d.ff + d.fc - 1, d.tf + d.tc - 1
  local n = 0
  minus(d.tf, tl, d.ff, fl, function() n = n + 1 end)
  if n ~= #d.values then error('the delta holds ' .. #d.values .. ' entries for ' .. n .. ' new seqs') end
  minus(d.ff, fl, d.tf, tl, function(s) redis.call('HDEL', snap, 'e' .. fmt(s)) end)
  local i = 0
  minus(d.tf, tl, d.ff, fl, function(s)
    i = i + 1
    redis.call('HSET', snap, 'e' .. fmt(s), d.values[i])
  end)
  for j = 1, #d.fields, 2 do redis.call('HSET', snap, d.fields[j], d.fields[j + 1]) end
  if d.data ~= '' then redis.call('HSET', snap, 'd', d.data) end
  redis.call('HSET', snap, 'r', span(d.tf, d.tc), 'c', d.counters)
  expire_with_the_snapshot(snap, owner, fmt(d.f), ttl)
  return 1
end
"#
    };
}

/// KEYS: fence, snap, owner. ARGV: fencing, ttl ms, hash hex, prev hash hex or '', data,
/// last resume nonce, entry range, counters, then field and value pairs of the replay
/// entries (and `u`, `l`, and the sealed keys `k` and `q`).
/// Replaces the whole record. Returns 1 (written) or 0 (fenced: the player or the stored
/// snapshot is newer). A written snapshot's session, if it owns the player, gets its owner
/// record's expiry set to the snapshot's (the linger time starts now).
const PUT_LUA: &str = concat!(
    write_functions!(),
    r#"
local f = tonumber(ARGV[1])
local c = redis.call('GET', KEYS[1])
if c and tonumber(c) > f then return 0 end
local sf = redis.call('HGET', KEYS[2], 'f')
if sf and tonumber(sf) > f then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'f', ARGV[1], 'h', ARGV[3], 'p', ARGV[4], 'n', ARGV[6], 'd', ARGV[5], 'r', ARGV[7], 'c', ARGV[8])
for i = 9, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
expire_with_the_snapshot(KEYS[2], KEYS[3], ARGV[1], ARGV[2])
return 1
"#
);

/// PUT_DELTAS' body (after the shared functions).
macro_rules! put_deltas_body {
    () => {
        r#"
local ttl, b = ARGV[1], ARGV[2]
local declared = #KEYS > 1
local prefix, tag
if not declared then
  local first_tag
  prefix, first_tag = string.match(KEYS[1] or ARGV[3], '^(.*):{(%x+)}:snap:%x+$')
  tag = #first_tag
end
local pos = 1
local function varint()
  local v, m = 0, 1
  for _ = 1, 8 do
    local x = string.byte(b, pos)
    if not x then error('packed deltas: truncated') end
    pos = pos + 1
    if x < 128 then return v + x * m end
    v = v + (x - 128) * m
    m = m * 128
  end
  error('packed deltas: a varint over 56 bits')
end
local function bytes(n)
  if pos + n - 1 > #b then error('packed deltas: truncated') end
  local s = string.sub(b, pos, pos + n - 1)
  pos = pos + n
  return s
end
local function str() return bytes(varint()) end
-- Every delta is read before any is applied: a blob that does not end where the last
-- delta does (the edge and the script disagree on the format) changes nothing.
local deltas = {}
for s = 1, varint() do
  local d = {}
  d.sid = bytes(16)
  d.f, d.ff, d.fc, d.tf, d.tc = varint(), varint(), varint(), varint(), varint()
  d.data, d.counters = str(), str()
  d.fields, d.values = {}, {}
  for i = 1, 2 * varint() do d.fields[i] = str() end
  for i = 1, varint() do d.values[i] = str() end
  deltas[s] = d
end
if pos ~= #b + 1 then error('packed deltas: ' .. (#b + 1 - pos) .. ' bytes after the last delta') end
local out = {}
for s, d in ipairs(deltas) do
  local sid = d.sid
  local function one()
    if declared then
      local snap = KEYS[3 * s - 1]
      local v = redis.call('HMGET', snap, 'f', 'r')
      return apply_delta(KEYS[3 * s - 2], snap, KEYS[3 * s], v[1], v[2], d, ttl, false)
    end
    local hex = string.format(string.rep('%02x', #sid), string.byte(sid, 1, #sid))
    local slot = prefix .. ':{' .. string.sub(hex, 1, tag) .. '}:'
    local snap = slot .. 'snap:' .. hex
    local v = redis.call('HMGET', snap, 'f', 'r', 'l')
    if not v[3] then return 2 end
    -- Keys named here are not declared: one read as absent (a slot being imported, were
    -- the call ever run after ASKING) must not pass the fencing check, so a missing fence
    -- makes the write whole (declared keys, redirected properly).
    return apply_delta(slot .. 'fence:' .. v[3], snap, slot .. 'owner:' .. v[3], v[1], v[2], d, ttl, true)
  end
  local ok, r = pcall(one)
  out[s] = ok and r or 3
end
return out
"#
    };
}

/// The deltas of one or many sessions in one call. Either the script names each session's
/// keys itself, from its session id and the player id the record holds in `l` (a record
/// without it, written by an older edge, counts as a missing base), with the key prefix and
/// store tag length a sample snapshot key shows: on one Redis, KEYS is that key alone; on a
/// cluster, for the deltas of one master's slots, KEYS is empty and the key is ARGV[3]
/// (nothing declared, so the call is not redirected and never runs after `ASKING`: a key
/// the node does not serve, or a key of a slot being moved that is not here, fails the
/// command that reads it — that delta answers 3 — and is never read as absent). Or, on a
/// cluster for the deltas of one hash tag, KEYS are every delta's fence, snapshot and owner
/// keys in turn: declared, so a slot being moved redirects the call before it runs.
/// ARGV: ttl ms, the deltas packed by [`pack_deltas`][, the sample key].
/// Returns one answer per delta, in order (see `apply_delta`; 3: Redis refused one of its
/// commands, or the delta was inconsistent — its earlier writes may stand, so the edge
/// writes that session whole next).
const PUT_DELTAS_LUA: &str = concat!(write_functions!(), put_deltas_body!());

/// KEYS: snap. ARGV: the resume key as the record may store it (its match tags with the
/// edges' secrets, the sealing one's first, else hex). Returns {0} not found, {2} mismatch,
/// {1, the record's fields and values} taken (padded to two elements).
const TAKE_LUA: &str = r#"
local v = redis.call('HMGET', KEYS[1], 'h', 'p', 'd')
if not v[3] then return {0, false} end
for i = 1, #ARGV do
  if v[1] == ARGV[i] or (v[2] and v[2] ~= '' and v[2] == ARGV[i]) then
    local all = redis.call('HGETALL', KEYS[1])
    redis.call('DEL', KEYS[1])
    return {1, all}
  end
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

/// First byte of field `d` in the current layout: the snapshot without its replay
/// entries, postcard-encoded; the entries are in fields `e<seq>`. (`{` starts the JSON an
/// edge before 0.2.1 wrote, a CBOR map the whole snapshot of 0.2.1.)
const LAYOUT_POSTCARD: u8 = 2;

/// What one write sends: a whole record (PUT's KEYS and ARGV) or a delta (packed, with
/// others of its slot, into a PUT_DELTAS call).
enum PutArgs {
    Whole {
        keys: [String; 3],
        args: Vec<Vec<u8>>,
    },
    Delta(DeltaArgs),
}

/// One session's delta as PUT_DELTAS takes it (see [`pack_deltas`]).
struct DeltaArgs {
    /// Its fence, snapshot and owner keys (the snapshot's routes the call; on one Redis
    /// the script names the others itself).
    keys: [String; 3],
    session_id: SessionId,
    fencing: u64,
    /// The entry range the delta starts from, and the record's after it (`r`), as
    /// [`EntrySpan`]s: which entries it drops and adds follows from them ([`span_delta`]).
    from: EntrySpan,
    to: EntrySpan,
    /// Field `d` if it changed, else empty.
    data: Vec<u8>,
    counters: Vec<u8>,
    /// Other fields set (`u`), as field and value pairs.
    fields: Vec<(&'static [u8], Vec<u8>)>,
    /// The values of the entries added, in seq order.
    values: Vec<Vec<u8>>,
}

/// The seqs of the replay entries a record holds, which are contiguous (field `r`):
/// the first and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EntrySpan {
    first: u64,
    count: u64,
}

impl EntrySpan {
    fn of(replay: &ReplayBuffer) -> Self {
        let mut entries = replay.entries();
        match (entries.next(), entries.next_back()) {
            (Some(first), last) => Self {
                first: first.seq,
                count: last.map_or(1, |l| l.seq - first.seq + 1),
            },
            _ => Self { first: 0, count: 0 },
        }
    }

    /// The seq after its last (its first when it holds none).
    fn end(self) -> u64 {
        self.first.saturating_add(self.count)
    }

    /// Its seqs (empty when it holds none).
    fn seqs(self) -> std::ops::Range<u64> {
        self.first..self.end()
    }
}

/// The seqs a delta from `from` to `to` drops (held before, not after) and adds (held
/// after, not before), each increasing: what PUT_DELTAS' `minus` derives, so a delta
/// names no entry. A replay buffer holds contiguous seqs ([`ReplayBuffer::delta_since`]
/// relies on it too), so each is at most two runs.
///
/// [`ReplayBuffer::delta_since`]: waygate_session::replay::ReplayBuffer::delta_since
fn span_delta(
    from: EntrySpan,
    to: EntrySpan,
) -> (impl Iterator<Item = u64>, impl Iterator<Item = u64>) {
    let minus = |a: EntrySpan, b: EntrySpan| {
        let other = b.seqs();
        a.seqs().filter(move |s| !other.contains(s))
    };
    (minus(from, to), minus(to, from))
}

/// Numbers PUT_DELTAS reads exactly (Lua's are doubles): a delta whose fencing token or entry
/// seqs reach it is written whole ([`RedisSnapshotStore::put_args`]).
const EXACT_IN_LUA: u64 = 1 << 53;

/// At most this many deltas in one PUT_DELTAS call (a bound on the time one script holds
/// Redis): a whole group commit.
const DELTAS_PER_CALL: usize = waygate_session::write_through::MAX_GROUP;

/// Packs deltas for PUT_DELTAS: their count, then for each the session id (16 bytes), the
/// fencing token, the two entry spans (first seq and count each), data, counters, the
/// number of other fields and their field and value pairs, the number of entries added and
/// their values. Every number is a varint (LEB128) and every string follows its length as
/// one: a 64 B reply costs its own bytes and ~40 of the session's. The script reads
/// numbers as Lua's doubles, so each must stay below 2^53 (fencing tokens are microseconds
/// of the Unix clock, ~2^51 now; seqs count messages; `put_args` writes whole a delta
/// whose span ends reach it, since the script adds first and count).
fn pack_deltas<'a>(
    deltas: impl ExactSizeIterator<Item = &'a DeltaArgs>,
) -> Result<Vec<u8>, RedisError> {
    fn num(out: &mut Vec<u8>, n: u64) -> Result<(), RedisError> {
        if n >= EXACT_IN_LUA {
            return Err(RedisError::Invalid(format!(
                "a delta's number {n} is not exact in Redis' Lua (2^53 or more)"
            )));
        }
        put_varint(out, n);
        Ok(())
    }
    fn string(out: &mut Vec<u8>, s: &[u8]) -> Result<(), RedisError> {
        num(out, s.len() as u64)?;
        out.extend_from_slice(s);
        Ok(())
    }
    let mut out = Vec::new();
    num(&mut out, deltas.len() as u64)?;
    for d in deltas {
        out.extend_from_slice(&d.session_id);
        for n in [
            d.fencing,
            d.from.first,
            d.from.count,
            d.to.first,
            d.to.count,
        ] {
            num(&mut out, n)?;
        }
        string(&mut out, &d.data)?;
        string(&mut out, &d.counters)?;
        num(&mut out, d.fields.len() as u64)?;
        for (field, value) in &d.fields {
            string(&mut out, field)?;
            string(&mut out, value)?;
        }
        num(&mut out, d.values.len() as u64)?;
        for value in &d.values {
            string(&mut out, value)?;
        }
    }
    Ok(out)
}

/// Field `d`: the snapshot without its replay entries and without the counters that move
/// with every message (those are field `c`), so a delta re-sends it only when something
/// else changed (bindings, channels, pending errors...).
/// Sealed resume keys (`sealed`) are not in it: they are zeroed there, and taken from
/// fields `k` and `q` when the record is read.
fn encode_header(snapshot: &Snapshot, sealed: bool) -> Result<Vec<u8>, RedisError> {
    let mut bare = snapshot.clone();
    if sealed {
        bare.resume_hash = ResumeHash([0; 32]);
        bare.prev_resume_hash = bare.prev_resume_hash.map(|_| ResumeHash([0; 32]));
    }
    bare.replay.detach_entries();
    bare.replay.set_counters(ReplayCounters::default());
    bare.upstream = RecvWindow::new();
    postcard::to_extend(&bare, vec![LAYOUT_POSTCARD])
        .map_err(|e| RedisError::Invalid(format!("snapshot: {e}")))
}

/// Field `c`: the replay counters and the upstream window.
fn encode_counters(snapshot: &Snapshot) -> Result<Vec<u8>, RedisError> {
    postcard::to_allocvec(&(snapshot.replay.counters(), &snapshot.upstream))
        .map_err(|e| RedisError::Invalid(format!("snapshot counters: {e}")))
}

/// A replay entry's field name and value.
fn encode_entry(entry: &ReplayEntry) -> Result<(Vec<u8>, Vec<u8>), RedisError> {
    let value = postcard::to_allocvec(entry)
        .map_err(|e| RedisError::Invalid(format!("replay entry: {e}")))?;
    Ok((entry_field(entry.seq), value))
}

/// Field `u`: the ids of the session's last pushes ([`Snapshot::push_ids`]).
const PUSH_IDS_FIELD: &[u8] = b"u";
/// Field `l`: the player id (in `d` too), so PUT_DELTAS names the player's records without
/// being sent it. Not `e...`: those are replay entries.
const PLAYER_FIELD: &[u8] = b"l";
/// Fields `k` and `q`: the current and previous resume keys, sealed (with a shared key).
const SEALED_KEY_FIELD: &[u8] = b"k";
const SEALED_PREV_FIELD: &[u8] = b"q";

fn encode_push_ids(snapshot: &Snapshot) -> Result<Vec<u8>, RedisError> {
    postcard::to_allocvec(&snapshot.push_ids)
        .map_err(|e| RedisError::Invalid(format!("push ids: {e}")))
}

fn entry_field(seq: u64) -> Vec<u8> {
    format!("e{seq}").into_bytes()
}

/// Field `r`: the seqs of the entry fields a record holds, `first-last` (PUT_DELTAS' `span`
/// writes the same).
fn entry_range(snapshot: &Snapshot) -> Vec<u8> {
    let span = EntrySpan::of(&snapshot.replay);
    if span.count == 0 {
        return Vec::new();
    }
    format!("{}-{}", span.first, span.end() - 1).into_bytes()
}

/// Reads a stored record (its fields and values): the current layout, or the whole
/// snapshot in `d` that older edges wrote (CBOR, or JSON before 0.2.1), so a rolling
/// upgrade resumes their sessions too.
fn decode_record(fields: Vec<(Vec<u8>, Vec<u8>)>) -> Result<Snapshot, String> {
    let mut data = None;
    let mut counters = None;
    let mut entries = Vec::new();
    let mut push_ids = Vec::new();
    for (field, value) in fields {
        if field == PUSH_IDS_FIELD {
            // Only a retry's dedup depends on them: a session is not lost for them.
            push_ids = postcard::from_bytes(&value).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "snapshot push ids unreadable: dropped");
                Vec::new()
            });
        } else if field == b"d" {
            data = Some(value);
        } else if field == b"c" {
            counters = Some(
                postcard::from_bytes::<(ReplayCounters, RecvWindow)>(&value)
                    .map_err(|e| format!("counters: {e}"))?,
            );
        } else if field.first() == Some(&b'e') {
            entries.push(
                postcard::from_bytes::<ReplayEntry>(&value)
                    .map_err(|e| format!("replay entry: {e}"))?,
            );
        }
    }
    let data = data.ok_or("no field d")?;
    let mut s: Snapshot = match data.split_first() {
        Some((&LAYOUT_POSTCARD, rest)) => {
            let mut s: Snapshot = postcard::from_bytes(rest).map_err(|e| e.to_string())?;
            if let Some((replay, upstream)) = counters {
                s.replay.set_counters(replay);
                s.upstream = upstream;
            }
            s.replay
                .attach_entries(entries)
                .map_err(|e| e.to_string())?;
            s
        }
        Some((b'{', _)) => serde_json::from_slice(&data).map_err(|e| e.to_string())?,
        _ => ciborium::from_reader(&data[..]).map_err(|e| e.to_string())?,
    };
    // Whatever the layout, a restore relies on the replay buffer's and the window's
    // invariants (a corrupt or foreign record overflowed their seqs: panic audit).
    s.replay
        .check()
        .map_err(|e| format!("replay buffer: {e}"))?;
    if !s.upstream.is_consistent() {
        return Err("upstream window inconsistent".into());
    }
    s.push_ids = push_ids;
    Ok(s)
}

/// A flat field, value, field, value... reply as pairs.
fn pairs(flat: Vec<Vec<u8>>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(f), Some(v)) = (it.next(), it.next()) {
        out.push((f, v));
    }
    out
}

/// The scripts touch the player's fence and owner records and the session's snapshot: one
/// slot only if the session id carries the player's store tag (as minted).
fn check_store_tag(snapshot: &Snapshot) -> Result<(), RedisError> {
    if session_store_tag(&snapshot.session_id) != player_store_tag(&snapshot.player_id) {
        return Err(RedisError::Invalid(format!(
            "session {} does not carry the store tag of player {:?}",
            hex_id(&snapshot.session_id),
            snapshot.player_id
        )));
    }
    Ok(())
}

fn put_outcome(n: u8) -> Result<(), RedisError> {
    match n {
        1 => Ok(()),
        0 => Err(RedisError::Fenced),
        DELTA_REFUSED => Err(RedisError::Corrupt(
            "Redis refused a command of the delta (a record of another type?), or the delta \
             did not hold one value per entry its ranges add"
                .into(),
        )),
        other => Err(RedisError::Corrupt(format!(
            "a write script answered {other}"
        ))),
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
    put_deltas: Script,
    take: Script,
    delete: Script,
}

fn scripts() -> &'static Scripts {
    static S: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    S.get_or_init(|| Scripts {
        put: Script::new(PUT_LUA),
        put_deltas: Script::new(PUT_DELTAS_LUA),
        take: Script::new(TAKE_LUA),
        delete: Script::new(DELETE_LUA),
    })
}

/// What PUT_DELTAS answers for a delta whose base is not the stored record.
const DELTA_BASE_MISSING: u8 = 2;
/// What PUT_DELTAS answers for a delta one of whose commands Redis refused (its `pcall`).
const DELTA_REFUSED: u8 = 3;

impl RedisSnapshotStore {
    pub(super) fn from_conn(conn: Conn) -> Self {
        Self { conn }
    }

    /// A sealed resume key of the session, opened with the edges' shared key.
    fn open_key(&self, session_id: &SessionId, sealed: &str) -> Result<ResumeHash, RedisError> {
        match &self.conn.config.resume_key_seal {
            Some(seal) => seal.open(session_id, sealed),
            None => Err(RedisError::Corrupt(format!(
                "snapshot {}: its resume keys are sealed and this edge has no \
                 cluster.redis_resume_key_file (edges must share it)",
                hex_id(session_id)
            ))),
        }
    }

    /// A store alone (see [`RedisStores`](super::RedisStores) for all three sharing a connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self {
            conn: Conn::new(config)?,
        })
    }

    /// Writes `snapshot` whole unless it is fenced; see [`SnapshotStore::put`].
    pub async fn put_fenced(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), RedisError> {
        let (keys, args) = self.whole_args(snapshot, ttl)?;
        let mut inv = scripts().put.prepare_invoke();
        for k in &keys {
            inv.key(k);
        }
        for a in &args {
            inv.arg(a);
        }
        put_outcome(
            self.conn
                .run(|mut m| async move { inv.invoke_async::<u8>(&mut m).await })
                .await?,
        )
    }

    /// What writes `snapshot`: a delta from `since` when that is an
    /// earlier write of the same session with the same fencing token and resume keys (only
    /// the replay entries and the rest of the snapshot can change in a delta), else the
    /// whole record.
    fn put_args(
        &self,
        snapshot: &Snapshot,
        since: Option<&Snapshot>,
        ttl: Duration,
    ) -> Result<PutArgs, RedisError> {
        let seal = self.conn.config.resume_key_seal.as_deref();
        let base = since.filter(|b| {
            b.session_id == snapshot.session_id
                && b.player_id == snapshot.player_id
                && b.fencing == snapshot.fencing
                && b.resume_hash == snapshot.resume_hash
                && b.prev_resume_hash == snapshot.prev_resume_hash
                && b.last_resume_nonce == snapshot.last_resume_nonce
        });
        let Some(base) = base else {
            let (keys, args) = self.whole_args(snapshot, ttl)?;
            return Ok(PutArgs::Whole { keys, args });
        };
        check_store_tag(snapshot)?;
        let delta = snapshot.replay.delta_since(&base.replay);
        let (from, to) = (EntrySpan::of(&base.replay), EntrySpan::of(&snapshot.replay));
        // The script reads numbers as Lua doubles, and derives the entries from the spans:
        // a delta with a number it cannot hold exactly, or one the spans do not describe
        // (never, while replay buffers hold contiguous seqs), is written whole.
        let exact = [snapshot.fencing, from.end(), to.end()]
            .into_iter()
            .all(|n| n < EXACT_IN_LUA);
        let (dropped, added) = span_delta(from, to);
        let described = delta.dropped.iter().copied().eq(dropped)
            && delta.added.iter().map(|e| e.seq).eq(added);
        if !described {
            tracing::warn!(
                session = %hex_id(&snapshot.session_id),
                ?from,
                ?to,
                "a replay delta its entry spans do not describe: written whole"
            );
        }
        if !(exact && described) {
            let (keys, args) = self.whole_args(snapshot, ttl)?;
            return Ok(PutArgs::Whole { keys, args });
        }
        let header = encode_header(snapshot, seal.is_some())?;
        let changed = header != encode_header(base, seal.is_some())?;
        let mut values = Vec::with_capacity(delta.added.len());
        for e in delta.added {
            values.push(encode_entry(e)?.1);
        }
        let mut fields = Vec::new();
        if snapshot.push_ids != base.push_ids {
            fields.push((PUSH_IDS_FIELD, encode_push_ids(snapshot)?));
        }
        Ok(PutArgs::Delta(DeltaArgs {
            keys: self.keys(snapshot),
            session_id: snapshot.session_id,
            fencing: snapshot.fencing,
            from,
            to,
            data: if changed { header } else { Vec::new() },
            counters: encode_counters(snapshot)?,
            fields,
            values,
        }))
    }

    /// The player's fence, the session's snapshot and the player's owner record.
    fn keys(&self, snapshot: &Snapshot) -> [String; 3] {
        let c = &self.conn;
        [
            c.player_key("fence", &snapshot.player_id),
            c.session_key("snap", &snapshot.session_id),
            c.player_key("owner", &snapshot.player_id),
        ]
    }

    /// PUT's keys and arguments for `snapshot` whole.
    fn whole_args(
        &self,
        snapshot: &Snapshot,
        ttl: Duration,
    ) -> Result<([String; 3], Vec<Vec<u8>>), RedisError> {
        check_store_tag(snapshot)?;
        let c = &self.conn;
        let keys = self.keys(snapshot);
        let seal = c.config.resume_key_seal.as_deref();
        let sid = &snapshot.session_id;
        let stored = |key: &ResumeHash| match seal {
            Some(seal) => seal.match_tag(sid, key),
            None => hex_id(&key.0),
        };
        let mut args = Vec::with_capacity(12 + 2 * snapshot.replay.len());
        args.extend([
            snapshot.fencing.to_string().into_bytes(),
            ms(ttl).to_string().into_bytes(),
            stored(&snapshot.resume_hash).into_bytes(),
            snapshot
                .prev_resume_hash
                .map_or(String::new(), |h| stored(&h))
                .into_bytes(),
            encode_header(snapshot, seal.is_some())?,
            snapshot.last_resume_nonce.to_string().into_bytes(),
            entry_range(snapshot),
            encode_counters(snapshot)?,
        ]);
        for e in snapshot.replay.entries() {
            let (field, value) = encode_entry(e)?;
            args.extend([field, value]);
        }
        if !snapshot.push_ids.is_empty() {
            args.extend([PUSH_IDS_FIELD.to_vec(), encode_push_ids(snapshot)?]);
        }
        args.extend([
            PLAYER_FIELD.to_vec(),
            snapshot.player_id.as_bytes().to_vec(),
        ]);
        if let Some(seal) = seal {
            args.extend([
                SEALED_KEY_FIELD.to_vec(),
                seal.seal(sid, &snapshot.resume_hash)?.into_bytes(),
            ]);
            if let Some(prev) = &snapshot.prev_resume_hash {
                args.extend([
                    SEALED_PREV_FIELD.to_vec(),
                    seal.seal(sid, prev)?.into_bytes(),
                ]);
            }
        }
        Ok((keys, args))
    }

    /// Makes many writes in one round trip (one pipeline of script calls, one pipeline per
    /// master or hash tag on a cluster): the write-through's group commit. One result per
    /// write. The deltas go in PUT_DELTAS calls, packed (the keys named in the script, no
    /// command per session): up to 256 sessions a call, on one Redis the group's, on a
    /// cluster one master's (with the slot map; else, or after the master's call failed or
    /// met a key its node does not serve, one hash tag's, keys declared, or the session
    /// whole); a whole record is a PUT call of its own. A delta whose base Redis no longer holds
    /// is made again whole, and a script Redis lost (restarted, failed over) is sent again
    /// as its text (EVAL, which loads it): both in one more pipeline for the whole group,
    /// never one round trip per write, so a Redis that comes back empty costs a group three
    /// round trips at most (four on a cluster when a master's call failed first: it goes
    /// again by hash tag), each bounded by the op timeout.
    pub async fn put_many_fenced(
        &self,
        writes: &[SnapshotWrite],
        ttl: Duration,
    ) -> Vec<Result<(), RedisError>> {
        /// One command of a round: a whole record on its own, or deltas of one group in
        /// one PUT_DELTAS call (with their indices into the round, and packed). Each with
        /// whether it goes as the script's text.
        enum Call<'a> {
            Whole(usize, &'a [String; 3], &'a [Vec<u8>], bool),
            /// With whether it holds a master's slots (keys named in the script).
            Deltas(Vec<(usize, &'a DeltaArgs)>, Vec<u8>, bool, bool),
        }
        /// Which deltas share a call: all (one Redis), a cluster master's, a hash tag's.
        #[derive(PartialEq, Eq)]
        enum Group<'a> {
            All,
            Master(usize),
            Tag(&'a str),
        }
        let cluster = self.conn.is_cluster();
        let mut results: Vec<Result<(), RedisError>> = Vec::with_capacity(writes.len());
        // (write index, its script call, sent as the script's text, by hash tag)
        let mut round: Vec<(usize, PutArgs, bool, bool)> = Vec::with_capacity(writes.len());
        for (i, w) in writes.iter().enumerate() {
            match self.put_args(&w.snapshot, w.since.as_deref(), ttl) {
                Ok(p) => {
                    results.push(Ok(()));
                    round.push((i, p, false, false));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let ttl_arg = ms(ttl).to_string();
        // The slot map, read once per commit (a failed call marks it stale for the next).
        let masters = if cluster {
            self.conn.node_groups()
        } else {
            None
        };
        // EVALSHA; then EVAL for lost scripts and whole writes for lost bases (also lost
        // scripts' deltas whose base is gone); on a cluster a call for a master's slots
        // that failed (a slot moved) goes again by hash tag first: four rounds at most.
        for _ in 0..4 {
            if round.is_empty() {
                break;
            }
            let mut calls = Vec::new();
            // Deltas by (sent as text, group), in the round's order.
            type Members<'a> = Vec<(usize, &'a DeltaArgs)>;
            let mut groups: Vec<((bool, Group<'_>), Members<'_>)> = Vec::new();
            for (r, (_, p, text, by_tag)) in round.iter().enumerate() {
                match p {
                    PutArgs::Whole { keys, args } => calls.push(Call::Whole(r, keys, args, *text)),
                    PutArgs::Delta(d) => {
                        let master = masters
                            .as_ref()
                            .filter(|_| !by_tag)
                            .and_then(|m| m.master_of(key_slot(&d.keys[1])));
                        let group = match (cluster, master) {
                            (false, _) => Group::All,
                            (true, Some(m)) => Group::Master(m),
                            (true, None) => Group::Tag(hash_tag(&d.keys[1])),
                        };
                        let group = (*text, group);
                        match groups.iter_mut().find(|(g, _)| *g == group) {
                            Some((_, members)) => members.push((r, d)),
                            None => groups.push((group, vec![(r, d)])),
                        }
                    }
                }
            }
            for ((text, group), members) in &groups {
                let cross = matches!(group, Group::Master(_));
                for chunk in members.chunks(DELTAS_PER_CALL) {
                    match pack_deltas(chunk.iter().map(|&(_, d)| d)) {
                        Ok(blob) => calls.push(Call::Deltas(chunk.to_vec(), blob, *text, cross)),
                        Err(e) => {
                            for &(r, _) in chunk {
                                results[round[r].0] = Err(e.clone());
                            }
                        }
                    }
                }
            }
            let replies = self
                .conn
                .pipeline_each(
                    &calls,
                    // A master's call goes alone: were the other commands of a shared
                    // pipeline redirected by ASK, the client would send the whole pipeline
                    // again after ASKING.
                    |call| match call {
                        Call::Whole(_, keys, ..) => (keys[1].clone(), false),
                        Call::Deltas(members, _, _, cross) => (
                            members
                                .first()
                                .map_or(String::new(), |(_, d)| d.keys[1].clone()),
                            *cross,
                        ),
                    },
                    |pipe, call| match call {
                        Call::Deltas(members, blob, text, cross) => {
                            let cmd = if *text {
                                pipe.cmd("EVAL").arg(PUT_DELTAS_LUA)
                            } else {
                                pipe.cmd("EVALSHA").arg(scripts().put_deltas.get_hash())
                            };
                            let sample = members.first().map_or("", |(_, d)| &d.keys[1]);
                            if *cross {
                                // Nothing declared (the script names the keys): sent to the
                                // master of the sample's slot (`pipeline_each` routes by it).
                                cmd.arg(0).arg(&ttl_arg).arg(&blob[..]).arg(sample);
                                return;
                            }
                            if cluster {
                                // Every key declared: one slot (one hash tag per call).
                                cmd.arg(3 * members.len());
                                for (_, d) in members {
                                    cmd.arg(&d.keys[..]);
                                }
                            } else {
                                // The first snapshot key: the prefix, for the script.
                                cmd.arg(1).arg(sample);
                            }
                            cmd.arg(&ttl_arg).arg(&blob[..]);
                        }
                        Call::Whole(_, keys, args, text) => {
                            let cmd = if *text {
                                pipe.cmd("EVAL").arg(PUT_LUA)
                            } else {
                                pipe.cmd("EVALSHA").arg(scripts().put.get_hash())
                            };
                            cmd.arg(keys.len()).arg(&keys[..]).arg(&args[..]);
                        }
                    },
                )
                .await;
            let replies = match replies {
                Ok(r) => r,
                Err(e) => {
                    for (i, ..) in &round {
                        results[*i] = Err(e.clone());
                    }
                    return results;
                }
            };
            // Each write's answer in the round: its script's number, or what Redis refused.
            let mut answers: Vec<Option<Result<u8, redis::RedisError>>> =
                std::iter::repeat_with(|| None).take(round.len()).collect();
            // Writes whose call held a master's slots: (its call failed, so it goes again
            // by hash tag; it was in such a call).
            let mut by_master = vec![(false, false); round.len()];
            for (call, reply) in calls.iter().zip(replies) {
                match call {
                    Call::Whole(r, ..) => {
                        answers[*r] =
                            Some(reply.and_then(|v| Ok(redis::from_redis_value::<u8>(v)?)));
                    }
                    Call::Deltas(members, _, _, cross) => {
                        let each = reply.and_then(|v| Ok(redis::from_redis_value::<Vec<i64>>(v)?));
                        let failed = *cross
                            && each.as_ref().is_err_and(|e| {
                                e.kind()
                                    != redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
                            });
                        if failed {
                            self.conn.node_group_failed();
                        }
                        for &(r, _) in members {
                            by_master[r] = (failed, *cross);
                        }
                        for (j, &(r, _)) in members.iter().enumerate() {
                            answers[r] = Some(match &each {
                                Ok(codes) => codes
                                    .get(j)
                                    .map(|&c| u8::try_from(c).unwrap_or(u8::MAX))
                                    .ok_or_else(|| {
                                        redis::RedisError::from((
                                            redis::ErrorKind::Parse,
                                            "PUT_DELTAS answered fewer writes than it was given",
                                        ))
                                    }),
                                Err(e) => Err(e.clone()),
                            });
                        }
                    }
                }
            }
            let mut again = Vec::new();
            for (((i, put, text, was_by_tag), answer), (retag, by_master)) in
                round.into_iter().zip(answers).zip(by_master)
            {
                let Some(answer) = answer else {
                    continue; // not sent: its result is set already (it could not be packed)
                };
                match answer {
                    // The master's call failed as a whole (the node is gone, or the answer
                    // was lost: a delta that did land then finds its base moved on and is
                    // written whole).
                    Err(_) if retag => again.push((i, put, text, true)),
                    // A key the node does not serve (a slot moved since the map was read):
                    // the session is written whole, by hash tag (its delta may have been
                    // applied in part).
                    Ok(DELTA_REFUSED) if by_master => {
                        self.conn.node_group_failed();
                        match self.put_args(&writes[i].snapshot, None, ttl) {
                            Ok(whole) => again.push((i, whole, true, true)),
                            Err(e) => results[i] = Err(e),
                        }
                    }
                    Err(e)
                        if !text
                            && e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        again.push((i, put, true, was_by_tag));
                    }
                    Ok(DELTA_BASE_MISSING) if matches!(put, PutArgs::Delta(_)) => {
                        match self.put_args(&writes[i].snapshot, None, ttl) {
                            Ok(whole) => again.push((i, whole, true, was_by_tag)),
                            Err(e) => results[i] = Err(e),
                        }
                    }
                    Ok(n) => results[i] = put_outcome(n),
                    Err(e) => results[i] = Err(e.into()),
                }
            }
            round = again;
        }
        for (i, ..) in round {
            results[i] = Err(RedisError::Corrupt(
                "a write still needed another round after four".into(),
            ));
        }
        results
    }

    fn decode(
        &self,
        session_id: &SessionId,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<Snapshot, RedisError> {
        let sealed = |name: &[u8]| {
            fields
                .iter()
                .find(|(f, _)| f == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        let (key, prev) = (sealed(SEALED_KEY_FIELD), sealed(SEALED_PREV_FIELD));
        let mut s: Snapshot = decode_record(fields)
            .map_err(|e| RedisError::Corrupt(format!("snapshot {}: {e}", hex_id(session_id))))?;
        if let Some(key) = key {
            let open = |text: &str| self.open_key(session_id, text);
            s.resume_hash = open(&key)?;
            s.prev_resume_hash = prev.as_deref().map(open).transpose()?;
        }
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

    async fn put_many(
        &self,
        writes: &[SnapshotWrite],
        ttl: Duration,
    ) -> Vec<Result<(), StoreError>> {
        self.put_many_fenced(writes, ttl)
            .await
            .into_iter()
            .map(|r| r.map_err(StoreError::from))
            .collect()
    }

    async fn get(&self, session_id: &SessionId) -> Result<Option<Snapshot>, StoreError> {
        let key = self.conn.session_key("snap", session_id);
        let flat: Vec<Vec<u8>> = self
            .conn
            .run(|mut m| async move { m.hgetall(key).await })
            .await?;
        if flat.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.decode(session_id, pairs(flat))?))
    }

    async fn take(
        &self,
        session_id: &SessionId,
        resume_hash: &ResumeHash,
    ) -> Result<TakeOutcome, StoreError> {
        let c = &self.conn;
        let mut inv = scripts().take.prepare_invoke();
        // Only match tags go to Redis when the edges share a secret (both secrets' during a
        // rotation): the key itself would show in MONITOR, the slow log, or on the wire.
        inv.key(c.session_key("snap", session_id))
            .arg(match &c.config.resume_key_seal {
                Some(seal) => seal.match_tags(session_id, resume_hash),
                None => vec![hex_id(&resume_hash.0)],
            });
        let (code, fields): (u8, Option<Vec<Vec<u8>>>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        match (code, fields) {
            (1, Some(f)) => Ok(TakeOutcome::Taken(Box::new(
                self.decode(session_id, pairs(f))?,
            ))),
            (2, _) => Ok(TakeOutcome::Mismatch),
            (0, _) => Ok(TakeOutcome::NotFound),
            (other, _) => Err(RedisError::Corrupt(format!("take answered {other}")).into()),
        }
    }

    /// One HMGET of the key fields: the snapshot's data (up to its replay buffer) is read
    /// only when the proof holds and it is taken. Sealed keys are opened; with the edges'
    /// secret, a record holding its keys in clear (written by an edge without the secret,
    /// or by anyone else who can write to Redis) is not restorable: its keys are not
    /// trusted.
    async fn resume_keys(&self, session_id: &SessionId) -> Result<Option<ResumeKeys>, StoreError> {
        let key = self.conn.session_key("snap", session_id);
        type Fields = (
            Option<String>,
            Option<String>,
            Option<u64>,
            Option<String>,
            Option<String>,
        );
        let (h, p, n, k, q): Fields = self
            .conn
            .run(|mut m| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("h")
                    .arg("p")
                    .arg("n")
                    .arg(SEALED_KEY_FIELD)
                    .arg(SEALED_PREV_FIELD)
                    .query_async(&mut m)
                    .await
            })
            .await?;
        let Some(h) = h else {
            return Ok(None);
        };
        if let Some(k) = k {
            return Ok(Some(ResumeKeys {
                current: self.open_key(session_id, &k)?,
                previous: q.map(|q| self.open_key(session_id, &q)).transpose()?,
                last_nonce: n.unwrap_or(0),
            }));
        }
        if self.conn.config.resume_key_seal.is_some() {
            tracing::info!(
                session = %hex_id(session_id),
                "snapshot with resume keys in clear: not restorable by an edge with the \
                 edges' secret (written before it was set?)"
            );
            return Ok(None);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;
    use waygate_session::replay::ReplayLimits;
    use waygate_transport::TrafficClass;

    /// What a replay buffer goes through between two writes.
    #[derive(Debug, Clone)]
    enum Change {
        Push(u8),
        Ack(u16),
        Lose(u8),
    }

    fn change() -> impl Strategy<Value = Change> {
        prop_oneof![
            (0u8..40).prop_map(Change::Push),
            any::<u16>().prop_map(Change::Ack),
            (0u8..5).prop_map(Change::Lose),
        ]
    }

    proptest! {
        /// The entries PUT_DELTAS derives from two entry spans are the ones
        /// `delta_since` names, whatever the buffer went through (pushes past its limit,
        /// acks, declared losses) between the writes.
        #[test]
        fn span_delta_names_what_delta_since_names(
            writes in prop::collection::vec(prop::collection::vec(change(), 0..6), 1..12)
        ) {
            let limits = ReplayLimits { max_messages: 32, max_bytes: 1 << 20 };
            let mut buf = ReplayBuffer::new(limits);
            for changes in writes {
                let before = buf.clone();
                for c in changes {
                    match c {
                        Change::Push(n) => {
                            for _ in 0..n {
                                buf.push(TrafficClass::Normal, 1, Bytes::from_static(b"x"));
                            }
                        }
                        Change::Ack(k) => {
                            let ack = u64::from(k) % (buf.highest_sent() + 1);
                            buf.ack(ack).expect("an ack of a sent seq");
                        }
                        Change::Lose(n) => buf.declare_lost(u64::from(n)),
                    }
                }
                let delta = buf.delta_since(&before);
                let (dropped, added) = span_delta(EntrySpan::of(&before), EntrySpan::of(&buf));
                prop_assert_eq!(delta.dropped.clone(), dropped.collect::<Vec<_>>());
                prop_assert_eq!(
                    delta.added.iter().map(|e| e.seq).collect::<Vec<_>>(),
                    added.collect::<Vec<_>>()
                );
            }
        }
    }
}
