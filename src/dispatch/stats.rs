//! [`DispatchStats`]: what a dispatcher did, for metrics and reports.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use parking_lot::Mutex;

use super::janitor::{JanitorReport, JanitorStats};
use crate::error::Error;
use crate::observe::{self, Settled};
use crate::outbox::{OutboxEntry, Settlement};

/// Counters of a running dispatcher, its enqueue→send latency, and the last
/// error its threads ran into.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DispatchStats {
    /// Sends that returned [`Delivery::Delivered`](super::Delivery::Delivered).
    pub delivered: u64,
    /// Sends that asked for a retry (and got one): `Retry`, `RetryAt`,
    /// `Throttled`, and panics.
    pub retried: u64,
    /// Entries that failed for good (a [`Delivery::Failed`](super::Delivery::Failed), or `max_attempts`).
    pub failed: u64,
    /// Sends that returned
    /// [`Delivery::OutcomeUnknown`](super::Delivery::OutcomeUnknown).
    pub outcome_unknown: u64,
    /// Sends that panicked (each counted as a retryable failure).
    pub panics: u64,
    /// Settlements refused because the claim had expired and the entry had
    /// moved on (the reaper released it, or another worker claimed it).
    pub fenced: u64,
    /// Claims the reaper released after their lease ran out.
    pub released: u64,
    /// Entries given back unsent at shutdown.
    pub returned: u64,
    /// Store calls that failed, in the workers, the reaper and the janitor
    /// (each backs off and carries on), and settlements that failed for
    /// another reason than a fence.
    pub store_errors: u64,
    /// Time from an entry's enqueue (its `created_at`) to the start of its
    /// first send, for entries due at once.
    pub latency: LatencySummary,
    /// The last error of any of the dispatcher's threads (a failed store
    /// call, or a thread that panicked), with its time; `None` while there
    /// was none. It stays after the dispatcher recovers: compare its time.
    pub last_error: Option<LastError>,
    /// What the janitor did, when the dispatcher runs one
    /// ([`DispatcherBuilder::janitor`](super::DispatcherBuilder::janitor)).
    pub janitor: Option<JanitorStats>,
}

/// An error a dispatcher's thread ran into, when, and what it was doing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LastError {
    /// When, by the dispatcher's clock (the system clock when the clock
    /// itself panicked).
    pub at: DateTime<Utc>,
    /// What failed. A worker's store calls: `"claim"` (claiming the next
    /// batch, which commits the last batch's settlements with it),
    /// `"settle"` (a settlement that failed on its own, or the last one at
    /// shutdown), `"next_due"` (looking for the next due time); the
    /// reaper's `"reaper"`; the janitor's `"janitor"`. A thread that
    /// panicked: `"a dispatcher worker thread"`, `"the dispatcher's reaper
    /// thread"`, `"the dispatcher's janitor thread"` (the same words as the
    /// [`Error::Panicked`] its join returns); with `start_async`, a task:
    /// `"the async dispatcher's claimer task"`, `"the async dispatcher's
    /// reaper task"`, `"the async dispatcher's janitor task"`.
    pub during: &'static str,
    /// The error, as its `Display` reads.
    pub message: String,
}

impl LastError {
    pub(crate) fn new(at: DateTime<Utc>, during: &'static str, error: &Error) -> Self {
        LastError {
            at,
            during,
            message: error.to_string(),
        }
    }
}

/// Percentiles of a latency distribution (about 12 % precision).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LatencySummary {
    /// Samples recorded.
    pub count: u64,
    /// Median.
    pub p50: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
}

/// Log-linear histogram of microseconds: 8 buckets per power of two.
#[derive(Debug)]
pub(crate) struct Histogram {
    buckets: Vec<u64>,
    count: u64,
    max_us: u64,
}

const SUB: u32 = 8;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; (64 * SUB) as usize],
            count: 0,
            max_us: 0,
        }
    }
}

impl Histogram {
    fn index(us: u64) -> usize {
        if us < u64::from(SUB) {
            return usize::try_from(us).unwrap_or(0);
        }
        let log = us.ilog2();
        let sub = (us >> (log - 3)) & u64::from(SUB - 1);
        usize::try_from(u64::from(log) * u64::from(SUB) + sub).unwrap_or(0)
    }

    /// The upper edge of a bucket, in microseconds.
    fn upper(index: usize) -> u64 {
        let index = u64::try_from(index).unwrap_or(0);
        if index < u64::from(SUB) {
            return index;
        }
        let log = index / u64::from(SUB);
        let sub = index % u64::from(SUB);
        ((u64::from(SUB) + sub + 1) << (log - 3)).saturating_sub(1)
    }

    pub(crate) fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        // Every index is below 64 · SUB: log2 < 64, sub < SUB.
        if let Some(bucket) = self.buckets.get_mut(Self::index(us)) {
            *bucket += 1;
        }
        self.count += 1;
        self.max_us = self.max_us.max(us);
    }

    fn quantile(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a rank within the sample count"
        )]
        let rank = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_micros(Self::upper(i).min(self.max_us));
            }
        }
        Duration::from_micros(self.max_us)
    }

    pub(crate) fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            p50: self.quantile(0.50),
            p90: self.quantile(0.90),
            p99: self.quantile(0.99),
            max: Duration::from_micros(self.max_us),
        }
    }
}

