//! etcd as the control plane (SPEC R6, R7, R9, R10): a [`RouteSource`] that composes the
//! route table from etcd, an [`InstanceRegistry`] with leases and load reports, and the
//! least-loaded edge pick a login service uses.
//!
//! # Key layout (etcd v3, all values UTF-8)
//!
//! Everything lives under one prefix `P` (e.g. `/waygate`, no trailing slash):
//!
//! | key | value | lease | written by |
//! |---|---|---|---|
//! | `P/table` | the base [`RouteTable`], TOML or JSON (JSON if it starts with `{`) | none | operator |
//! | `P/instances/<service>/<instance id>` | [`InstanceRecord`] JSON | yes | the backend instance ([`EtcdRegistry`]) |
//! | `P/switches/<instance id>` | [`Switch`] JSON | none | operator |
//! | `P/edges/<edge id>` | [`EdgeInfo`] JSON | yes | the edge ([`EtcdRegistry::register_edge`]) |
//!
//! Example values:
//!
//! ```text
//! P/instances/game/g7  {"address":"10.0.0.7:7000","weight":1.0,"state":"active",
//!                       "capacity":5000,"load":{"players":1234,"msg_rate":810.5}}
//! P/switches/g3        {"state":"disabled"}          (also "capacity": n, "weight": w)
//! P/edges/edge-2       {"id":"edge-2","address":"203.0.113.2:443","state":"active",
//!                       "capacity":20000,"sessions":4120,"msg_rate":0.0}
//! ```
//!
//! # The effective table
//!
//! The published table is the base table plus the registered instances: a registration for a
//! service the base table defines joins that service at once (or overrides the base entry
//! with the same id), then every switch overrides state, capacity or weight of its instance
//! (base or registered). A registration of an unknown service, or whose id another service
//! already uses, or with an invalid address or weight, is ignored (logged).
//!
//! A registration that disappears (lease expired after missed keep-alives, or revoked) stays
//! in the table for the damping window (SPEC R7; K missed reports = K x report interval), so
//! a flapping instance does not churn routes; if it registers again within the window
//! nothing changes. Load reports alone never produce a new table: they are published on
//! [`EtcdRouteSource::loads`] for the router's least-loaded policy (SPEC R10).
//!
//! Epochs: every published table gets `epoch = max(previous epoch + 1, etcd revision,
//! base epoch)`, so edges that saw the same etcd history publish the same epochs, and epochs
//! only grow (also across restarts: the persisted table's epoch is the floor). The
//! [`SourceUpdate::revision`] equals the epoch.
//!
//! # Watch and failures
//!
//! The source lists the prefix once, then watches it from revision + 1. A watch that fails
//! (etcd down, connection lost, no answer to a progress request within the request timeout)
//! is re-created with exponential backoff from the last revision seen; if etcd has compacted
//! that revision the source lists the prefix again ("re-list") and continues from there.
//! Until then the last good table stays published (and persisted as JSON when configured);
//! the source never publishes an empty table because etcd is unreachable, and
//! [`SourceStatus::staleness`] is the time since etcd last answered (a watch event, a
//! progress notification or a list).
//!
//! # Where things are
//!
//! - `route_source`: [`EtcdRouteSource`] (watch, re-list, persisted last good table) and
//!   the sans-IO [`Composer`] that turns the keys into a [`RouteTable`] ([`Switch`] overrides
//!   included).
//! - `registry`: [`EtcdRegistry`], registrations under a lease and load reports, with the
//!   records it writes ([`InstanceRecord`], [`EdgeInfo`], [`Load`]).
//! - `login`: the least-loaded edge a login service sends a new client to
//!   ([`pick_least_loaded`], [`list_edges`], [`least_loaded_edge`]; the edge library serves
//!   it over HTTP).
//! - `load`: load reports ([`RateMeter`], [`spawn_load_meter`]) for the registry's
//!   reporters.
//! - this file: the error type, the key layout and the client helpers they share.
//!
//! [`RouteTable`]: waygate_routing::RouteTable
//! [`RouteSource`]: waygate_routing::source::RouteSource
//! [`InstanceRegistry`]: waygate_routing::source::InstanceRegistry
//! [`SourceUpdate::revision`]: waygate_routing::source::SourceUpdate::revision
//! [`SourceStatus::staleness`]: waygate_routing::source::SourceStatus::staleness

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use waygate_routing::RoutingError;

