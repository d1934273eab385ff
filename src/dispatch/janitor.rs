//! [`Janitor`]: retention on a schedule — prunes inboxes, purges finished
//! outbox entries and expired idempotency keys, of either backend.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use crossbeam_channel::{Receiver, select};

use super::clock::Clock;
use super::stats::LastError;
use crate::backend::{IdempotencyBackend, InboxBackend, OutboxBackend};
use crate::error::Result;
use crate::observe;

/// Default time between janitor runs: 1 hour.
pub const DEFAULT_JANITOR_INTERVAL: Duration = Duration::from_secs(60 * 60);
/// Default retention of finished (`Completed`, `Failed`) outbox entries and
/// of inbox keys: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Periodic clean-up, run by a [`Dispatcher`](super::Dispatcher) (see
/// [`DispatcherBuilder::janitor`](super::DispatcherBuilder::janitor)) or by
/// hand with [`Janitor::run_once`]. Each task costs what it removes.
///
/// Each task commits in chunks of at most 1024 rows, each its own
/// transaction, on both backends: the first run over a large backlog (an
/// old store, or after an outage) never holds the embedded store's writer
/// for long, so claims, enqueues and settlements go on between the chunks.
/// A run that fails midway leaves the chunks it committed done; the next
/// run takes up the rest.
///
/// Its tasks take the handles of either backend (the embedded store's, or
/// with feature `postgres` the PostgreSQL ones: see [`OutboxBackend`],
/// [`InboxBackend`], [`IdempotencyBackend`]), even both in one janitor. On
/// PostgreSQL each chunk is one `DELETE` on its table's index that skips
/// the rows other transactions hold locked; janitors in several processes
/// may run at once (each row goes once).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct Janitor {
    interval: Option<Duration>,
    outbox: Option<(Arc<dyn OutboxBackend>, Duration)>,
    inboxes: Vec<(Arc<dyn InboxBackend>, Duration)>,
    keys: Option<Arc<dyn IdempotencyBackend>>,
}

/// What one janitor run removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct JanitorReport {
    /// Finished outbox entries purged.
    pub outbox_purged: u64,
    /// Inbox keys pruned, over all inboxes.
    pub inbox_pruned: u64,
    /// Expired idempotency records purged.
    pub keys_purged: u64,
}

/// What the janitor of a running dispatcher has done so far: its runs, the
/// last run's report and the last failed run's error, each with its time by
/// the dispatcher's clock. Part of
/// [`DispatchStats::janitor`](super::DispatchStats::janitor).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct JanitorStats {
    /// Runs that succeeded.
    pub runs: u64,
    /// Runs that failed (each task is tried again at the next run). Also
    /// counted in [`DispatchStats::store_errors`](super::DispatchStats::store_errors).
    pub failures: u64,
    /// When the last successful run started.
    pub last_run_at: Option<DateTime<Utc>>,
    /// What the last successful run removed.
    pub last_report: Option<JanitorReport>,
    /// The last failed run's error (`during` is `"janitor"`).
    pub last_error: Option<LastError>,
}

impl Janitor {
    /// A janitor with nothing to do yet; add tasks with the methods below.
    pub fn new() -> Self {
        Janitor::default()
    }

    /// Time between runs (by the dispatcher's clock). Default: 1 hour.
    pub fn every(mut self, interval: Duration) -> Self {
        self.interval = Some(interval.max(Duration::from_millis(1)));
        self
    }

    /// Purge outbox entries finished more than `keep` ago (7 days is the
    /// usual choice: [`DEFAULT_RETENTION`]).
    pub fn outbox(mut self, outbox: impl OutboxBackend, keep: Duration) -> Self {
        self.outbox = Some((Arc::new(outbox), keep));
        self
    }

    /// Prune `inbox` keys claimed more than `keep` ago. Keep them longer
    /// than duplicates can arrive: a pruned key can be claimed again.
    pub fn inbox(mut self, inbox: impl InboxBackend, keep: Duration) -> Self {
        self.inboxes.push((Arc::new(inbox), keep));
        self
    }

    /// Purge idempotency records past their TTL (the handle's
    /// [`IdempotencyKeys::ttl`](crate::IdempotencyKeys::ttl)).
    pub fn idempotency_keys(mut self, keys: impl IdempotencyBackend) -> Self {
        self.keys = Some(Arc::new(keys));
        self
    }

