//! Space under churn: a queue that is filled and drained for a long time,
//! and an inbox that is claimed into and pruned, keep their file size
//! bounded; `Store::compact` gives the space of purged records back.
//!
//! `IDEMSTORE_CHURN_CYCLES` sets the number of entries (and inbox keys) to
//! cycle through (and, a fifth of it, the entries compaction reclaims); the
//! default keeps each test within seconds in a debug build. Nothing here holds a read transaction across iterations.

mod common;

use std::path::Path;

use chrono::{DateTime, TimeZone, Utc};
use idemstore::{Durability, NewEntry, Result, Settlement, Store};

/// Entries (and inbox keys) cycled through by default.
const DEFAULT_CYCLES: u64 = 5_000;
/// Entries or keys per commit.
const BATCH: u64 = 250;
/// The final size may be at most this many times the size after warm-up.
const GROWTH_BOUND: u64 = 3;

fn t(secs: u64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_700_000_000 + i64::try_from(secs).unwrap(), 0)
        .unwrap()
}

fn cycles() -> u64 {
    std::env::var("IDEMSTORE_CHURN_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CYCLES)
        .max(10 * BATCH)
}

fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

fn open(path: &Path) -> Result<Store> {
    Store::builder().durability(Durability::None).open(path)
}

/// Runs `batches` rounds of `round(store, i)`, syncing after each, and
/// returns the file size after the first tenth (the warm-up) and at the end.
fn churn(
    store: &Store,
    path: &Path,
    batches: u64,
    mut round: impl FnMut(&Store, u64) -> Result<()>,
) -> Result<(u64, u64)> {
    let warm_up = (batches / 10).max(1);
    let mut warm_size = 0;
    for i in 0..batches {
        round(store, i)?;
        // What a `Durability::None` store's flusher does on its interval,
        // done here at a fixed pace so the test is deterministic.
        store.sync()?;
        if i + 1 == warm_up {
            warm_size = file_size(path);
        }
    }
    Ok((warm_size, file_size(path)))
}

#[test]
fn outbox_churn_keeps_the_file_bounded() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("churn.idem");
    let store = open(&path)?;
    let outbox = store.outbox();
    let total = cycles();
    let batches = total / BATCH;
    let started = std::time::Instant::now();
    let (warm, end) = churn(&store, &path, batches, |_, i| {
        let now = t(i);
        let entries = (0..BATCH).map(|j| {
            let n = i * BATCH + j;
            NewEntry::new(
                format!("cmd-{n}"),
                "mail",
                format!("key-{n}"),
                vec![7u8; 64],
            )
        });
        let enqueued = outbox.enqueue_many(entries, now)?;
        assert!(enqueued.iter().all(idemstore::Enqueued::is_new));
        let claimed = outbox.claim_due(now, usize::try_from(BATCH).unwrap(), "w")?;
        assert_eq!(claimed.len() as u64, BATCH);
        let settled = outbox.settle_many(
            claimed.iter().map(|e| (e.fence(), Settlement::Completed)),
            now,
        )?;
        assert!(settled.iter().all(Result::is_ok));
        // Everything completed before this round is purged.
        let purged = outbox.purge_finished(now)?;
        assert_eq!(purged, if i == 0 { 0 } else { BATCH });
        Ok(())
    })?;
    common::report(&format!(
        "outbox churn: {} enqueue→claim→complete→purge cycles in {batches} batches of {BATCH} in {:.1?}; \
         file {warm} bytes after warm-up, {end} bytes at the end",
        batches * BATCH,
        started.elapsed()
    ));
    assert_eq!(
        outbox.counts()?.total(),
        BATCH,
        "the last batch awaits its purge"
    );
    assert!(outbox.check_indexes()?.is_empty());
    assert!(
        end <= GROWTH_BOUND * warm,
        "the file grew from {warm} to {end} bytes under churn"
    );
    Ok(())
}

