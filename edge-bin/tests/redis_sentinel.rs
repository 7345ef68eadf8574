//! Scale-out issue item 1 (Sentinel): the Redis backends behind Redis Sentinel (a primary,
//! a replica and three sentinels on loopback). The stores behave as on one Redis (the same
//! generic checks), and a kill -9 of the primary under a live edge with write-through
//! drops no session: the sentinels promote the replica and the edge finds it; so does a
//! SIGSTOP of the primary (it comes back as a replica, and nothing is written to it).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;
#[path = "support_pki/mod.rs"]
mod support_pki;
mod support_redis;

use std::time::Duration;

use common::failover::{new_logins_welcomed, LiveSessions};
use support_redis::sentinel::{RedisSentinels, MASTER};
use waygate_edge::cluster::redis::{RedisConfig, RedisServers, RedisStores, SentinelPrimaryAuth};
use waygate_session::testkit::store_contract::{
    ownership_semantics, snapshot_store_semantics, snapshot_store_write_through_semantics,
};
use waygate_transport::TransportKind;

fn servers(s: &RedisSentinels, password: Option<&str>) -> RedisServers {
    RedisServers::Sentinel {
        sentinels: s.urls(),
        master: MASTER.into(),
        primary_auth: password.map(|p| SentinelPrimaryAuth {
            username: None,
            password: p.into(),
        }),
    }
}

async fn sentinel_stores(s: &RedisSentinels) -> RedisStores {
    RedisStores::connect_with(RedisConfig::with_servers(servers(s, s.password.as_deref())))
        .await
        .expect("connect through the sentinels")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_work_behind_sentinel_as_on_one_redis() {
    let redis = RedisSentinels::start();
    let s = sentinel_stores(&redis).await;
    snapshot_store_semantics(s.snapshots.as_ref()).await;
    snapshot_store_write_through_semantics(s.snapshots.as_ref()).await;
    ownership_semantics(s.ownership.as_ref()).await;
    // A wrong master name is an error, not a hang.
    let wrong = RedisStores::connect_with(RedisConfig::with_servers(RedisServers::Sentinel {
        sentinels: redis.urls(),
        master: "no-such-master".into(),
        primary_auth: None,
    }))
    .await;
    assert!(
        wrong.is_err(),
        "connected to a master the sentinels do not know"
    );
}

/// A primary that requires a password: the edge's credentials reach it (and not the
/// sentinels, which have none here); without them, or with a wrong one, nothing connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_authenticate_to_a_primary_that_requires_a_password() {
    let redis = RedisSentinels::start_with_password(Some("s3cret"));
    let s = sentinel_stores(&redis).await;
    ownership_semantics(s.ownership.as_ref()).await;
    for password in [None, Some("wrong")] {
        let refused =
            RedisStores::connect_with(RedisConfig::with_servers(servers(&redis, password))).await;
        assert!(refused.is_err(), "connected with {password:?}");
    }
}

/// TLS through Sentinel (scale-out issue; before, the primary the sentinels named was
/// reached in clear whatever their URLs' scheme, and `rediss://` sentinels were checked
/// against the system's roots only): servers and sentinels on TLS ports, the sentinels
/// announcing the primary's. With `redis_tls_ca_file`'s CA the stores work through
/// `rediss://` sentinels and the primary over verified TLS; with the system's roots
/// nothing connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_that_tls_sentinels_name_is_reached_over_verified_tls() {
    let ca = support_pki::TestCa::new();
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"], "redis");
    let redis = RedisSentinels::start_tls(&support_redis::sentinel::TlsFiles {
        cert,
        key,
        ca: ca.path("ca.pem"),
    });
    assert!(redis.urls().iter().all(|u| u.starts_with("rediss://")));
    let config = |roots: Option<Vec<u8>>| RedisConfig {
        op_timeout: Duration::from_secs(2),
        tls_root_pem: roots,
        ..RedisConfig::with_servers(servers(&redis, None))
    };
    let s = RedisStores::connect_with(config(Some(ca.pem.clone().into_bytes())))
        .await
        .expect("connects through TLS sentinels");
    snapshot_store_semantics(s.snapshots.as_ref()).await;
    ownership_semantics(s.ownership.as_ref()).await;
    let untrusted = match RedisStores::connect_with(config(None)).await {
        Ok(stores) => {
            waygate_session::store::SnapshotStore::get(stores.snapshots.as_ref(), &[7; 16])
                .await
                .map(|_| ())
        }
        Err(e) => Err(waygate_session::store::StoreError::Unavailable(
            e.to_string(),
        )),
    };
    match untrusted {
        Err(e) => assert!(e.to_string().contains("certificate"), "{e}"),
        Ok(()) => panic!("a certificate of an unknown CA was accepted"),
    }
}