/// The enqueue→send latency of [`DispatchStats::latency`]; each sample is
/// also reported (`crate::observe`).
#[derive(Debug, Default)]
pub(crate) struct EnqueueLatency(Histogram);

impl EnqueueLatency {
    /// Records `d` in `latency`, then reports it with the lock released:
    /// the report runs the application's recorder, which must not hold up
    /// the other workers.
    pub(crate) fn record(latency: &Mutex<EnqueueLatency>, d: Duration) {
        latency.lock().0.record(d);
        observe::dispatch_latency(d);
    }

    fn summary(&self) -> LatencySummary {
        self.0.summary()
    }
}

/// A counter of [`Counters`]: [`bump`] adds to it.
pub(crate) trait Tally {
    fn add(&self, n: u64);
    fn get(&self) -> u64;
}

impl Tally for AtomicU64 {
    fn add(&self, n: u64) {
        self.fetch_add(n, Ordering::Relaxed);
    }

    fn get(&self) -> u64 {
        self.load(Ordering::Relaxed)
    }
}

/// What a [`Reported`] counter reports with each bump.
pub(crate) trait Report {
    fn report(n: u64);
}

/// A counter whose every bump is also reported (`crate::observe`), so that
/// the dispatcher's `bump(&counters.released, n)` is the one call for both.
pub(crate) struct Reported<R>(AtomicU64, PhantomData<R>);

impl<R> Default for Reported<R> {
    fn default() -> Self {
        Reported(AtomicU64::new(0), PhantomData)
    }
}

impl<R> std::fmt::Debug for Reported<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<R: Report> Tally for Reported<R> {
    fn add(&self, n: u64) {
        self.0.add(n);
        R::report(n);
    }

    fn get(&self) -> u64 {
        self.0.get()
    }
}

/// Sends that panicked.
pub(crate) struct Panics;
impl Report for Panics {
    fn report(n: u64) {
        observe::send_panicked(n);
    }
}

/// Settlements refused by their fence.
pub(crate) struct Fenced;
impl Report for Fenced {
    fn report(n: u64) {
        observe::fenced(n);
    }
}

/// Claims the reaper released.
pub(crate) struct Released;
impl Report for Released {
    fn report(n: u64) {
        observe::reaper_released(n);
    }
}

/// The live counters behind [`DispatchStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) delivered: AtomicU64,
    pub(crate) retried: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) outcome_unknown: AtomicU64,
    pub(crate) panics: Reported<Panics>,
    pub(crate) fenced: Reported<Fenced>,
    pub(crate) released: Reported<Released>,
    pub(crate) returned: AtomicU64,
    pub(crate) store_errors: AtomicU64,
    pub(crate) latency: Mutex<EnqueueLatency>,
    last_error: Mutex<Option<LastError>>,
    /// `Some` when the dispatcher runs a janitor.
    janitor: Mutex<Option<JanitorStats>>,
}

pub(crate) fn bump(c: &impl Tally, n: u64) {
    c.add(n);
}

/// How `settlement` is counted and reported.
fn outcome(settlement: &Settlement) -> Settled {
    match settlement {
        Settlement::Completed => Settled::Delivered,
        Settlement::Failed {
            next_attempt_at: Some(_),
            ..
        }
        | Settlement::Throttled { .. } => Settled::Retried,
        Settlement::Failed {
            next_attempt_at: None,
            ..
        } => Settled::Failed,
        Settlement::OutcomeUnknown { .. } => Settled::OutcomeUnknown,
        Settlement::Rescheduled { .. } => Settled::Returned,
    }
}

impl Counters {
    /// Counters for a dispatcher, with a janitor's or without.
    pub(crate) fn new(with_janitor: bool) -> Self {
        Counters {
            janitor: Mutex::new(with_janitor.then(JanitorStats::default)),
            ..Counters::default()
        }
    }

    /// Counts how a worker settles an attempt of `entry` (or gives it back
    /// unsent): the one place the outcome counters change.
    pub(crate) fn settled(&self, entry: &OutboxEntry, settlement: &Settlement) {
        let outcome = outcome(settlement);
        let counter = match outcome {
            Settled::Delivered => &self.delivered,
            Settled::Retried => &self.retried,
            Settled::Failed => &self.failed,
            Settled::OutcomeUnknown => &self.outcome_unknown,
            Settled::Returned => &self.returned,
        };
        bump(counter, 1);
        observe::settled(&entry.destination, outcome);
    }