mod load;
mod login;
mod registry;
mod route_source;

pub use load::{spawn_load_meter, RateMeter};
pub use login::{least_loaded_edge, list_edges, pick_least_loaded};
pub use registry::{EdgeInfo, EtcdRegistry, InstanceRecord, Load};
pub use route_source::{Composer, EtcdRouteSource, EtcdSourceConfig, EtcdSourceStats, Switch};

/// Errors of the etcd control plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The etcd client reported an error (transport, gRPC status, lease not found, ...).
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer within the request timeout.
    #[error("etcd did not answer within {0:?} ({1})")]
    Timeout(Duration, &'static str),
    /// A setting is unusable.
    #[error("invalid etcd configuration: {0}")]
    Config(String),
    /// A record could not be encoded.
    #[error("record could not be encoded: {0}")]
    Json(#[from] serde_json::Error),
    /// The lease is not (or no longer) registered with this registry.
    #[error("lease {0} is not registered here")]
    NotRegistered(i64),
    /// The watch was cancelled by etcd for another reason than compaction.
    #[error("watch cancelled by etcd: {0}")]
    WatchCancelled(String),
}

impl EtcdError {
    /// As the routing crate's error (for the [`RouteSource`] / [`InstanceRegistry`] traits):
    /// an I/O error on the etcd key concerned.
    ///
    /// [`RouteSource`]: waygate_routing::source::RouteSource
    /// [`InstanceRegistry`]: waygate_routing::source::InstanceRegistry
    #[must_use]
    pub fn into_routing(self, key: &str) -> RoutingError {
        RoutingError::Io {
            path: PathBuf::from(format!("etcd:{key}")),
            source: std::io::Error::other(self.to_string()),
        }
    }
}

// ---- the client -------------------------------------------------------------------------

/// The environment variable an etcd password may come from instead of a file (edges,
/// backends and the login service alike).
pub const ETCD_PASSWORD_ENV: &str = "WAYGATE_ETCD_PASSWORD";

/// An etcd user and its password: etcd's own authentication (`etcdctl auth enable`), which
/// every client of the control plane (edge, backend registration, login service) signs in
/// with when one is configured. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// The etcd user.
    pub user: String,
    /// Its password.
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl EtcdCredentials {
    /// `user` with its password: [`ETCD_PASSWORD_ENV`] when set and not empty, else the
    /// first line of `password_file`. An empty `user` is no authentication (`None`); a user
    /// without a password, or a file that cannot be read, is an error naming its source.
    pub fn load(user: &str, password_file: Option<&Path>) -> Result<Option<Self>, EtcdError> {
        Self::load_with(
            user,
            password_file,
            std::env::var(ETCD_PASSWORD_ENV).ok().as_deref(),
        )
    }

    /// [`load`](Self::load) with the environment's password given (`None`: not set).
    pub fn load_with(
        user: &str,
        password_file: Option<&Path>,
        env_password: Option<&str>,
    ) -> Result<Option<Self>, EtcdError> {
        let user = user.trim();
        if user.is_empty() {
            return Ok(None);
        }
        let password = match env_password {
            Some(v) if !v.trim().is_empty() => v.trim().to_owned(),
            _ => {
                let Some(path) = password_file else {
                    return Err(EtcdError::Config(format!(
                        "etcd user {user:?} has no password: set a password file or \
                         {ETCD_PASSWORD_ENV}"
                    )));
                };
                let text = std::fs::read_to_string(path).map_err(|e| {
                    EtcdError::Config(format!("etcd password file {}: {e}", path.display()))
                })?;
                let line = text.lines().next().unwrap_or_default().trim().to_owned();
                if line.is_empty() {
                    return Err(EtcdError::Config(format!(
                        "etcd password file {} is empty",
                        path.display()
                    )));
                }
                line
            }
        };
        Ok(Some(Self {
            user: user.to_owned(),
            password,
        }))
    }
}

/// How a client reaches etcd beyond its endpoints: the user it signs in as, and TLS for
/// `https://` endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    /// The etcd user to sign in as; `None`: etcd without authentication.
    pub credentials: Option<EtcdCredentials>,
    /// Certificates for `https://` endpoints (unused with `http://` ones).
    pub tls: EtcdTls,
}

