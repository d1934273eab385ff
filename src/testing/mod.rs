//! Helpers for testing the code built on the store (feature `testing`: a
//! production build carries none of it): a store in memory with a
//! [`ManualClock`], assertions on what was enqueued and claimed, [`drain`]
//! to run the outbox now on the test's thread, and a [`FaultyDisk`] for
//! crash tests.
//!
//! ```
//! use std::time::Duration;
//! use idemstore::testing::{self, TestStore};
//! use idemstore::{Delivery, NewEntry};
//!
//! let t = TestStore::new()?;
//! let outbox = t.store().outbox();
//! // The code under test enqueues a webhook...
//! outbox.enqueue(NewEntry::new("order-1", "billing", "order-1/charge", b"{}".to_vec()), t.now())?;
//! // ...which the test finds...
//! let record = testing::assert_enqueued(&outbox, "billing", "order-1/charge");
//! assert_eq!(record.entry.payload, b"{}");
//! // ...and delivers: the first attempt fails, the retry (after the
//! // back-off, which the clock moves over) succeeds.
//! let mut calls = 0;
//! let sent = testing::drain(&outbox, t.clock(), |_entry| {
//!     calls += 1;
//!     if calls == 1 { Delivery::Retry { reason: "http_503".into() } } else { Delivery::Delivered }
//! })?;
//! assert_eq!(sent.len(), 2);
//! assert!(t.now() > TestStore::START);
//! assert!(testing::enqueued(&outbox)?.iter().all(|r| r.entry.status.is_finished()));
//! # Ok::<(), idemstore::Error>(())
//! ```

mod disk;

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::dispatch::settlement;
use crate::{
    Inbox, ManualClock, Outbox, OutboxEntry, OutboxFilter, OutboxRecord, OutboxStatus, Result,
    RetryPolicy, Store, StoreBuilder,
};

pub use disk::{Fault, FaultyDisk};

/// A store for a test: in memory on a [`FaultyDisk`], with a
/// [`ManualClock`] standing at [`TestStore::START`]. Pass
/// [`now`](TestStore::now) to the store's calls, the clock to a
/// [`Dispatcher`](crate::Dispatcher) or the HTTP layer, and move it with
/// [`advance`](TestStore::advance).
#[derive(Debug)]
pub struct TestStore {
    store: Store,
    clock: ManualClock,
    disk: FaultyDisk,
    builder: fn() -> StoreBuilder,
}

impl TestStore {
    /// Where a test store's clock starts: 2024-01-01T00:00:00Z.
    pub const START: DateTime<Utc> = match DateTime::from_timestamp(1_704_067_200, 0) {
        Some(t) => t,
        None => panic!("a valid instant"),
    };

    /// A fresh store with the default settings.
    ///
    /// # Errors
    ///
    /// As [`StoreBuilder::open_with_backend`].
    pub fn new() -> Result<TestStore> {
        TestStore::with(Store::builder)
    }

    /// A fresh store opened by the builder `builder` makes (settings such as
    /// [`StoreBuilder::durability`] or [`StoreBuilder::max_body`]; a shared
    /// store is refused, a file in memory belongs to one process). The same
    /// settings reopen it in [`restart`](TestStore::restart).
    ///
    /// # Errors
    ///
    /// As [`StoreBuilder::open_with_backend`].
    pub fn with(builder: fn() -> StoreBuilder) -> Result<TestStore> {
        let disk = FaultyDisk::new();
        Ok(TestStore {
            store: builder().open_with_backend(disk.clone())?,
            clock: ManualClock::new(TestStore::START),
            disk,
            builder,
        })
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The clock: clones move together.
    #[must_use]
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }

