//! Fair sharing: while several destinations have due entries, none holds
//! more than its share of a dispatcher's workers. A slow destination with
//! a backlog enqueued first must leave a fast one a fair part of the
//! workers: the fast one's delivery rate beside it is measured against its
//! rate alone, in the same test.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemstore::chrono::{self, Utc};
use idemstore::{Delivery, Dispatcher, NewEntry, Outbox, Result, Store};

/// The slow destination's send time, and its backlog (enqueued first).
const SLOW_SEND: Duration = Duration::from_millis(300);
const SLOW_BACKLOG: usize = 400;
/// The fast destination's send time, and its entries.
const FAST_SEND: Duration = Duration::from_millis(1);
const FAST_ENTRIES: usize = 1500;
const WORKERS: usize = 8;
/// How long a run waits for the fast destination's entries at most (the
/// rate is then measured on what was delivered).
const CAP: Duration = Duration::from_secs(10);

/// The fast destination's entries, and with `slow` the slow one's backlog
/// before them (enqueued a second earlier: first in line).
fn fill(outbox: &Outbox, slow: bool) -> Result<()> {
    let now = Utc::now();
    if slow {
        let backlog = (0..SLOW_BACKLOG)
            .map(|i| NewEntry::new(format!("s-{i}"), "slow", format!("s-{i}"), Vec::new()));
        outbox.enqueue_many(backlog, now - chrono::Duration::seconds(1))?;
    }
    let entries = (0..FAST_ENTRIES)
        .map(|i| NewEntry::new(format!("f-{i}"), "fast", format!("f-{i}"), Vec::new()));
    outbox.enqueue_many(entries, now)?;
    Ok(())
}

/// The fast destination's delivery rate (entries per second) since
/// `started`, measured once `fast_sent` counts all its entries (or at
/// [`CAP`]).
fn fast_rate(fast_sent: &AtomicUsize, started: Instant) -> f64 {
    while fast_sent.load(Ordering::SeqCst) < FAST_ENTRIES && started.elapsed() < CAP {
        std::thread::sleep(Duration::from_millis(1));
    }
    fast_sent.load(Ordering::SeqCst) as f64 / started.elapsed().as_secs_f64()
}

/// One measurement at a time: the two tests of this file would otherwise
/// run side by side and each disturb what the other measures.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Asserts that the fast destination's rate beside the slow one is at
/// least a third of its rate alone.
fn assert_fair(runtime: &str, alone: f64, beside: f64) {
    let line = format!(
        "fair sharing ({runtime}, {WORKERS} workers): fast destination {beside:.0}/s beside a slow \
         one's backlog, {alone:.0}/s alone (ratio {:.2})",
        beside / alone
    );
    common::report(&line);
    assert!(beside * 3.0 >= alone, "{line}: below a third");
}

/// The fast destination's rate on worker threads, beside the slow one's
/// backlog or alone. Each send of the slow destination sleeps
/// [`SLOW_SEND`], of the fast one [`FAST_SEND`].
fn threads_run(slow: bool) -> Result<f64> {
    let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
    let store = Store::open(dir.path().join("fair.idem"))?;
    let outbox = store.outbox();
    fill(&outbox, slow)?;
    let fast_sent = Arc::new(AtomicUsize::new(0));
    let counter = fast_sent.clone();
    let started = Instant::now();
    let handle = Dispatcher::builder(outbox)
        .workers(WORKERS)
        .start(move |entry| {
            if entry.destination == "slow" {
                std::thread::sleep(SLOW_SEND);
            } else {
                std::thread::sleep(FAST_SEND);
                counter.fetch_add(1, Ordering::SeqCst);
            }
            Delivery::Delivered
        })?;
    let rate = fast_rate(&fast_sent, started);
    // At once: the slow destination's backlog is not waited for.
    handle.shutdown()?;
    Ok(rate)
}

#[test]
fn a_slow_destination_never_takes_every_worker_thread() -> Result<()> {
    let _turn = turn();
    let alone = threads_run(false)?;
    let beside = threads_run(true)?;
    assert_fair("threads", alone, beside);
    Ok(())
}

#[test]
fn a_lone_destination_still_gets_every_worker_thread() -> Result<()> {
    const THREADS: usize = 4;
    let store = Store::in_memory()?;
    let outbox = store.outbox();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (now, go) = (in_flight.clone(), release.clone());
    let handle = Dispatcher::builder(outbox.clone())
        .workers(THREADS)
        .batch_size(1)
        .start(move |_| {
            now.fetch_add(1, Ordering::SeqCst);
            let started = Instant::now();
            while !go.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(1));
            }
            now.fetch_sub(1, Ordering::SeqCst);
            Delivery::Delivered
        })?;
    // One entry at a time, each taken by one more thread: beyond its share
    // (2 of 4), the lone destination's entries still go out, as nothing
    // else is due.
    for i in 0..THREADS {
        let entry = NewEntry::new(format!("c-{i}"), "lone", format!("k-{i}"), Vec::new());
        outbox.enqueue(entry, Utc::now())?;
        common::eventually("one more thread sends", || {
            in_flight.load(Ordering::SeqCst) == i + 1
        });
    }
    release.store(true, Ordering::SeqCst);
    common::eventually("every entry is delivered", || {
        outbox.counts().is_ok_and(|c| c.completed == THREADS as u64)
    });
    handle.shutdown()?;
    Ok(())
}

#[cfg(feature = "tokio")]
mod tasks {
    use super::*;

    /// [`threads_run`] on tasks of a tokio runtime.
    fn tasks_run(slow: bool) -> Result<f64> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(idemstore::Error::Io)?;
        let dir = tempfile::tempdir().map_err(idemstore::Error::Io)?;
        let store = Store::open(dir.path().join("fair.idem"))?;
        let outbox = store.outbox();
        fill(&outbox, slow)?;
        let fast_sent = Arc::new(AtomicUsize::new(0));
        let counter = fast_sent.clone();
        let started = Instant::now();
        let handle = {
            let _runtime = runtime.enter();
            Dispatcher::builder(outbox)
                .workers(WORKERS)
                .start_async(move |entry| {
                    let counter = counter.clone();
                    async move {
                        if entry.destination == "slow" {
                            tokio::time::sleep(SLOW_SEND).await;
                        } else {
                            tokio::time::sleep(FAST_SEND).await;
                            counter.fetch_add(1, Ordering::SeqCst);
                        }
                        Delivery::Delivered
                    }
                })?
        };
        let rate = fast_rate(&fast_sent, started);
        runtime.block_on(handle.shutdown())?;
        Ok(rate)
    }

    #[test]
    fn a_slow_destination_never_takes_every_send_slot() -> Result<()> {
        let _turn = turn();
        let alone = tasks_run(false)?;
        let beside = tasks_run(true)?;
        assert_fair("tasks", alone, beside);
        Ok(())
    }
}