    /// Reports one attempt: `entry` was sent, its `send` took `took`, and
    /// it is settled as `settlement`. Counts nothing ([`Counters::settled`]
    /// does): a dispatcher calls both for an entry it sent, `settled` alone
    /// for one it gives back unsent.
    #[expect(
        clippy::unused_self,
        reason = "one of the dispatcher's calls on its counters, though it counts nothing"
    )]
    pub(crate) fn attempted(&self, entry: &OutboxEntry, settlement: &Settlement, took: Duration) {
        let reason = match settlement {
            Settlement::Failed { reason, .. } | Settlement::Throttled { reason, .. } => {
                Some(reason.as_str())
            }
            _ => None,
        };
        observe::attempt(
            entry.id.0,
            &entry.destination,
            entry.attempt_count,
            outcome(settlement),
            reason,
            took,
        );
    }

    /// Counts a failed store call, reports it and keeps it as the last
    /// error.
    pub(crate) fn store_error(&self, at: DateTime<Utc>, during: &'static str, error: &Error) {
        bump(&self.store_errors, 1);
        observe::store_error(during, error);
        self.keep(LastError::new(at, during, error));
    }

    /// Reports and keeps `error`, which ended a thread (a panic), as the
    /// last error.
    pub(crate) fn last_error(&self, error: LastError) {
        observe::thread_panicked(error.during, &error.message);
        self.keep(error);
    }

    fn keep(&self, error: LastError) {
        *self.last_error.lock() = Some(error);
    }

    /// Notes a janitor run that ran at `at`.
    pub(crate) fn janitor_run(&self, at: DateTime<Utc>, outcome: &Result<JanitorReport, Error>) {
        if let Err(e) = outcome {
            self.store_error(at, "janitor", e);
        }
        if let Some(stats) = self.janitor.lock().as_mut() {
            match outcome {
                Ok(report) => {
                    stats.runs += 1;
                    stats.last_run_at = Some(at);
                    stats.last_report = Some(*report);
                }
                Err(e) => {
                    stats.failures += 1;
                    stats.last_error = Some(LastError::new(at, "janitor", e));
                }
            }
        }
    }

    pub(crate) fn snapshot(&self) -> DispatchStats {
        DispatchStats {
            delivered: self.delivered.get(),
            retried: self.retried.get(),
            failed: self.failed.get(),
            outcome_unknown: self.outcome_unknown.get(),
            panics: self.panics.get(),
            fenced: self.fenced.get(),
            released: self.released.get(),
            returned: self.returned.get(),
            store_errors: self.store_errors.get(),
            latency: self.latency.lock().summary(),
            last_error: self.last_error.lock().clone(),
            janitor: self.janitor.lock().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(feature = "tracing", feature = "metrics"))]
    #[test]
    fn an_attempt_is_reported_with_its_entry_outcome_and_send_time() {
        use crate::observe::capture::{Events, Metrics};
        use crate::outbox::{OutboxId, OutboxStatus};

        let at = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let entry = OutboxEntry {
            id: OutboxId(7),
            command_id: "cmd-7".into(),
            destination: "mailer".into(),
            idempotency_key: "key-7".into(),
            payload: Vec::new(),
            status: OutboxStatus::Dispatching,
            attempt_count: 2,
            next_attempt_at: None,
            created_at: at,
            completed_at: None,
            ordering_key: None,
            priority: 0,
        };
        let retry = Settlement::Failed {
            reason: "http_500".into(),
            next_attempt_at: Some(at),
        };
        let (events, metrics) = (Events::default(), Metrics::default());
        let counters = Counters::default();
        tracing::subscriber::with_default(events.clone(), || {
            metrics::with_local_recorder(&metrics, || {
                counters.attempted(&entry, &retry, Duration::from_millis(3));
                counters.attempted(&entry, &Settlement::Completed, Duration::from_millis(1));
            });
        });

        let attempts = events.named("idemstore::dispatch", "attempt");
        assert_eq!(attempts.len(), 2, "{attempts:#?}");
        let retried = &attempts[0];
        assert_eq!(retried.level, tracing::Level::INFO);
        for (field, value) in [
            ("id", "7"),
            ("destination", "mailer"),
            ("attempt", "2"),
            ("outcome", "retried"),
            ("reason", "http_500"),
            ("latency_us", "3000"),
        ] {
            assert_eq!(retried.field(field), Some(value), "{field}");
        }
        let delivered = &attempts[1];
        assert_eq!(delivered.level, tracing::Level::DEBUG);
        assert_eq!(delivered.field("outcome"), Some("delivered"));
        assert_eq!(delivered.field("reason"), None);
        let send = |outcome| {
            metrics.histogram(
                "idemstore_dispatch_send_seconds",
                &[("outcome", outcome), ("destination", "mailer")],
            )
        };
        assert_eq!(send("retried"), [0.003]);
        assert_eq!(send("delivered"), [0.001]);
        // Counting is `settled`'s.
        assert_eq!(counters.snapshot().retried, 0);
    }

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Histogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let s = h.summary();
        assert_eq!(s.count, 1000);
        let p50 = s.p50.as_micros();
        assert!((500..=570).contains(&p50), "{p50}");
        let p99 = s.p99.as_micros();
        assert!((990..=1000).contains(&p99), "{p99}");
        assert_eq!(s.max, Duration::from_millis(1));
        assert_eq!(Histogram::default().summary(), LatencySummary::default());
        for us in [0u64, 7, 8, 9, 1 << 20, u64::MAX >> 1] {
            assert!(Histogram::upper(Histogram::index(us)) >= us, "{us}");
        }
    }
}