    /// The clock's time.
    #[must_use]
    pub fn now(&self) -> DateTime<Utc> {
        crate::Clock::now(&self.clock)
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// The store's disk: make its writes or syncs fail with
    /// [`FaultyDisk::fail_at`].
    #[must_use]
    pub fn disk(&self) -> &FaultyDisk {
        &self.disk
    }

    /// The process crashes and starts again: the store is opened anew on
    /// the bytes its disk holds now (a copy, without faults), and the old
    /// one, with every handle taken from it, is left to fail or drop on
    /// its own disk, never touching the new file. Handles taken before
    /// (inboxes, outboxes, keys) must be taken again from
    /// [`store`](TestStore::store). The clock keeps its time.
    ///
    /// # Errors
    ///
    /// As [`StoreBuilder::open_with_backend`]: the file the crash left does
    /// not open (which the store promises never happens).
    pub fn restart(&mut self) -> Result<()> {
        let disk = self.disk.copy();
        let store = (self.builder)().open_with_backend(disk.clone())?;
        self.store = store;
        self.disk = disk;
        Ok(())
    }
}

/// Every entry of `outbox`, oldest first, in every status.
///
/// # Errors
///
/// As [`Outbox::list`].
pub fn enqueued(outbox: &Outbox) -> Result<Vec<OutboxRecord>> {
    outbox.list(&OutboxFilter::any(), usize::MAX)
}

/// The entry enqueued for `(destination, idempotency_key)`, in whatever
/// status it is now.
///
/// # Panics
///
/// If there is none (the message lists what was enqueued), or the store
/// fails.
#[track_caller]
pub fn assert_enqueued(outbox: &Outbox, destination: &str, idempotency_key: &str) -> OutboxRecord {
    match outbox.find(destination, idempotency_key) {
        Ok(Some(record)) => record,
        Ok(None) => panic!(
            "no outbox entry for destination {destination:?} and key {idempotency_key:?}; enqueued: {}",
            listing(outbox)
        ),
        Err(e) => panic!("the outbox could not be read: {e}"),
    }
}

/// Panics if an entry is enqueued for `(destination, idempotency_key)`.
///
/// # Panics
///
/// If there is one (the message shows it), or the store fails.
#[track_caller]
pub fn assert_not_enqueued(outbox: &Outbox, destination: &str, idempotency_key: &str) {
    match outbox.find(destination, idempotency_key) {
        Ok(None) => {}
        Ok(Some(record)) => panic!(
            "an outbox entry for destination {destination:?} and key {idempotency_key:?} was enqueued: id {}, {}",
            record.entry.id.0, record.entry.status
        ),
        Err(e) => panic!("the outbox could not be read: {e}"),
    }
}

/// `(destination, key, status)` of every entry, for failure messages.
fn listing(outbox: &Outbox) -> String {
    match enqueued(outbox) {
        Ok(records) if records.is_empty() => "nothing".to_owned(),
        Ok(records) => records
            .iter()
            .map(|r| {
                format!(
                    "({:?}, {:?}, {})",
                    r.entry.destination, r.entry.idempotency_key, r.entry.status
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        Err(e) => format!("(the outbox could not be listed: {e})"),
    }
}

/// Panics unless `event_key` was claimed in `inbox`.
///
/// # Panics
///
/// If it was not, or the store fails.
#[track_caller]
pub fn assert_claimed(inbox: &Inbox, event_key: &str) {
    assert_seen(inbox, event_key, true);
}

/// Panics if `event_key` was claimed in `inbox`.
///
/// # Panics
///
/// If it was, or the store fails.
#[track_caller]
pub fn assert_not_claimed(inbox: &Inbox, event_key: &str) {
    assert_seen(inbox, event_key, false);
}

#[track_caller]
fn assert_seen(inbox: &Inbox, event_key: &str, want: bool) {
    match inbox.seen(event_key) {
        Ok(seen) => assert!(
            seen == want,
            "event {event_key:?} was {}claimed in inbox {:?}",
            if seen { "" } else { "not " },
            inbox.name()
        ),
        Err(e) => panic!("the inbox could not be read: {e}"),
    }
}

/// Most sends one [`drain`] makes before it decides `send` never lets the
/// outbox empty.
pub const DRAIN_LIMIT: usize = 100_000;

/// Runs the outbox now, on this thread: the schedules due fire by the
/// clock (a schedule not started yet starts now: see
/// [`Outbox::set_schedule`]), then every due entry goes through
/// `send` and is settled by the dispatchers' rules under the default
/// [`RetryPolicy`], until none is due; when the only entries left are
/// waiting out a retry's back-off, the clock moves to the first of them
/// and the drain goes on. Returns every entry sent, in order, once per
/// attempt.
///
/// Entries that were never tried and are due later (`not_before`) stay
/// pending and the clock stays: move it and drain again. So do entries
/// that cannot be claimed now (a paused destination, an open circuit).
///
/// # Errors
///
/// A store call failed; what was settled before it stays settled.
///
/// # Panics
///
/// After [`DRAIN_LIMIT`] sends (a `send` that never lets the outbox
/// empty: a policy without an attempt limit retrying for ever).
pub fn drain(
    outbox: &Outbox,
    clock: &ManualClock,
    send: impl FnMut(&OutboxEntry) -> crate::Delivery,
) -> Result<Vec<OutboxEntry>> {
    drain_with(outbox, clock, &RetryPolicy::default(), send)
}

/// [`drain`] under `retry`. Back-offs are drawn without jitter's
/// randomness (at its midpoint), so a test sees the same times each run.
///
/// # Errors
///
/// As [`drain`].
///
/// # Panics
///
/// As [`drain`].
pub fn drain_with(
    outbox: &Outbox,
    clock: &ManualClock,
    retry: &RetryPolicy,
    mut deliver: impl FnMut(&OutboxEntry) -> crate::Delivery,
) -> Result<Vec<OutboxEntry>> {
    const WORKER: &str = "idemstore::testing::drain";
    let mut sent = Vec::new();
    loop {
        let now = crate::Clock::now(clock);
        // The schedules' slots up to now, as a dispatcher fires them.
        outbox.fire_schedules(now)?;
        let claimed = outbox.claim_due(now, 64, WORKER)?;
        if claimed.is_empty() {
            match next_retry(outbox)? {
                Some(at) if at > now => {
                    clock.set(at);
                    continue;
                }
                _ => return Ok(sent),
            }
        }
        for entry in claimed {
            assert!(
                sent.len() < DRAIN_LIMIT,
                "drain: {DRAIN_LIMIT} sends and the outbox is not empty; does the retry policy limit attempts?"
            );
            let delivery = deliver(&entry);
            let now = crate::Clock::now(clock);
            let settled = settlement(retry, &entry, Some(delivery), now, || 0.5);
            outbox.settle(entry.fence(), settled, now)?;
            sent.push(entry);
        }
    }
}

/// When the first pending entry that was tried before (a retry waiting
/// out its back-off) is due.
fn next_retry(outbox: &Outbox) -> Result<Option<DateTime<Utc>>> {
    let pending = outbox.list(
        &OutboxFilter::any().status(OutboxStatus::Pending),
        usize::MAX,
    )?;
    Ok(pending
        .iter()
        .filter(|r| r.entry.attempt_count > 0)
        .map(|r| r.entry.due_at())
        .min())
}
