//! The crate's one error type, grouped by who is at fault.

use std::path::PathBuf;

/// Everything that can go wrong in `waygate-routing`.
///
/// Variants are grouped by fault: a malformed or inconsistent route table (the operator or
/// the control plane), an epoch ordering problem, a routing request the table cannot serve
/// (the caller), and I/O of the file control-plane source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RoutingError {
    // ---- malformed table input -------------------------------------------------------------
    /// The table text is not valid TOML for a route table.
    #[error("route table is not valid TOML: {0}")]
    Toml(#[from] toml::de::Error),
    /// The table text is not valid JSON for a route table.
    #[error("route table is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// The table bytes are not UTF-8.
    #[error("route table is not UTF-8 text")]
    NotUtf8,
    /// The table could not be serialized (persisting the last good table).
    #[error("route table could not be serialized: {0}")]
    Serialize(#[from] toml::ser::Error),

    // ---- inconsistent table (validate) -----------------------------------------------------
    /// A service, instance or key id is empty.
    #[error("empty {what} id")]
    EmptyId {
        /// Which kind of id ("service", "instance", "pinned player", "room").
        what: &'static str,
    },
    /// Two services share a name.
    #[error("duplicate service name {service:?}")]
    DuplicateService {
        /// The repeated name.
        service: String,
    },
    /// A name refers to a service the table does not define.
    #[error("{context} refers to unknown service {service:?}")]
    UnknownService {
        /// Where the reference was found.
        context: String,
        /// The unknown name.
        service: String,
    },
    /// Instance ids must be unique across the whole table.
    #[error("duplicate instance id {instance:?} (services {first:?} and {second:?})")]
    DuplicateInstance {
        /// The repeated id.
        instance: String,
        /// Service of the first occurrence.
        first: String,
        /// Service of the second occurrence.
        second: String,
    },
    /// A message id range with `lo > hi`.
    #[error("service {service:?} has an empty message range [{lo}, {hi}]")]
    InvalidRange {
        /// The service.
        service: String,
        /// Lower bound.
        lo: u32,
        /// Upper bound.
        hi: u32,
    },
    /// Two message id ranges overlap (layer 1 must be a function).
    #[error(
        "message range [{a_lo}, {a_hi}] of {a_service:?} overlaps [{b_lo}, {b_hi}] of {b_service:?}"
    )]
    OverlappingRanges {
        /// First service.
        a_service: String,
        /// First range lower bound.
        a_lo: u32,
        /// First range upper bound.
        a_hi: u32,
        /// Second service.
        b_service: String,
        /// Second range lower bound.
        b_lo: u32,
        /// Second range upper bound.
        b_hi: u32,
    },
    /// A weight that is negative, NaN or infinite.
    #[error("instance {instance:?} has invalid weight {weight} (must be finite and >= 0)")]
    InvalidWeight {
        /// The instance.
        instance: String,
        /// The bad weight.
        weight: f64,
    },
    /// An instance address that is not `host:port`.
    #[error("instance {instance:?} has invalid address {address:?} (expected host:port)")]
    InvalidAddress {
        /// The instance.
        instance: String,
        /// The bad address.
        address: String,
    },
    /// A pin or room assignment names an instance the table does not define.
    #[error("{what} {key:?} is assigned to unknown instance {instance:?}")]
    UnknownInstance {
        /// "pinned player" or "room".
        what: &'static str,
        /// The player or room id.
        key: String,
        /// The unknown instance id.
        instance: String,
    },
    /// An assignment targets an instance of a service whose key kind does not fit
    /// (a player pinned on a room service, a room on a player service).
    #[error("{what} {key:?} is assigned to instance {instance:?} of service {service:?} whose key is {kind}")]
    AssignmentKindMismatch {
        /// "pinned player" or "room".
        what: &'static str,
        /// The player or room id.
        key: String,
        /// The instance.
        instance: String,
        /// Its service.
        service: String,
        /// The service's key kind.
        kind: crate::KeyKind,
    },
    /// A canary definition that cannot work.
    #[error("service {service:?} has an invalid canary: {reason}")]
    InvalidCanary {
        /// The service.
        service: String,
        /// Why it is invalid.
        reason: &'static str,
    },

    /// An epoch so large no later table could be newer (above [`crate::MAX_EPOCH`]):
    /// applied, it would freeze routing, every later table refused as stale.
    #[error("route table epoch {epoch} is above the largest allowed ({max})")]
    EpochTooLarge {
        /// The table's epoch.
        epoch: u64,
        /// The largest allowed.
        max: u64,
    },

    // ---- epochs ----------------------------------------------------------------------------
    /// A table whose epoch is not newer than the current one.
    #[error("stale route table: epoch {offered} is not newer than current epoch {current}")]
    StaleEpoch {
        /// The epoch in force.
        current: u64,
        /// The refused epoch.
        offered: u64,
    },

    // ---- requests the table cannot serve ---------------------------------------------------
    /// No table has been applied yet.
    #[error("no route table has been applied yet")]
    NoTable,
    /// Layer 1 has no service for this message id.
    #[error("no service handles message id {message_id}")]
    NoServiceForMessage {
        /// The message id.
        message_id: u32,
    },
    /// A service name not in the current table.
    #[error("no service named {service:?} in the current table")]
    NoSuchService {
        /// The name.
        service: String,
    },
    /// The request lacks the business key the service is keyed by.
    #[error("service {service:?} is keyed by {kind} but the request has none")]
    MissingKey {
        /// The service.
        service: String,
        /// The key kind it needs.
        kind: crate::KeyKind,
    },
    /// Every instance of the service is draining, disabled, unhealthy, weight 0 or full.
    #[error("service {service:?} has no instance that can take a new key")]
    NoEligibleInstance {
        /// The service.
        service: String,
    },

    // ---- I/O (file control plane) ----------------------------------------------------------
    /// Reading or writing a table file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}
