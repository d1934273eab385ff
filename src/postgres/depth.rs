//! The `idemstore_outbox_entries` gauge on PostgreSQL (feature `metrics`).
//!
//! The embedded outbox keeps a count per status in the write transaction
//! itself and sets the gauge after every commit. The server has no such
//! counts, and keeping some (a row updated by every write of every
//! process) would make every outbox write in every process wait on one
//! row lock. So the gauge is set from [`PgOutbox::counts`]'s query
//! (`SELECT status, count(*) … GROUP BY status`, which reads every row):
//!
//! - by every `counts` call;
//! - by this process's own outbox writes (`enqueue`, `enqueue_many`,
//!   `claim_due`, `settle`, `settle_many`, `settle_and_claim` and the
//!   operator calls), at most once every [`REFRESH`] per store, by the
//!   call itself once it has committed (one more query before it
//!   returns). `*_in` calls inside a
//!   [`PgStore::write`](super::PgStore::write) closure do not refresh it.
//!
//! So the gauge counts the entries of every process, not only this one's,
//! and may lag behind by up to [`REFRESH`] (or more, while this process
//! writes nothing). A count that fails sets nothing: a metric never fails
//! a call. Without the feature nothing here runs a query.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{PgOutbox, in_write};
use crate::observe;
use crate::outbox::OutboxCounts;

/// Least time between two refreshes by writes of one store: 5 s.
pub(super) const REFRESH: Duration = Duration::from_secs(5);

/// When the gauge was last set from one store's counts.
#[derive(Debug, Default)]
pub(super) struct DepthGauge {
    last: Mutex<Option<Instant>>,
}

impl DepthGauge {
    /// After a write of `outbox` by this process: sets the gauge from a
    /// count if the last one is older than [`REFRESH`] and no other call
    /// is counting.
    pub(super) async fn after_write(&self, outbox: &PgOutbox) {
        if !observe::METRICS || in_write() || !self.due() {
            return;
        }
        // `counts` sets the gauge itself.
        let _ = outbox.counts_async().await;
    }

    /// Whether a refresh is due, marking it taken if so (the lock is not
    /// held across the count).
    fn due(&self) -> bool {
        let Some(mut last) = self.last.try_lock() else {
            return false;
        };
        if last.is_some_and(|at| at.elapsed() < REFRESH) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// Sets the gauge from `counts`, just read from the server.
    pub(super) fn publish(&self, counts: &OutboxCounts) {
        if !observe::METRICS {
            return;
        }
        *self.last.lock() = Some(Instant::now());
        observe::outbox_depth_counted(
            counts.pending,
            counts.dispatching,
            counts.completed,
            counts.failed,
            counts.outcome_unknown,
        );
    }
}
