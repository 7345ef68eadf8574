//! SPEC R9, file control plane: hot reload, invalid file kept out, persisted last good table
//! used after a restart with a broken file. Bounded waits only (poll with a deadline).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::base_table;
use waygate_routing::source::{
    FileRouteSource, FileSourceConfig, PollOutcome, RouteSource, TableOrigin,
};
use waygate_routing::{RouteTable, RoutingError};

fn write_toml(path: &Path, t: &RouteTable) {
    // Write-then-rename so the poller never reads a half-written file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, t.to_toml_string().expect("toml")).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

fn write_raw(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[test]
fn poll_once_reload_and_invalid_kept_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("routes.toml");
    write_toml(&path, &base_table(1));
    let src = FileRouteSource::open(
        FileSourceConfig::new(&path).persist_to(dir.path().join("last-good.json")),
    );
    let rx = src.watch();
    assert_eq!(rx.borrow().table.as_ref().map(|t| t.epoch), Some(1));
    assert_eq!(src.poll_once().expect("ok"), PollOutcome::Unchanged);

    write_toml(&path, &base_table(2));
    assert!(matches!(
        src.poll_once(),
        Ok(PollOutcome::Updated { epoch: 2, .. })
    ));
    assert_eq!(rx.borrow().table.as_ref().map(|t| t.epoch), Some(2));

    // Syntax error: kept out, reported once, last good stays.
    write_raw(&path, "epoch = 3\n[[services]\n");
    assert!(matches!(src.poll_once(), Err(RoutingError::Toml(_))));
    assert!(
        matches!(src.poll_once(), Err(RoutingError::Toml(_))),
        "still reported"
    );
    let st = src.status();
    assert!(st.last_error.is_some() && st.consecutive_errors >= 2);
    assert_eq!(rx.borrow().table.as_ref().map(|t| t.epoch), Some(2));

    // Valid syntax, invalid table (overlapping ranges): kept out.
    let mut bad = base_table(3);
    bad.services[1].messages = vec![[1500, 2500]];
    write_raw(&path, &toml::to_string(&bad).expect("toml"));
    assert!(matches!(
        src.poll_once(),
        Err(RoutingError::OverlappingRanges { .. })
    ));
    // Stale epoch: kept out.
    let mut stale = base_table(2);
    stale.updated_at = 99;
    write_toml(&path, &stale);
    assert!(matches!(
        src.poll_once(),
        Err(RoutingError::StaleEpoch {
            current: 2,
            offered: 2
        })
    ));
    // Missing file: kept out.
    std::fs::remove_file(&path).expect("rm");
    assert!(matches!(src.poll_once(), Err(RoutingError::Io { .. })));
    assert_eq!(rx.borrow().table.as_ref().map(|t| t.epoch), Some(2));
    let st = src.status();
    assert!(st.staleness(Instant::now()).is_some());

    // Fixed: picked up, error cleared.
    write_toml(&path, &base_table(4));
    assert!(matches!(
        src.poll_once(),
        Ok(PollOutcome::Updated { epoch: 4, .. })
    ));
    assert_eq!(src.status().last_error, None);
    assert_eq!(src.status().consecutive_errors, 0);
}

#[test]
fn json_tables_are_read_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("routes.json");
    write_raw(&path, &base_table(9).to_json_string().expect("json"));
    let src = FileRouteSource::open(FileSourceConfig::new(&path));
    assert_eq!(
        src.watch().borrow().table.as_ref().map(|t| t.epoch),
        Some(9)
    );
}

#[test]
fn restart_with_broken_file_uses_persisted_last_good() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("routes.toml");
    let persisted = dir.path().join("state").join("last-good.json");
    std::fs::create_dir_all(persisted.parent().expect("parent")).expect("mkdir");
    let cfg = FileSourceConfig::new(&path).persist_to(&persisted);
    write_toml(&path, &base_table(1));
    let first = FileRouteSource::open(cfg.clone());
    write_toml(&path, &base_table(5));
    assert!(matches!(
        first.poll_once(),
        Ok(PollOutcome::Updated { epoch: 5, .. })
    ));
    drop(first);
    assert!(persisted.exists());

    // "Restart" with a broken source file.
    write_raw(&path, "this is not a route table");
    let second = FileRouteSource::open(cfg.clone());
    let u = second.watch().borrow().clone();
    assert_eq!(u.table.as_ref().map(|t| t.epoch), Some(5));
    assert_eq!(u.origin, TableOrigin::Persisted);
    assert!(second.status().last_error.is_some());
    assert_eq!(
        second.status().staleness(Instant::now()),
        None,
        "never read the source successfully"
    );

    // The file is repaired with the same table: it now comes from the source.
    write_toml(&path, &base_table(5));
    assert_eq!(second.poll_once().expect("ok"), PollOutcome::Unchanged);
    assert_eq!(second.watch().borrow().origin, TableOrigin::Source);

    // Missing source file at restart: persisted table too.
    std::fs::remove_file(&path).expect("rm");
    let third = FileRouteSource::open(cfg);
    assert_eq!(
        third.watch().borrow().table.as_ref().map(|t| t.epoch),
        Some(5)
    );
}

#[test]
fn hot_reload_with_the_polling_task() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("routes.toml");
        write_toml(&path, &base_table(1));
        let src = FileRouteSource::open(
            FileSourceConfig::new(&path).poll_every(Duration::from_millis(20)),
        );
        let task = src.spawn();
        let mut rx = src.watch();
        rx.borrow_and_update();
        write_raw(&path, "broken = [");
        write_toml(&path, &base_table(2));
        let deadline = Duration::from_secs(20);
        tokio::time::timeout(deadline, async {
            loop {
                rx.changed().await.expect("source alive");
                if rx.borrow_and_update().table.as_ref().map(|t| t.epoch) == Some(2) {
                    break;
                }
            }
        })
        .await
        .expect("hot reload within the deadline");
        // An invalid edit is never published.
        write_raw(&path, "epoch = 3\nservices = 7\n");
        let deadline_at = tokio::time::Instant::now() + deadline;
        while src.status().last_error.is_none() {
            assert!(
                tokio::time::Instant::now() < deadline_at,
                "error not reported"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!rx.has_changed().expect("alive"));
        assert_eq!(
            src.refresh().await.ok().map(|u| u.revision),
            None,
            "refresh reports the error"
        );
        assert_eq!(rx.borrow().table.as_ref().map(|t| t.epoch), Some(2));
        drop(src);
        tokio::time::timeout(deadline, task)
            .await
            .expect("task ends with the source")
            .expect("no panic");
    });
}
