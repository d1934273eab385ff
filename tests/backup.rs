//! `Store::backup`: a copy taken while writers run is one moment of the
//! store. Every call answered before the backup began is in it, each claim
//! with its effect in the application's own table (and no effect without
//! its claim), every index check passes, and the copy opens as a store;
//! bad targets are refused and nothing is left behind.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use idemstore::redb::{ReadableTable as _, TableDefinition};
use idemstore::{Durability, Error, NewEntry, Store, StoreBuilder};

/// The application's own table: event key → its effect's value.
const EFFECTS: TableDefinition<&str, u64> = TableDefinition::new("app.effects");
/// The application's blobs, rewritten by every effect: pages freed and
/// reused all the time, as a copy made beside the writers would tear.
const BLOBS: TableDefinition<u64, &[u8]> = TableDefinition::new("app.blobs");
const BLOB_ROWS: u64 = 4000;
const BLOB_LEN: usize = 4096;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn now() -> chrono::DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000, 0).unwrap()
}

/// Runs `writers` threads claiming events `w{t}-{n}` with an effect each and
/// enqueuing an entry per event, backs the store up in the middle, and
/// checks the copy against what was answered before the backup began.
fn backup_under_writers(builder: StoreBuilder, writers: u64) -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = builder.open(dir.path().join("live.idem"))?;
    store.write(|tx| {
        let mut blobs = tx.open_table(BLOBS)?;
        for i in 0..BLOB_ROWS {
            blobs.insert(i, [0u8; BLOB_LEN].as_slice())?;
        }
        Ok::<_, Error>(())
    })?;
    let stop = Arc::new(AtomicBool::new(false));
    // Per writer: the number of events answered `Ok` so far.
    let done: Arc<Vec<AtomicU64>> = Arc::new((0..writers).map(|_| AtomicU64::new(0)).collect());
    let threads: Vec<_> = (0..writers)
        .map(|w| {
            let (store, stop, done) = (store.clone(), stop.clone(), done.clone());
            thread::spawn(move || -> Result<(), Error> {
                let inbox = store.inbox("events")?;
                let outbox = store.outbox();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let key = format!("w{w}-{n}");
                    let _ = inbox.claim_with(&key, now(), |tx| {
                        tx.open_table(EFFECTS)?.insert(key.as_str(), n)?;
                        let mut blobs = tx.open_table(BLOBS)?;
                        for i in 0..8 {
                            let row = (n * 8 + i + w * 997) % BLOB_ROWS;
                            blobs.insert(
                                row,
                                [u8::try_from(n % 251).unwrap(); BLOB_LEN].as_slice(),
                            )?;
                        }
                        outbox.enqueue_in(
                            tx,
                            NewEntry::new("cmd", "hooks", &key, vec![1]),
                            now(),
                        )?;
                        Ok::<_, Error>(())
                    })?;
                    n += 1;
                    done[usize::try_from(w).unwrap()].store(n, Ordering::SeqCst);
                }
                Ok(())
            })
        })
        .collect();
    // Let the writers commit a while, then back up beside them.
    while done.iter().map(|d| d.load(Ordering::SeqCst)).sum::<u64>() < 200 {
        thread::sleep(Duration::from_millis(5));
    }
    let before: Vec<u64> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
    let copy = dir.path().join("copy.idem");
    let len = store.backup(&copy)?;
    let after: Vec<u64> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
    thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().expect("a writer thread")?;
    }
    assert_eq!(len, std::fs::metadata(&copy)?.len());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    assert_eq!(
        leftovers.len(),
        2,
        "only the store and its copy: {leftovers:?}"
    );

    let kept = check_copy(&copy, &before, &after)?;
    common::report(&format!(
        "backup beside {writers} writers: {} claims answered before, {kept} in the copy, {len} bytes",
        before.iter().sum::<u64>()
    ));
    Ok(())
}

#[test]
fn a_backup_beside_writers_is_one_moment_of_the_store() -> TestResult {
    backup_under_writers(Store::builder(), 4)
}

#[test]
fn a_backup_of_a_shared_store_is_one_moment_of_it() -> TestResult {
    backup_under_writers(Store::builder().shared(true), 2)
}

#[test]
fn a_backup_under_durability_none_holds_every_answered_call() -> TestResult {
    backup_under_writers(Store::builder().durability(Durability::None), 2)
}

#[test]
fn bad_targets_are_refused_and_leave_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("live.idem");
    let store = Store::open(&path)?;
    store.inbox("events")?.claim("e1", now())?;
    // Never over the store itself, nor over any file.
    let err = store.backup(&path).unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput { field: "to", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("exists"), "{err}");
    // A directory that does not exist: an I/O error, no temporary left.
    let err = store
        .backup(dir.path().join("missing/copy.idem"))
        .unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err}");
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 1);
    // No file to copy.
    let memory = Store::builder().in_memory()?;
    let err = memory.backup(dir.path().join("m.idem")).unwrap_err();
    assert!(
        matches!(err, Error::InvalidInput { field: "store", .. }),
        "{err}"
    );
    // Inside a write closure it would wait for itself.
    let copy = dir.path().join("copy.idem");
    let inner = store.write(|_| Ok::<_, Error>(store.backup(&copy)))?;
    assert!(matches!(inner, Err(Error::Reentrant)), "{inner:?}");
    assert!(!copy.exists());
    // The store still works, and a good target gets the copy.
    store.backup(&copy)?;
    assert!(Store::open(&copy)?.inbox("events")?.seen("e1")?);
    Ok(())
}

/// Checks the copy at `copy` against what each writer had answered before
/// the backup began (`before`) and by the time it returned (`after`);
/// returns the number of claims in it.
fn check_copy(
    copy: &std::path::Path,
    before: &[u64],
    after: &[u64],
) -> Result<usize, Box<dyn std::error::Error>> {
    let backup = Store::builder().open(copy)?;
    let inbox = backup.inbox("events")?;
    let outbox = backup.outbox();
    let effects = backup.read(|tx| {
        let table = tx.open_table(EFFECTS).map_err(Error::from)?;
        let mut out = Vec::new();
        for row in table.iter().map_err(Error::from)? {
            let (k, v) = row.map_err(Error::from)?;
            out.push((k.value().to_owned(), v.value()));
        }
        Ok::<_, Error>(out)
    })?;
    // Each claim in the copy has its effect and its entry, and no effect
    // is there without its claim.
    assert_eq!(inbox.len()?, effects.len() as u64);
    for (key, _) in &effects {
        assert!(inbox.seen(key)?, "an effect without its claim: {key}");
        assert!(
            outbox.find("hooks", key)?.is_some(),
            "a claim without its entry: {key}"
        );
    }
    // Every writer's events are a prefix: answered before the backup ⇒ in
    // it; none past what was answered by the time it returned, plus the
    // one each writer may have had in flight.
    for (w, (before, after)) in before.iter().zip(after).enumerate() {
        let kept = effects
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("w{w}-")))
            .count() as u64;
        for n in 0..kept {
            assert!(
                inbox.seen(&format!("w{w}-{n}"))?,
                "writer {w}'s events are a prefix"
            );
        }
        assert!(
            kept >= *before,
            "writer {w}: {kept} kept, {before} answered before"
        );
        assert!(
            kept <= after + 1,
            "writer {w}: {kept} kept, {after} answered after"
        );
    }
    assert_eq!(backup.check_inbox_indexes()?, Vec::<String>::new());
    assert_eq!(outbox.check_indexes()?, Vec::<String>::new());
    assert!(backup.check_integrity()?);
    Ok(effects.len())
}
