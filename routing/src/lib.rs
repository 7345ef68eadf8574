//! # waygate-routing
//!
//! Owns the versioned route table: layer 1 maps a message id to a service, layer 2 maps a
//! business key (player, room, guild, order) to one instance of that service by weighted
//! rendezvous hashing, with explicit assignments, sticky bindings, epochs, health damping,
//! canaries and least-loaded policies (SPEC R1–R10).
//!
//! It must never know about sessions, sockets or transports: its table math is pure and
//! sans-IO, driven by the caller with the time passed in. It must never move a key's state
//! silently: every move is a [`Migration`] handed to the caller. And it must never change
//! where a key hashes to without failing the golden vectors (`tests/golden_rendezvous.txt`):
//! the hash is fixed and documented in [`hash`], independent of process, platform and
//! instance order.
//!
//! The only asynchronous part is the control-plane [`source`] module (tokio `watch`), which
//! loads tables and hands them to the edge; the edge applies them to its [`Router`].
//!
//! ## Map
//!
//! * [`RouteTable`] — the table (serde TOML/JSON, [`RouteTable::validate`]).
//! * [`Rendezvous`] — weighted rendezvous hashing over one service's instances.
//! * [`Router`] — the edge's state: epoch, [`Bindings`], [`MigrationPlanner`],
//!   [`HealthTracker`], weight ramps, canary, round-robin, least-loaded.
//! * [`rebalance`] — the moves implied by two tables' explicit assignments.
//! * [`source::RouteSource`] / [`source::FileRouteSource`] — the control plane.
//!
//! ## Example
//!
//! ```
//! use std::time::Instant;
//! use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig, RouteReason};
//!
//! let table = RouteTable::from_toml_str(r#"
//!     epoch = 1
//!     [[services]]
//!     name = "player"
//!     messages = [[1000, 1999]]
//!     key = "player"
//!     instances = [
//!         { id = "p1", address = "10.0.0.1:7000" },
//!         { id = "p2", address = "10.0.0.2:7000", weight = 2.0 },
//!     ]
//! "#)?;
//! let now = Instant::now();
//! let mut router = Router::new(RouterConfig::default(), now);
//! router.apply_table(table, now)?;
//! let first = router.route(1001, &RouteRequest::player("player-42"))?;
//! assert_eq!(first.epoch, 1);
//! assert_eq!(first.reason, RouteReason::Hashed);
//! // Sticky from now on, whatever tables come next, until an explicit migration.
//! let again = router.route(1500, &RouteRequest::player("player-42"))?;
//! assert_eq!((again.instance_id, again.reason), (first.instance_id, RouteReason::Bound));
//! # Ok::<(), waygate_routing::RoutingError>(())
//! ```

mod bindings;
mod error;
pub mod hash;
mod health;
mod migration;
mod rendezvous;
mod router;
pub mod source;
mod table;

pub use bindings::{Binding, Bindings};
pub use error::RoutingError;
pub use health::{HealthConfig, HealthTracker, HealthView};
pub use migration::{
    rebalance, Migration, MigrationCause, MigrationPlanner, MigrationRate, PendingMigration,
};
pub use rendezvous::Rendezvous;
pub use router::{
    ApplyReport, LoadReport, PlacementError, RouteDecision, RouteReason, RouteRequest, RouteTarget,
    Router, RouterConfig, StaleEpochAction, TargetInstance, TickReport, MAX_DYNAMIC_PINS,
};
pub use table::{
    Assignments, Canary, InstanceSpec, InstanceState, KeyKind, RouteTable, ServiceSpec,
    TableFormat, MAX_EPOCH,
};
