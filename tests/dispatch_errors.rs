//! A running dispatcher keeps its errors: a store call that fails in a
//! worker, the reaper or the janitor is in its stats with its time (by the
//! dispatcher's clock) and what failed, and a thread that panicked is
//! `Error::Panicked` when it is joined.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{eventually_some, t};
use crossbeam_channel::Receiver;
use idemstore::redb::{ReadableTable as _, TableDefinition, TableHandle as _};
use idemstore::{
    Clock, Delivery, Dispatcher, Error, Janitor, ManualClock, NewEntry, OutboxStatus, Result, Store,
};

/// Polls `probe` until it gives a value; the dispatcher runs on its own
/// threads, so its effects are observed, not awaited.
/// The outbox's index tables, as a caller can reach them to damage them.
type Index = TableDefinition<'static, (i64, u64), ()>;
const CLAIMED: Index = TableDefinition::new("idemstore.v1.outbox.claimed");
const FINISHED: Index = TableDefinition::new("idemstore.v1.outbox.finished");

/// An id no record has.
const GHOST: u64 = 999;

/// Adds to `index` a row at `at` for an outbox record that does not exist.
fn damage(store: &Store, index: Index, at: DateTime<Utc>) -> Result<()> {
    store.write(|tx| {
        tx.open_table(index)?
            .insert((at.timestamp_micros(), GHOST), ())?;
        Ok::<_, Error>(())
    })
}

fn repair(store: &Store, index: Index, at: DateTime<Utc>) -> Result<()> {
    store.write(|tx| {
        tx.open_table(index)?
            .remove((at.timestamp_micros(), GHOST))?;
        Ok::<_, Error>(())
    })
}

fn entry(i: usize) -> NewEntry {
    NewEntry::new(format!("cmd-{i}"), "remote", format!("key-{i}"), vec![])
}

/// Replaces the bytes of record `id` with some that do not decode;
/// returns the bytes it had.
fn damage_record(store: &Store, id: u64) -> Result<Vec<u8>> {
    store.write(|tx| {
        let mut records = tx.open_table(OUTBOX)?;
        let good = records
            .get(id)?
            .map(|v| v.value().to_vec())
            .ok_or(Error::NotFound)?;
        records.insert(id, b"\x01garbage".as_slice())?;
        Ok::<_, Error>(good)
    })
}

/// Puts back the bytes [`damage_record`] took.
fn restore_record(store: &Store, id: u64, good: &[u8]) -> Result<()> {
    store.write(|tx| {
        tx.open_table(OUTBOX)?.insert(id, good)?;
        Ok::<_, Error>(())
    })
}

#[test]
fn a_workers_failed_claim_is_kept_with_its_time() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // The first entry in line does not decode: the claim that reads it fails.
    let id = outbox.enqueue(entry(1), t(0))?.id();
    let good = damage_record(&store, id.0)?;
    let clock = ManualClock::new(t(10));
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock)
        .workers(1)
        .start(|_| Delivery::Delivered)?;
    let last = eventually_some("the worker's claim fails", || handle.stats().last_error);
    assert_eq!(last.during, "claim");
    assert_eq!(last.at, t(10));
    assert!(
        last.message.contains(OUTBOX.name()) && last.message.contains(&id.0.to_string()),
        "{}",
        last.message
    );
    let stats = handle.stats();
    assert!(stats.store_errors >= 1, "{stats:?}");
    assert_eq!(stats.janitor, None, "no janitor was asked for");
    // The worker carries on: with the record repaired, it delivers it, and
    // the last error stays (the clock has not moved, so it reads the same).
    restore_record(&store, id.0, &good)?;
    eventually_some("the entry is delivered", || {
        outbox
            .get(id)
            .ok()
            .filter(|r| r.entry.status == OutboxStatus::Completed)
    });
    assert_eq!(handle.stats().last_error, Some(last));
    handle.shutdown()?;
    Ok(())
}

#[test]
fn the_reapers_failed_release_is_kept_with_its_time() -> Result<()> {
    let store = Store::in_memory()?;
    damage(&store, CLAIMED, t(0))?;
    let clock = ManualClock::new(t(100));
    let handle = Dispatcher::builder(store.outbox())
        .clock(clock)
        .lease(Duration::from_secs(60))
        .start(|_| Delivery::Delivered)?;
    let last = eventually_some("the reaper's release fails", || handle.stats().last_error);
    assert_eq!(last.during, "reaper");
    assert_eq!(last.at, t(100));
    assert!(last.message.contains(CLAIMED.name()), "{}", last.message);
    assert!(handle.stats().store_errors >= 1);
    handle.shutdown()?;
    Ok(())
}