impl EtcdAccess {
    /// Signed in as `credentials`, TLS with the system's roots (for `https://` endpoints).
    #[must_use]
    pub fn signed_in(credentials: EtcdCredentials) -> Self {
        Self {
            credentials: Some(credentials),
            tls: EtcdTls::default(),
        }
    }
}

/// TLS to etcd (`https://` endpoints): the roots etcd's server certificate must chain to,
/// and the certificate the client presents when etcd asks for one (`--client-cert-auth`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM certificates of the CA etcd's certificate must chain to; `None`: the system's
    /// trusted roots.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate chain and PEM private key presented to etcd; `None`: none.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem", &self.ca_pem.as_ref().map(Vec::len))
            .field("identity", &self.identity.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl EtcdTls {
    /// Reads the CA file and the client certificate and key files (both or neither); an
    /// unreadable file is an error naming it.
    pub fn load(
        ca_file: Option<&Path>,
        cert_file: Option<&Path>,
        key_file: Option<&Path>,
    ) -> Result<Self, EtcdError> {
        let read = |path: &Path| {
            std::fs::read(path)
                .map_err(|e| EtcdError::Config(format!("etcd TLS file {}: {e}", path.display())))
        };
        let identity = match (cert_file, key_file) {
            (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
            (None, None) => None,
            _ => {
                return Err(EtcdError::Config(
                    "an etcd client certificate needs both its certificate and its key file".into(),
                ))
            }
        };
        Ok(Self {
            ca_pem: ca_file.map(read).transpose()?,
            identity,
        })
    }

    /// Whether anything was set (a CA or a client certificate).
    #[must_use]
    pub fn is_set(&self) -> bool {
        self.ca_pem.is_some() || self.identity.is_some()
    }
}

/// Whether the etcd client speaks TLS to `endpoint`: it starts with `https://`, exactly
/// as the client matches it (case-sensitive, nothing before it).
#[must_use]
pub fn is_https_endpoint(endpoint: &str) -> bool {
    endpoint.starts_with("https://")
}

/// Whether `endpoints` use TLS: all `https://` (true) or all not (false); a mix is refused
/// (the client would speak TLS to some members and not to others).
pub fn endpoints_use_tls(endpoints: &[String]) -> Result<bool, EtcdError> {
    match endpoints.iter().filter(|e| is_https_endpoint(e)).count() {
        0 => Ok(false),
        n if n == endpoints.len() => Ok(true),
        _ => Err(EtcdError::Config(format!(
            "etcd endpoints mix https:// and other ones (the scheme is case-sensitive): \
             {endpoints:?}"
        ))),
    }
}

/// The etcd client with a `Debug` impl (the client has none).
#[derive(Clone)]
struct Etcd(Client);

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("etcd_client::Client")
    }
}

/// Client options of the source, the registry and the login service: connect timeout and
/// keep-alive from the request timeout; a user's token is renewed when etcd refuses it
/// (it expires: after its TTL, and at every etcd restart with etcd's default tokens).
/// With `https://` endpoints, TLS verified against `cfg.access.tls`'s CA (else the system's
/// roots), presenting its client certificate if it has one.
fn connect_options(cfg: &EtcdSourceConfig) -> Result<ConnectOptions, EtcdError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(cfg.request_timeout)
        .with_keep_alive(cfg.request_timeout, cfg.request_timeout)
        .with_keep_alive_while_idle(true)
        .with_auto_token_refresh(true);
    let tls = &cfg.access.tls;
    if !endpoints_use_tls(&cfg.endpoints)? {
        if tls.is_set() {
            return Err(EtcdError::Config(
                "etcd TLS certificates are set but the endpoints are not https://".into(),
            ));
        }
        return Ok(options);
    }
    use etcd_client::{Certificate, Identity, TlsOptions};
    let mut options_tls = match &tls.ca_pem {
        Some(pem) => TlsOptions::new().ca_certificate(Certificate::from_pem(pem)),
        None => TlsOptions::new().with_native_roots(),
    };
    if let Some((cert, key)) = &tls.identity {
        options_tls = options_tls.identity(Identity::from_pem(cert, key));
    }
    Ok(options.with_tls(options_tls))
}