#[test]
fn inbox_claim_and_prune_keeps_the_file_bounded() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inbox.idem");
    inbox_churn(&open(&path)?, &path, "inbox churn")
}

#[test]
fn journaled_claims_and_prunes_keep_the_file_bounded() -> Result<()> {
    // Durable, so claims go to the journal, which a claim merges into the
    // ledger every 100 entries (and `prune` before it prunes).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.idem");
    let store = Store::builder().journal_size(100).open(&path)?;
    inbox_churn(&store, &path, "journaled inbox churn (durable)")
}

/// Claims a batch of fresh keys a round and prunes the round before (one
/// batch of history stays), then checks the file stayed bounded.
fn inbox_churn(store: &Store, path: &Path, what: &str) -> Result<()> {
    let inbox = store.inbox("webhooks")?;
    let batches = cycles() / BATCH;
    let started = std::time::Instant::now();
    let (warm, end) = churn(store, path, batches, |_, i| {
        let keys: Vec<String> = (0..BATCH)
            .map(|j| format!("evt-{}", i * BATCH + j))
            .collect();
        assert!(inbox.claim_many(&keys, t(i))?.iter().all(|f| *f));
        assert_eq!(inbox.prune(t(i))?, if i == 0 { 0 } else { BATCH });
        Ok(())
    })?;
    common::report(&format!(
        "{what}: {} claim→prune cycles in {batches} batches of {BATCH} in {:.1?}; \
         file {warm} bytes after warm-up, {end} bytes at the end",
        batches * BATCH,
        started.elapsed()
    ));
    assert_eq!(inbox.len()?, BATCH);
    assert!(store.check_inbox_indexes()?.is_empty());
    assert!(
        end <= GROWTH_BOUND * warm,
        "the file grew from {warm} to {end} bytes under churn"
    );
    Ok(())
}

#[test]
fn compact_returns_the_space_of_purged_entries() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("compact.idem");
    let store = open(&path)?;
    let outbox = store.outbox();
    // A fifth of the churn's cycles, in whole thousands: 2,000 by default,
    // 40,000 in CI's full-size run.
    let entries: u64 = (cycles() / 5).max(2_000) / 1000 * 1000;
    for b in 0..entries / 1000 {
        let batch = (0..1000).map(|j| {
            let n = b * 1000 + j;
            NewEntry::new("cmd", "mail", format!("key-{n}"), vec![1u8; 512])
        });
        outbox.enqueue_many(batch, t(0))?;
        let claimed = outbox.claim_due(t(0), 1000, "w")?;
        outbox.settle_many(
            claimed.iter().map(|e| (e.fence(), Settlement::Completed)),
            t(0),
        )?;
    }
    store.sync()?;
    let full = file_size(&path);
    assert_eq!(outbox.purge_finished(t(1))?, entries);
    store.sync()?;
    let purged = file_size(&path);
    // The first compaction may leave pages the allocator still tracks;
    // redb's own tests compact until it reports nothing more to do.
    let mut rounds = 0;
    while store.compact()? {
        rounds += 1;
        assert!(rounds < 10, "compact kept finding work");
    }
    let compacted = file_size(&path);
    common::report(&format!(
        "compact: {entries} entries of 512 bytes: file {full} bytes full, {purged} bytes after \
         purge, {compacted} bytes after {rounds} compactions"
    ));
    assert!(purged >= full / 2, "purge alone does not shrink the file");
    assert!(
        compacted * 4 < full,
        "compact left {compacted} of {full} bytes"
    );
    // The store still works after compaction.
    assert!(outbox.counts()?.total() == 0);
    outbox.enqueue(NewEntry::new("cmd", "mail", "again", b"x".to_vec()), t(2))?;
    assert!(outbox.check_indexes()?.is_empty());
    drop((outbox, store));
    let store = open(&path)?;
    assert_eq!(store.outbox().counts()?.pending, 1);
    Ok(())
}