    /// Runs every task once, as of `now`.
    pub fn run_once(&self, now: DateTime<Utc>) -> Result<JanitorReport> {
        let run = observe::Stopwatch::start();
        let mut report = JanitorReport::default();
        if let Some((outbox, keep)) = &self.outbox {
            report.outbox_purged = outbox.purge_finished(before(now, *keep))?;
        }
        for (inbox, keep) in &self.inboxes {
            report.inbox_pruned += inbox.prune(before(now, *keep))?;
        }
        if let Some(keys) = &self.keys {
            report.keys_purged = keys.purge_expired(before(now, keys.ttl()))?;
        }
        Ok(report.observed(run))
    }

    /// [`Janitor::run_once`] through the backends' async calls, which hold
    /// no thread while they wait: the async dispatcher's janitor.
    #[cfg(feature = "tokio")]
    pub(crate) async fn run_once_async(&self, now: DateTime<Utc>) -> Result<JanitorReport> {
        let run = observe::Stopwatch::start();
        let mut report = JanitorReport::default();
        if let Some((outbox, keep)) = &self.outbox {
            report.outbox_purged = outbox.purge_finished_async(before(now, *keep)).await?;
        }
        for (inbox, keep) in &self.inboxes {
            report.inbox_pruned += inbox.prune_async(before(now, *keep)).await?;
        }
        if let Some(keys) = &self.keys {
            report.keys_purged = keys.purge_expired_async(before(now, keys.ttl())).await?;
        }
        Ok(report.observed(run))
    }

    /// The loop a dispatcher runs: a run at start, then one per interval,
    /// until `stop` closes; each run's time and outcome go to `record`.
    /// Errors are retried at the next run.
    pub(crate) fn run(
        &self,
        clock: &dyn Clock,
        stop: &Receiver<()>,
        record: &dyn Fn(DateTime<Utc>, &Result<JanitorReport>),
    ) {
        let changes = clock.changes().unwrap_or_else(crossbeam_channel::never);
        let mut next = clock.now();
        loop {
            let wait = self.turn(clock, &mut next, record);
            select! {
                recv(stop) -> _ => return,
                recv(changes) -> _ => {}
                default(wait) => {}
            }
        }
    }

    /// One turn of a dispatcher's janitor loop (threads or tasks): runs
    /// every task if `next` has come (its time and outcome go to `record`)
    /// and moves `next` an interval on; returns how long to wait before the
    /// next turn (at most an interval: a clock change ends the wait early).
    pub(crate) fn turn(
        &self,
        clock: &dyn Clock,
        next: &mut DateTime<Utc>,
        record: &dyn Fn(DateTime<Utc>, &Result<JanitorReport>),
    ) -> Duration {
        if let Some(now) = self.due(clock, next) {
            record(now, &self.run_once(now));
        }
        self.wait(clock, *next)
    }

    /// The time by `clock` if a run is due (`next` has come), moving `next`
    /// an interval on; `None` if not yet.
    pub(crate) fn due(&self, clock: &dyn Clock, next: &mut DateTime<Utc>) -> Option<DateTime<Utc>> {
        let now = clock.now();
        if now < *next {
            return None;
        }
        let period = chrono::Duration::from_std(self.interval()).unwrap_or(chrono::Duration::MAX);
        *next = now
            .checked_add_signed(period)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        Some(now)
    }

    /// How long to wait for the run at `next` (at most an interval).
    pub(crate) fn wait(&self, clock: &dyn Clock, next: DateTime<Utc>) -> Duration {
        (next - clock.now())
            .to_std()
            .unwrap_or(Duration::ZERO)
            .min(self.interval())
    }

    fn interval(&self) -> Duration {
        self.interval.unwrap_or(DEFAULT_JANITOR_INTERVAL)
    }
}

/// The cutoff of a task that keeps rows for `keep` as of `now`.
fn before(now: DateTime<Utc>, keep: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(keep)
        .ok()
        .and_then(|k| now.checked_sub_signed(k))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

impl JanitorReport {
    /// This report of a run that started at `run`, once told to the
    /// recorders.
    fn observed(self, run: observe::Stopwatch) -> Self {
        observe::janitor_run(self.outbox_purged, self.inbox_pruned, self.keys_purged, run);
        self
    }
}