/// A client of `cfg.endpoints` with [`connect_options`], signed in as `cfg.access`'s user.
/// Connected lazily: etcd may be down. A user signs in at once when etcd answers (a wrong
/// user or password is an error here); while etcd cannot be reached the client starts
/// without a token and a task signs it in as soon as etcd answers (every clone of the
/// client shares the token), so an edge starts on its persisted table with etcd down.
pub async fn connect_client(cfg: &EtcdSourceConfig) -> Result<Client, EtcdError> {
    let options = connect_options(cfg)?;
    let Some(c) = &cfg.access.credentials else {
        return Ok(Client::connect(&cfg.endpoints, Some(options)).await?);
    };
    let signed_in = options
        .clone()
        .with_user(c.user.clone(), c.password.clone());
    match Client::connect(&cfg.endpoints, Some(signed_in)).await {
        Ok(client) => Ok(client),
        Err(e) if unreachable(&e) => {
            tracing::warn!(error = %e, "etcd unreachable: signing in once it answers");
            let client = Client::connect(&cfg.endpoints, Some(options)).await?;
            tokio::spawn(sign_in_when_reachable(
                client.clone(),
                c.clone(),
                cfg.backoff_min,
                cfg.backoff_max,
            ));
            Ok(client)
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether `e` says etcd could not be reached (rather than refusing the user).
fn unreachable(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
        ),
        _ => false,
    }
}

/// Signs `client` in as `user` once etcd answers, retrying with backoff while it cannot be
/// reached; ends when signed in, or when etcd refuses the user (logged: every call of the
/// client then fails, as a wrong password at start would have).
async fn sign_in_when_reachable(
    mut client: Client,
    user: EtcdCredentials,
    backoff_min: Duration,
    backoff_max: Duration,
) {
    let mut wait = backoff_min;
    loop {
        tokio::time::sleep(wait).await;
        match client
            .update_user(Some((user.user.clone(), user.password.clone())))
            .await
        {
            Ok(()) => {
                tracing::info!(user = %user.user, "signed in to etcd");
                return;
            }
            Err(e) if unreachable(&e) => wait = (wait * 2).min(backoff_max),
            Err(e) => {
                tracing::error!(user = %user.user, error = %e, "etcd refused the user");
                return;
            }
        }
    }
}

/// `f` bounded by `d` ([`EtcdError::Timeout`] naming `what` when exceeded).
async fn timed<T>(
    d: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(d, f).await {
        Ok(r) => r.map_err(EtcdError::from),
        Err(_) => Err(EtcdError::Timeout(d, what)),
    }
}

// ---- keys ---------------------------------------------------------------------------------

/// The key names under one prefix (see the key layout above).
#[derive(Debug, Clone)]
struct Keys {
    /// `P/`
    root: String,
    table: String,
    instances: String,
    switches: String,
    edges: String,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        let p = prefix.trim_end_matches('/');
        Self {
            root: format!("{p}/"),
            table: format!("{p}/table"),
            instances: format!("{p}/instances/"),
            switches: format!("{p}/switches/"),
            edges: format!("{p}/edges/"),
        }
    }
}

/// What a key under the prefix is, by the key layout ([`Keys::classify`]).
enum EtcdKey<'a> {
    Table,
    Instance { service: &'a str, id: &'a str },
    Switch(&'a str),
    Edge(&'a str),
    Other,
}

impl Keys {
    /// Which kind of key `key` is (and its service / instance / edge ids).
    fn classify<'a>(&self, key: &'a str) -> EtcdKey<'a> {
        if key == self.table {
            EtcdKey::Table
        } else if let Some(rest) = key.strip_prefix(&self.instances) {
            match rest.split_once('/') {
                Some((service, id)) if !service.is_empty() && !id.is_empty() => {
                    EtcdKey::Instance { service, id }
                }
                _ => EtcdKey::Other,
            }
        } else if let Some(id) = key.strip_prefix(&self.switches) {
            if id.is_empty() {
                EtcdKey::Other
            } else {
                EtcdKey::Switch(id)
            }
        } else if let Some(id) = key.strip_prefix(&self.edges) {
            if id.is_empty() {
                EtcdKey::Other
            } else {
                EtcdKey::Edge(id)
            }
        } else {
            EtcdKey::Other
        }
    }
}