/// How the primary fails.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Failure {
    /// kill -9.
    Killed,
    /// SIGSTOP until the replica was promoted, then SIGCONT: the old primary comes back
    /// and the sentinels turn it into a replica (writes to it would be `READONLY`).
    Hung,
    /// kill -9 while the first sentinel the edge asks is frozen (its port takes
    /// connections and answers nothing): the other two elect and are asked in time.
    KilledWithAHungSentinel,
}

/// An edge behind the sentinels with write-through on, 24 live sessions echoing; the
/// primary fails. Every session keeps its session (no new WELCOME, no close), every echo
/// gets its reply, and once the sentinels promoted the replica, new logins work and every
/// player's owner record on the new primary names its live session.
async fn a_failed_primary_drops_no_session_of_a_live_edge(failure: Failure) {
    // The hung primary's deployment requires a password (the edge's config carries it).
    let password = (failure == Failure::Hung).then_some("s3cret");
    let mut redis = RedisSentinels::start_with_password(password);
    let urls = redis.urls();
    let (edge, _b, _d) = common::demo_edge(move |c| {
        c.cluster.redis_sentinels = urls;
        c.cluster.redis_sentinel_master = MASTER.into();
        c.cluster.redis_sentinel_master_password = password.unwrap_or_default().into();
        c.cluster.reassert_ms = 1_000;
    })
    .await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let mut live = LiveSessions::start(tcp, 24).await;
    let replica = redis.servers[1].port();

    match failure {
        Failure::Killed => redis.servers[0].stop(),
        Failure::Hung => redis.servers[0].pause(),
        Failure::KilledWithAHungSentinel => {
            redis.sentinels[0].pause();
            redis.servers[0].stop();
        }
    }
    // Traffic through the failover: the sentinels need 1 s to call the primary down, then
    // elect a leader and promote the replica.
    let rounds = live.echo_rounds(Duration::from_secs(8)).await;
    eprintln!("{failure:?}: {rounds} echo rounds of 24 sessions through the failover");
    redis.wait_primary(replica, Duration::from_secs(30));
    if failure == Failure::Hung {
        redis.servers[0].resume();
        redis.wait_replica_of(redis.servers[0].port(), replica, Duration::from_secs(30));
        let rounds = live.echo_rounds(Duration::from_secs(2)).await;
        eprintln!("{rounds} echo rounds with the old primary back as a replica");
    }

    new_logins_welcomed(tcp, 12, Duration::from_secs(15)).await;
    let s = sentinel_stores(&redis).await;
    live.assert_owners(&s.ownership, Duration::from_secs(10))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_drops_no_session_of_a_live_edge() {
    a_failed_primary_drops_no_session_of_a_live_edge(Failure::Killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_with_a_hung_sentinel_drops_no_session_of_a_live_edge() {
    a_failed_primary_drops_no_session_of_a_live_edge(Failure::KilledWithAHungSentinel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_primary_drops_no_session_of_a_live_edge() {
    a_failed_primary_drops_no_session_of_a_live_edge(Failure::Hung).await;
}