#[test]
fn the_janitors_reports_and_errors_are_in_the_stats() -> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    // One entry finished at t(1), and a damaged row in front of it.
    let id = outbox.enqueue(entry(1), t(0))?.id();
    assert_eq!(outbox.claim_due(t(0), 1, "w")?.len(), 1);
    outbox.mark_completed(id, t(1))?;
    damage(&store, FINISHED, t(0))?;
    let start = t(100_000);
    let clock = ManualClock::new(start);
    let janitor = Janitor::new()
        .every(Duration::from_secs(3600))
        .outbox(outbox.clone(), Duration::from_secs(1));
    let handle = Dispatcher::builder(outbox.clone())
        .clock(clock.clone())
        .janitor(janitor)
        .start(|_| Delivery::Delivered)?;
    let failed = eventually_some("the janitor's first run fails", || {
        handle.stats().janitor.filter(|j| j.failures >= 1)
    });
    assert_eq!((failed.runs, failed.failures), (0, 1));
    assert_eq!((failed.last_run_at, failed.last_report), (None, None));
    let error = failed.last_error.expect("the failed run's error");
    assert_eq!((error.at, error.during), (start, "janitor"));
    assert!(error.message.contains(FINISHED.name()), "{}", error.message);
    // It is the dispatcher's last error too.
    let stats = handle.stats();
    assert_eq!(stats.last_error.as_ref(), Some(&error));
    assert_eq!(stats.store_errors, 1);
    // Repaired, the next run (an interval later) purges the finished entry.
    repair(&store, FINISHED, t(0))?;
    let later = start + chrono::Duration::hours(1);
    clock.set(later);
    let ran = eventually_some("the janitor's next run", || {
        handle.stats().janitor.filter(|j| j.runs >= 1)
    });
    assert_eq!((ran.runs, ran.failures), (1, 1));
    assert_eq!(ran.last_run_at, Some(later));
    assert_eq!(ran.last_report.map(|r| r.outbox_purged), Some(1));
    assert_eq!(ran.last_error, Some(error), "the last error stays");
    assert!(matches!(outbox.get(id), Err(Error::NotFound)));
    handle.shutdown()?;
    Ok(())
}

/// A manual clock that panics once when a worker thread reads it, once armed.
struct BreakingClock {
    inner: ManualClock,
    armed: Arc<AtomicBool>,
}

impl Clock for BreakingClock {
    fn now(&self) -> DateTime<Utc> {
        let on_worker = std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("idemstore-dispatcher-"));
        let breaks = on_worker && self.armed.swap(false, Ordering::SeqCst);
        assert!(!breaks, "clock broke");
        self.inner.now()
    }

    fn changes(&self) -> Option<Receiver<()>> {
        self.inner.changes()
    }
}

#[test]
fn a_panicked_worker_thread_is_error_panicked_at_shutdown() -> Result<()> {
    let store = Store::in_memory()?;
    let manual = ManualClock::new(t(5));
    let armed = Arc::new(AtomicBool::new(true));
    let clock = BreakingClock {
        inner: manual,
        armed: armed.clone(),
    };
    let handle = Dispatcher::builder(store.outbox())
        .clock(clock)
        .workers(1)
        .start(|_| Delivery::Delivered)?;
    // Kept while the dispatcher runs on without that worker.
    let last = eventually_some("the worker thread panics", || handle.stats().last_error);
    assert!(!armed.load(Ordering::SeqCst));
    assert_eq!(last.during, "a dispatcher worker thread");
    assert_eq!(last.at, t(5));
    assert!(last.message.contains("clock broke"), "{}", last.message);
    match handle.shutdown() {
        Err(err @ Error::Panicked { .. }) => {
            let text = err.to_string();
            let Error::Panicked { during, message } = err else {
                unreachable!()
            };
            assert_eq!(during, "a dispatcher worker thread");
            assert_eq!(message, "clock broke");
            assert!(text.contains("clock broke"), "{text}");
        }
        other => panic!("expected Error::Panicked, got {other:?}"),
    }
    Ok(())
}

/// The outbox's records, as a caller can reach them to damage them.
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idemstore.v1.outbox");

#[test]
fn a_damaged_record_among_a_batchs_settlements_holds_back_neither_the_others_nor_the_worker()
-> Result<()> {
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let ids = (1..=3)
        .map(|i| outbox.enqueue(entry(i), t(0)).map(|e| e.id()))
        .collect::<Result<Vec<_>>>()?;
    let damaged = ids[1];
    let sender_store = store.clone();
    let handle = Dispatcher::builder(outbox.clone())
        .clock(ManualClock::new(t(10)))
        .workers(1)
        .batch_size(10)
        .start(move |entry| {
            if entry.id == damaged {
                // The record is damaged while its send is in flight.
                sender_store
                    .write(|tx| {
                        tx.open_table(OUTBOX)?
                            .insert(damaged.0, b"\x01garbage".as_slice())?;
                        Ok::<_, Error>(())
                    })
                    .expect("damage the record");
            }
            Delivery::Delivered
        })?;
    for id in [ids[0], ids[2]] {
        eventually_some("the undamaged entries are settled", || {
            outbox
                .get(id)
                .ok()
                .filter(|r| r.entry.status == OutboxStatus::Completed)
        });
    }
    let last = eventually_some("the damaged record is reported", || {
        handle.stats().last_error
    });
    assert!(
        last.message.contains(&damaged.0.to_string()),
        "{}",
        last.message
    );
    // The worker goes on delivering.
    let later = outbox.enqueue(entry(4), t(10))?.id();
    eventually_some("a later entry is delivered", || {
        outbox
            .get(later)
            .ok()
            .filter(|r| r.entry.status == OutboxStatus::Completed)
    });
    handle.shutdown()?;
    Ok(())
}
