//! A short `waygate demo` run as a test: every transport, a reconnect wave, a second-login
//! kick and a backend drain, with nothing lost or duplicated.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_demo_loses_and_duplicates_nothing() {
    let report = waygate::demo::run(waygate::demo::DemoOptions {
        clients: 36,
        duration: Duration::from_secs(6),
        interval: Duration::from_millis(100),
        progress: false,
        guilds: 5,
        world_every: 2,
    })
    .await
    .unwrap();
    println!("{}", report.table());
    assert!(report.ok(), "{}", report.table());
    assert_eq!(report.transports.len(), 6, "every transport ran");
    assert!(
        report.total.restores > 0,
        "the reconnect wave resumed sessions"
    );
    assert!(
        report.switched_transport > 0,
        "some resumed over another transport"
    );
    assert_eq!(report.kicked, 1, "the second login kicked the first");
    assert!(
        report.migrated_replies_from_other_backends > 0,
        "after the drain, replies come from the remaining backends"
    );
    assert!(report.room_events > 0);
    assert!(report.channel_publications > 0, "{}", report.table());
    assert_eq!(report.channel_history_lost, 0, "one edge: memberships kept");
}

/// `waygate demo --edges 3`: three edge processes sharing a Redis started by the demo; edge 0
/// is killed with SIGKILL midway and its clients (every transport) resume on the others with
/// nothing lost or duplicated. Needs redis-server (installed by scripts/test.sh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_demo_survives_a_killed_edge() {
    let report = waygate::demo::run_cluster(
        waygate::demo::DemoOptions {
            clients: 36,
            duration: Duration::from_secs(10),
            interval: Duration::from_millis(200),
            progress: false,
            guilds: 5,
            world_every: 2,
        },
        3,
        std::path::Path::new(env!("CARGO_BIN_EXE_waygate")),
    )
    .await
    .unwrap();
    println!("{}", report.table());
    assert!(report.ok(), "{}", report.table());
    assert_eq!(report.transports.len(), 6);
    // Edge 0 held a third of the sessions; each resumed elsewhere.
    assert!(report.switched_transport >= 12, "{}", report.table());
    assert_eq!(report.total.gaps, 0);
    // Channels are per edge: the killed edge's members resume elsewhere, where their
    // channels are another epoch, and are told so (in order, never silently).
    assert!(report.channel_publications > 0, "{}", report.table());
    assert!(report.channel_history_lost > 0, "{}", report.table());
}
